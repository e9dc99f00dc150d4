"""Exact expert-parallel dispatch with the split sizes kept on the device (NVSHMEM).

The exact dispatcher (``expert_parallel.ExpertParallelDispatcher``) reads its split sizes on
the host before NCCL's uneven all-to-all: one host sync per MoE layer and pass, so the host
never runs ahead of the GPU and every launch-bound part of a step (the encoders, the
optimizer) leaves the GPU idle. ``parallelism.expert_exchange = "nvshmem"`` installs
:class:`DeviceSplitExpertParallelDispatcher` instead: the per-(rank, expert) counts are
exchanged on the device (a small NCCL all-to-all of equal blocks), the rows by torch's
symmetric-memory all-to-all-v (``torch.ops.symm_mem.all_to_all_vdev``), which takes the split
sizes as a device tensor and writes what arrived on the device, and the rows are regrouped by
local expert with device-computed maps (:func:`expert_major_maps`). Nothing is read on the
host; nothing is dropped.

What that costs: the host cannot know how many rows arrive, so the received rows live in a
buffer sized for the worst case (every copy of every rank of the group to one rank:
``ranks x rows_per_rank``); rows past the received ones are unspecified, stay in place through
the regrouping, belong to no expert group (grouped GEMM's offsets end at the received rows) and
are never sent back. The collective reads and writes symmetric buffers, allocated once per
(group, shape) and shared by every layer; each call writes its input into the send buffer and
reads its result out of the receive buffer, the regrouping's gathers doing those copies (one
pass each way), and calls alternate between two sets of buffers, so a rank never overwrites a
buffer a peer may still be reading from the previous call (each call starts with a barrier of
the group, so two sets suffice).

The row exchange is an object with one method (:class:`RowExchange`):
:class:`NvshmemRowExchange` on CUDA; tests pass one with the same contract over gloo.
:func:`nvshmem_usable` says why NVSHMEM cannot run where it cannot; the start-up check refuses
the option there.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd import Function

from torchtitan_omni.compat import all_to_all_vdev, symmetric_memory
from torchtitan_omni.distributed.comm import ProcessGroup, exchange_counts


def nvshmem_usable() -> tuple[bool, str]:
    """Whether torch's NVSHMEM all-to-all-v can run here, and if not, why (one line)."""
    if not torch.cuda.is_available():
        return False, "needs CUDA"
    symm_mem = symmetric_memory()
    if symm_mem is None or not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return False, f"torch {torch.__version__} has no symm_mem.all_to_all_vdev"
    if not symm_mem.is_nvshmem_available():
        return False, "NVSHMEM is not available to this torch build"
    return True, ""


