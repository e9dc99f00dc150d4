"""Differentiable collectives: the all-to-alls of Ulysses and expert parallel, and a gather of
variable-length rows.

Every function here is differentiable, its backward the adjoint collective, so gradients flow
across ranks exactly as activations did. They take a ``ProcessGroup`` (use
``mesh.get_group()``) and work on gloo (CPU) and NCCL.

Expert parallel exchanges token copies with :func:`all_to_all_v` (uneven: the split sizes are
read on the host) or :func:`all_to_all_blocks` (equal, capacity-padded blocks: no host read).
The chunked dispatch that overlaps its exchanges with the experts splits the latter in two:
:func:`all_to_all_blocks_launch` / :func:`all_to_all_blocks_wait`, asynchronous in both
directions (the wait's backward launches the gradient exchange, the launch's backward waits
for it), through functional collective ops that ``torch.compile`` traces.

Ulysses swaps a split sequence for split heads with :func:`all_to_all` (sync; PyTorch's
functional collectives, so ``torch.compile`` traces it into a block's graph) or with the
:func:`all_to_all_start` / :func:`all_to_all_wait` pair (async): the pair launches the
collective, lets the caller compute meanwhile, and waits only when the result is used. The
backward of the pair is asynchronous too: ``all_to_all_wait``'s backward launches the gradient
all-to-all and ``all_to_all_start``'s backward waits for it, so the autograd engine (which runs
nodes in reverse creation order) computes the projections' gradients while the next
gradient all-to-all is in flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

from torchtitan_omni.compat import all_to_all_launch, all_to_all_traceable, collective_wait
from torchtitan_omni.platform import local_device

ProcessGroup = dist.ProcessGroup


class GroupShape:
    """A process group's size and this rank's place in it, with no communication: what a
    rank's local work needs (``GatherExpertParallelDispatcher.run_local``) to be timed or
    tested alone, on one process."""

    def __init__(self, size: int, rank: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self._size, self._rank = size, rank

    def size(self) -> int:
        """Ranks in the group."""
        return self._size

    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank


# ----------------------------------------------------------------- even all-to-all (Ulysses)
def _pack(x: torch.Tensor, scatter_dim: int, world: int) -> torch.Tensor:
    """``x`` -> ``[world, *x.shape]`` with ``scatter_dim`` divided: chunk ``j`` goes to rank
    ``j``."""
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of a tensor of shape {tuple(x.shape)} is not "
            f"divisible by the group size {world}"
        )
    return x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0).contiguous()


def _unpack(buf: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """Received ``[world, ...]`` -> chunks concatenated along ``gather_dim`` in rank order."""
    # A view of ``buf`` when the layout allows (batch of one row): no copy.
    return buf.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1).contiguous()


def _launch(packed: torch.Tensor, group: ProcessGroup, async_op: bool):
    out = torch.empty_like(packed)
    work = dist.all_to_all_single(out, packed, group=group, async_op=async_op)
    return out, work


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup
) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` over the group and concatenate what arrives along
    ``gather_dim`` (rank order). Ulysses: ``scatter_dim`` = heads, ``gather_dim`` = sequence.

    Through PyTorch's functional collectives, whose backward is the reverse all-to-all and
    which ``torch.compile`` traces into a block's graph.
    """
    if group.size() == 1:
        return x
    packed = _pack(x, scatter_dim, group.size())
    out = all_to_all_traceable(packed, group)
    return _unpack(out, gather_dim)


class PendingAllToAll:
    """An all-to-all in flight between :func:`all_to_all_start` and :func:`all_to_all_wait`
    (one object per call; it also carries the backward's collective)."""

    __slots__ = ("work", "keep", "grad_work", "grad_keep")

    def __init__(self) -> None:
        self.work = self.keep = self.grad_work = self.grad_keep = None


class _Start(Function):
    @staticmethod
    def forward(ctx, x, pending: PendingAllToAll, scatter_dim: int, gather_dim: int, group):
        ctx.pending, ctx.scatter_dim = pending, scatter_dim
        packed = _pack(x, scatter_dim, group.size())
        out, pending.work = _launch(packed, group, async_op=True)
        pending.keep = packed  # the send buffer must outlive the collective
        return out

    @staticmethod
    def backward(ctx, grad_buf):
        pending = ctx.pending
        pending.grad_work.wait()
        pending.grad_work = pending.grad_keep = None
        # grad_buf is the buffer filled by the gradient all-to-all launched in _Wait.backward
        return _unpack(grad_buf, ctx.scatter_dim), None, None, None, None


class _Wait(Function):
    @staticmethod
    def forward(ctx, buf, pending: PendingAllToAll, gather_dim: int, group):
        ctx.pending, ctx.gather_dim, ctx.group = pending, gather_dim, group
        pending.work.wait()
        pending.work = pending.keep = None
        return _unpack(buf, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        packed = _pack(grad, ctx.gather_dim, ctx.group.size())
        out, pending.grad_work = _launch(packed, ctx.group, async_op=True)
        pending.grad_keep = packed
        # Not yet the gradient: _Start.backward waits for it before anyone reads it.
        return out, None, None, None


def all_to_all_start(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup
) -> tuple[torch.Tensor, PendingAllToAll]:
    """Launch :func:`all_to_all` without waiting; pass the result to :func:`all_to_all_wait`."""
    pending = PendingAllToAll()
    return _Start.apply(x, pending, scatter_dim, gather_dim, group), pending


def all_to_all_wait(
    buf: torch.Tensor, pending: PendingAllToAll, gather_dim: int, group: ProcessGroup
) -> torch.Tensor:
    """Wait for an :func:`all_to_all_start` and lay its result out along ``gather_dim``."""
    return _Wait.apply(buf, pending, gather_dim, group)


class _AllToAllLinear(Function):
    """``linear(all_to_all(x), w, b)`` whose backward overlaps the input-gradient all-to-all
    with the weight-gradient matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, scatter_dim: int, gather_dim: int, group):
        out, _ = _launch(_pack(x, scatter_dim, group.size()), group, async_op=False)
        x_full = _unpack(out, gather_dim)
        x_seq = x_full.flatten(-2)
        # Under autocast the linear runs in the activations' dtype, as nn.Linear would.
        w = weight.to(x_seq.dtype)
        b = bias.to(x_seq.dtype) if bias is not None else None
        ctx.save_for_backward(x_seq, w)
        ctx.has_bias, ctx.dims, ctx.group = bias is not None, (scatter_dim, gather_dim), group
        ctx.x_shape, ctx.param_dtype = x_full.shape, weight.dtype
        return torch.nn.functional.linear(x_seq, w, b)

    @staticmethod
    def backward(ctx, grad):
        x_seq, weight = ctx.saved_tensors
        scatter_dim, gather_dim = ctx.dims
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad2.mm(weight).view(ctx.x_shape)
        packed = _pack(grad_x, gather_dim, ctx.group.size())
        buf, work = _launch(packed, ctx.group, async_op=True)
        # Computed while the input gradient travels.
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = grad2.t().mm(x_seq.reshape(-1, x_seq.shape[-1])).to(ctx.param_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0).to(ctx.param_dtype)
        work.wait()
        return _unpack(buf, scatter_dim), grad_w, grad_b, None, None, None


def all_to_all_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scatter_dim: int,
    gather_dim: int, group: ProcessGroup,
) -> torch.Tensor:
    """``F.linear(all_to_all(x, ...).flatten(-2), weight, bias)`` with an overlapped backward.

    ``x`` is ``[..., heads, head_dim]``; the last two dimensions are flattened for the linear.
    """
    return _AllToAllLinear.apply(x, weight, bias, scatter_dim, gather_dim, group)


def all_to_all_blocks(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` ``[world, ...]``: block ``j`` goes to rank ``j``; returns ``[world, ...]`` with
    block ``i`` from rank ``i``. Equal blocks, so the split sizes come from the shape alone
    (no host read); PyTorch's functional collective, traced by ``torch.compile``, whose
    backward is the same exchange of the gradients."""
    _check_blocks(x, group)
    if group.size() == 1:
        return x
    return all_to_all_traceable(x.contiguous(), group)


def _check_blocks(x: torch.Tensor, group: ProcessGroup) -> None:
    if x.shape[0] != group.size():
        raise ValueError(f"all_to_all_blocks: {x.shape[0]} blocks for a group of {group.size()}")


class _BlocksLaunch(Function):
    """Forward: launch the exchange (not waited). Backward: wait for the gradient exchange
    that the paired :class:`_BlocksWait`'s backward launched (it arrives as ``grad_buf``)."""

    @staticmethod
    def forward(ctx, x, world: int, name: str, on_backward):
        ctx.on_backward = on_backward
        return all_to_all_launch(x.contiguous(), world, name)

    @staticmethod
    def backward(ctx, grad_buf):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return collective_wait(grad_buf), None, None, None


class _BlocksWait(Function):
    """Forward: wait for a :class:`_BlocksLaunch`. Backward: launch the reverse exchange of
    the gradient and hand the pending buffer on, not waited."""

    @staticmethod
    def forward(ctx, buf, world: int, name: str, on_backward):
        ctx.world, ctx.name, ctx.on_backward = world, name, on_backward
        return collective_wait(buf)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return all_to_all_launch(grad.contiguous(), ctx.world, ctx.name), None, None, None


def all_to_all_blocks_launch(x: torch.Tensor, group: ProcessGroup,
                             on_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """:func:`all_to_all_blocks` launched, not waited: pass the result (unreadable until
    then) to :func:`all_to_all_blocks_wait`. The pair's backward is asynchronous the other way
    round: the wait's backward launches the gradient exchange and this one's backward waits
    for it, so whatever the autograd engine runs between those two nodes (it runs nodes in
    reverse creation order) overlaps it. ``on_backward`` (a test hook, eager only) is called
    when this backward waits."""
    _check_blocks(x, group)
    if group.size() == 1:
        return x
    return _BlocksLaunch.apply(x, group.size(), group.group_name, on_backward)


def all_to_all_blocks_wait(buf: torch.Tensor, group: ProcessGroup,
                           on_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """Wait for an :func:`all_to_all_blocks_launch`; its backward launches the gradient's
    exchange without waiting. ``on_backward`` (a test hook, eager only) is called when that
    backward launches."""
    if group.size() == 1:
        return buf
    return _BlocksWait.apply(buf, group.size(), group.group_name, on_backward)


# ----------------------------------------------------------------- uneven all-to-all (EP)
class _AllToAllV(Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAllV.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_v(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:j]) : ...+in_splits[j]]`` go to rank ``j``; ``out_splits[i]``
    rows arrive from rank ``i``, concatenated in rank order (dim 0)."""
    _check_splits(x, out_splits, in_splits, group)
    if _host_rows_on_device_group(x, group):
        return all_to_all_v(x.to(local_device()), out_splits, in_splits, group).cpu()
    if torch.compiler.is_compiling():
        # torch's functional op carries the (symbolic) sizes into its backward; the Function
        # below keeps them on ctx, which dynamo fails to do for sizes that entered the frame
        # as inputs once it recompiled with them dynamic (the token dispatch's combine)
        return all_to_all_traceable(x, group, list(out_splits), list(in_splits))
    return _AllToAllV.apply(x, list(out_splits), list(in_splits), group)


def _host_rows_on_device_group(x: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether ``x`` is in host memory on a group whose backend moves device memory only
    (NCCL): item sizes live on the host (``protocols.batch.is_item_sizes``)."""
    return x.device.type == "cpu" and "gloo" not in str(dist.get_backend(group))


def _check_splits(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  group: ProcessGroup) -> None:
    """Refuse splits that do not name every rank of ``group`` or do not cover ``x``'s rows."""
    if len(in_splits) != group.size() or len(out_splits) != group.size():
        raise ValueError(f"all_to_all_v needs {group.size()} splits, got {in_splits}, {out_splits}")
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_v: splits {in_splits} do not cover {x.shape[0]} rows")


class PendingRows:
    """The rows of a launched :func:`all_to_all_v_start`: :meth:`wait` returns them."""

    def __init__(self, out: torch.Tensor, work: dist.Work | None, sent: torch.Tensor | None
                 ) -> None:
        # the sent rows stay referenced until the collective is done with them
        self._out, self._work, self._sent = out, work, sent

    def wait(self) -> torch.Tensor:
        """Block until the rows arrived (and the sent ones left); return what arrived."""
        if self._work is not None:
            self._work.wait()
            self._work = self._sent = None
        return self._out


def all_to_all_v_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                       group: ProcessGroup) -> PendingRows:
    """:func:`all_to_all_v` of data (no gradient) launched asynchronously, so that the caller
    computes while the rows travel; collectives issued after it on ``group`` keep their
    order."""
    _check_splits(x, out_splits, in_splits, group)
    if _host_rows_on_device_group(x, group):
        with torch.no_grad():  # host rows under NCCL: through the device, synchronously
            return PendingRows(all_to_all_v(x, out_splits, in_splits, group), None, None)
    x = x.detach().contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group,
                                  async_op=True)
    return PendingRows(out, work, x)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``counts`` ``[world, n]`` (row ``j`` for rank ``j``) -> ``[world, n]`` received (row
    ``i`` from rank ``i``); no gradient."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# ----------------------------------------------------------------- variable-length gather