# ----------------------------------------------------------------- regrouping on the device
def expert_major_maps(recv: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maps between the received layout and the experts' one, over ``capacity`` rows.

    ``recv[s, e]``: rows received from rank ``s`` for local expert ``e``, laid out rank-major
    ((s, e) blocks in that order) from row 0. Returns ``perm`` (expert-major row ``p`` is
    received row ``perm[p]``) and its inverse; rows past the received ones map to themselves.
    Fixed shapes, no host read.
    """
    ranks, local = recv.shape
    sizes_rm = recv.reshape(-1)
    ends_rm = sizes_rm.cumsum(0)
    starts_rm = ends_rm - sizes_rm
    sizes_em = recv.t().reshape(-1)
    ends_em = sizes_em.cumsum(0)
    starts_em = ends_em - sizes_em
    blocks = ranks * local
    rows = torch.arange(capacity, device=recv.device)
    used = ends_rm[-1]
    # expert-major block (e, s) -> rank-major block (s, e)
    b_em = torch.searchsorted(ends_em, rows, right=True).clamp_(max=blocks - 1)
    e, s = b_em // ranks, b_em % ranks
    perm = starts_rm[s * local + e] + (rows - starts_em[b_em])
    b_rm = torch.searchsorted(ends_rm, rows, right=True).clamp_(max=blocks - 1)
    s, e = b_rm // local, b_rm % local
    inverse = starts_em[e * ranks + s] + (rows - starts_rm[b_rm])
    tail = rows >= used
    return torch.where(tail, rows, perm), torch.where(tail, rows, inverse)


# ----------------------------------------------------------------- the row exchange
class RowExchange(Protocol):
    """All-to-all-v of rows with device split sizes. The rows sent are ``x``, or ``x`` gathered
    by ``send_order`` (written straight into the send buffer); rows ``[0, sum(in_splits))`` of
    those go to the ranks in order (``in_splits[j]`` to rank ``j``). What arrives lands in
    rank order from row 0 of a receive buffer (later rows unspecified); returned are its first
    ``out_rows`` rows, or the rows ``recv_order`` gathers from it (straight from the buffer),
    and the rows that came from each rank."""

    def exchange(self, x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                 send_order: torch.Tensor | None = None,
                 recv_order: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


def write_rows(buffer: torch.Tensor, x: torch.Tensor, order: torch.Tensor | None) -> None:
    """``buffer[:n] = x`` or ``x[order]``: one pass, no intermediate copy."""
    if order is None:
        buffer[: x.shape[0]].copy_(x)
    else:
        torch.index_select(x, 0, order, out=buffer[: order.numel()])


def read_rows(buffer: torch.Tensor, rows: int, order: torch.Tensor | None) -> torch.Tensor:
    """A fresh tensor of ``buffer[:rows]`` or ``buffer[order]`` (the buffer is reused)."""
    return buffer[:rows].clone() if order is None else buffer.index_select(0, order)


class _SymmetricBuffers:
    """One set of symmetric buffers: rows in and out, split sizes in, sizes and offsets out."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, ranks: int,
                 device: torch.device, group_name: str) -> None:
        symm_mem = symmetric_memory()
        self.send = symm_mem.empty(rows, dim, dtype=dtype, device=device)
        self.recv = symm_mem.empty(rows, dim, dtype=dtype, device=device)
        self.in_splits = symm_mem.empty(ranks, dtype=torch.int64, device=device)
        self.out_splits_offsets = symm_mem.empty(2, ranks, dtype=torch.int64, device=device)
        for t in (self.send, self.recv, self.in_splits, self.out_splits_offsets):
            symm_mem.rendezvous(t, group_name)


class NvshmemRowExchange:
    """:class:`RowExchange` by ``torch.ops.symm_mem.all_to_all_vdev`` over ``group``, for rows
    of ``dim`` elements of ``dtype``, at most ``capacity`` rows in or out per call."""

    def __init__(self, group: ProcessGroup, capacity: int, dim: int, dtype: torch.dtype
                 ) -> None:
        usable, why = nvshmem_usable()
        if not usable:
            raise RuntimeError(f"parallelism.expert_exchange 'nvshmem': {why}")
        symm_mem = symmetric_memory()
        self.group_name = group.group_name
        self.capacity = capacity
        device = torch.device("cuda", torch.cuda.current_device())
        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        # NVSHMEM reserves its symmetric heap at its first allocation: room for both sets
        row_bytes = dim * torch.finfo(dtype).bits // 8
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 * capacity * row_bytes + (512 << 20)))
        self._sets = [_SymmetricBuffers(capacity, dim, dtype, group.size(), device,
                                        self.group_name) for _ in range(2)]
        self._turn = 0

    def poison_received(self) -> None:
        """Fill the receive buffers with NaN (tests: rows past the received ones must never
        reach a result)."""
        for buffers in self._sets:
            buffers.recv.fill_(float("nan"))

    def exchange(self, x: torch.Tensor, in_splits: torch.Tensor, out_rows: int,
                 send_order: torch.Tensor | None = None,
                 recv_order: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] > self.capacity or out_rows > self.capacity:
            raise ValueError(f"expert exchange: {x.shape[0]} rows in, {out_rows} out, buffers "
                             f"hold {self.capacity}")
        b = self._sets[self._turn]
        self._turn ^= 1
        write_rows(b.send, x, send_order)
        b.in_splits.copy_(in_splits)
        all_to_all_vdev(b.send, b.recv, b.in_splits, b.out_splits_offsets, self.group_name)
        return read_rows(b.recv, out_rows, recv_order), b.out_splits_offsets[0].clone()


_EXCHANGES: dict[tuple, NvshmemRowExchange] = {}