class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x, sizes: list[int], group):
        ctx.sizes, ctx.group = sizes, group
        rank = dist.get_rank(group)
        if x.shape[0] != sizes[rank]:
            raise ValueError(
                f"gather_rows: rank {rank} has {x.shape[0]} rows, expected {sizes[rank]}"
            )
        out = x.new_empty((sum(sizes), *x.shape[1:]))
        # One all-to-all: every rank sends its rows to every rank.
        send = x.contiguous().repeat((group.size(),) + (1,) * (x.dim() - 1))
        dist.all_to_all_single(out, send, list(sizes), [x.shape[0]] * group.size(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Adjoint of "send my rows everywhere": sum what every rank computed for my rows.
        sizes, group = ctx.sizes, ctx.group
        rank = dist.get_rank(group)
        mine = sizes[rank]
        recv = grad.new_empty((mine * group.size(), *grad.shape[1:]))
        dist.all_to_all_single(
            recv, grad.contiguous(), [mine] * group.size(), list(sizes), group=group
        )
        return recv.view(group.size(), mine, *grad.shape[1:]).sum(0), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's rows (``sizes[i]`` rows from rank ``i``, known to all) on every
    rank; the backward sums the gradients of each rank's rows over the group."""
    if group.size() == 1:
        return x
    return _GatherRows.apply(x, list(sizes), group)