def shared_nvshmem_exchange(group: ProcessGroup, capacity: int, dim: int, dtype: torch.dtype
                            ) -> NvshmemRowExchange:
    """One :class:`NvshmemRowExchange` per (group ranks, shape), shared by every layer (layers
    run one after another, so one pair of buffer sets serves them all)."""
    key = (tuple(dist.get_process_group_ranks(group)), capacity, dim, dtype)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = NvshmemRowExchange(group, capacity, dim, dtype)
    return _EXCHANGES[key]


Orders = tuple[torch.Tensor, torch.Tensor]  # a row order and its inverse


def _first(orders: Orders | None) -> torch.Tensor | None:
    return None if orders is None else orders[0]


def _second(orders: Orders | None) -> torch.Tensor | None:
    return None if orders is None else orders[1]


class _ExchangeRows(Function):
    """Differentiable :meth:`RowExchange.exchange` with the row orders as ``(order, inverse)``
    pairs: the gradient goes back the same way, the split sizes that arrived as the sizes sent,
    each order's inverse gathering on the other side."""

    @staticmethod
    def forward(ctx, x, in_splits, out_rows: int, exchange: RowExchange,
                send: Orders | None, recv: Orders | None):
        out, out_splits = exchange.exchange(x, in_splits, out_rows, _first(send), _first(recv))
        ctx.exchange, ctx.rows, ctx.send, ctx.recv = exchange, x.shape[0], send, recv
        ctx.save_for_backward(out_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out_splits,) = ctx.saved_tensors
        grad_x, _ = ctx.exchange.exchange(grad.contiguous(), out_splits, ctx.rows,
                                          _second(ctx.recv), _second(ctx.send))
        return grad_x, None, None, None, None, None


# ----------------------------------------------------------------- the dispatcher
class DeviceSplitExpertParallelDispatcher:
    """Exact dispatch and combine over an expert-parallel group with no host read (see the
    module docstring). ``rows_per_rank``: the most routed copies a rank sends in one call
    (tokens per micro-batch x top-k), the same on every rank of the group."""

    host_sync = False

    def __init__(self, group: ProcessGroup, num_experts: int, rows_per_rank: int,
                 exchange: RowExchange | None = None) -> None:
        self.group = group
        self.degree = group.size()
        if num_experts % self.degree:
            raise ValueError(
                f"expert parallel degree {self.degree} does not divide {num_experts} experts")
        self.num_experts = num_experts
        self.rows_per_rank = rows_per_rank
        self.capacity = self.degree * rows_per_rank
        self._exchange = exchange

    def __repr__(self) -> str:
        return (f"DeviceSplitExpertParallelDispatcher(degree={self.degree}, "
                f"experts={self.num_experts}, rows_per_rank={self.rows_per_rank})")

    def row_exchange(self, x: torch.Tensor) -> RowExchange:
        """The row exchange for rows like ``x`` (made at the first call: a collective)."""
        if self._exchange is None:
            self._exchange = shared_nvshmem_exchange(self.group, self.capacity, x.shape[1],
                                                     x.dtype)
        return self._exchange

    @torch.compiler.disable  # symmetric buffers alternate in Python state
    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """Send routed copies to their experts' ranks; returns the received rows grouped by
        local expert (``capacity`` rows, the groups first), the rows per local expert and
        what :meth:`combine` needs."""
        if x.shape[0] > self.rows_per_rank:
            raise ValueError(f"expert dispatch: {x.shape[0]} routed copies on this rank, the "
                             f"buffers are sized for {self.rows_per_rank} (tokens x top-k)")
        local = self.num_experts // self.degree
        with torch.no_grad():
            send = counts.to(torch.int64).view(self.degree, local)
            recv = exchange_counts(send, self.group)
            perm, inverse = expert_major_maps(recv, self.capacity)
        # received rows gathered into expert-major order straight from the receive buffer
        grouped = _ExchangeRows.apply(x, send.sum(1), self.capacity, self.row_exchange(x),
                                      None, (perm, inverse))
        return grouped, recv.sum(0), (perm, inverse, recv.sum(1), x.shape[0])

    @torch.compiler.disable
    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Return expert outputs to the ranks (and rows) their copies came from."""
        perm, inverse, back_splits, rows = state
        # expert-major rows written back in rank-major order straight into the send buffer
        return _ExchangeRows.apply(y, back_splits, rows, self.row_exchange(y),
                                   (inverse, perm), None)

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """Nothing is dropped."""
        return torch.zeros_like(counts)
