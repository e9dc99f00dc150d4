"""Expert parallel: experts split over the ``ep`` mesh, tokens exchanged by all-to-all.

The contract with the MoE layer (``torchtitan_omni.modules.moe``): the layer routes its local
tokens, sorts the routed copies by expert and calls its ``dispatcher``::

    x_local, counts_local, state = moe.dispatcher.dispatch(x_sorted, counts)
    y_local = moe.experts(x_local, counts_local)        # grouped GEMM over local experts
    y_sorted = moe.dispatcher.combine(y_local, state)

``x_sorted`` is ``[N, dim]`` (N = tokens x top_k, grouped by expert id), ``counts`` ``[E]``
int64 routed copies per expert. Without EP the dispatcher is the identity
(``torchtitan_omni.modules.moe.LocalDispatcher``). With EP degree P, rank r owns experts
``[r E/P, (r+1) E/P)``. Two dispatchers, chosen by ``parallelism.expert_capacity_factor``:

- 0 (default), exact: :class:`ExpertParallelDispatcher` first exchanges the per-expert counts,
  reads the split sizes on the host (one sync per layer and pass; under full activation
  checkpointing the recompute replays the forward's sizes instead,
  ``torchtitan_omni.distributed.recompute_tape``), sends every token copy to
  its expert's rank (uneven all-to-all), regroups what arrived by local expert, and
  ``combine`` undoes both steps. Nothing is dropped; ``torch.compile`` breaks the block's
  graph at the host read. With
  ``parallelism.expert_exchange = "nvshmem"``,
  :class:`~torchtitan_omni.distributed.expert_device_splits.DeviceSplitExpertParallelDispatcher`
  does the same with the split sizes on the device (no host read). With
  ``parallelism.expert_dispatch = "tokens"``,
  :class:`TokenExpertParallelDispatcher` (``torchtitan_omni.distributed.expert_tokens``) sends
  each token once to every rank holding one of its experts and gets back one weighted sum per
  token and rank (fewer rows each way when a token's experts share ranks). With
  ``parallelism.expert_dispatch = "gather"``,
  :class:`~torchtitan_omni.distributed.expert_gather.GatherExpertParallelDispatcher` sends no
  routed rows: it all-gathers the group's tokens, runs its experts over the copies routed to
  them and reduce-scatters the weighted sums (no host read, fixed shapes).
- > 0, capacity-padded: :class:`CapacityExpertParallelDispatcher` gives every (source rank,
  expert) pair a fixed number of slots (``torchtitan_omni.modules.moe_capacity``), so the
  all-to-all has equal, static blocks: no host read (the block's graph still breaks around the
  experts' own FSDP unit). Copies beyond capacity are dropped and counted. With
  ``parallelism.expert_dispatch_chunks`` > 1 the exchange is cut into chunks overlapped with
  the experts (``torchtitan_omni.distributed.expert_overlap``).

Without EP a positive factor installs the single-rank ``CapacityDispatcher`` (same drops as
under EP: the rule depends only on each rank's own tokens). The experts' parameters
(``[E, ...]``) become DTensors sharded on dim 0 over ``ep``; their forward must use
``w.to_local()`` when ``w`` is a DTensor. The ``ep`` mesh borrows ranks from dp_shard x sp,
so with sequence parallel the tokens of every SP slice in an EP group are exchanged too.

Experts' FSDP is applied by ``torchtitan_omni.distributed.parallelize`` over the ``efsdp``
mesh (never the dense one): the ranks holding the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_omni.distributed.comm import (
    ProcessGroup, all_to_all_blocks, all_to_all_v, exchange_counts,
)
from torchtitan_omni.distributed.expert_device_splits import DeviceSplitExpertParallelDispatcher
from torchtitan_omni.distributed.expert_gather import GatherExpertParallelDispatcher
from torchtitan_omni.distributed.expert_overlap import ChunkedExchange
from torchtitan_omni.distributed.expert_tokens import TokenExchange, check_header_fits
from torchtitan_omni.distributed.recompute_tape import recorded_or_replayed
from torchtitan_omni.modules.moe_capacity import CapacityDispatcher
from torchtitan_omni.modules.row_maps import inverse_permutation, permute_rows


def _expert_major_order(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Row order turning ``(source rank, local expert)`` blocks into ``(local expert, source)``.

    ``recv[s, l]``: rows received from rank ``s`` for local expert ``l``, laid out in that
    (s, l) order.
    """
    sizes = recv.reshape(-1)
    starts = sizes.cumsum(0) - sizes
    ranks, local = recv.shape
    order = torch.arange(ranks * local, device=recv.device).view(ranks, local).t().reshape(-1)
    block_sizes, block_starts = sizes[order], starts[order]
    begin = torch.repeat_interleave(block_starts, block_sizes, output_size=total)
    offset_in_block = torch.arange(total, device=recv.device) - torch.repeat_interleave(
        block_sizes.cumsum(0) - block_sizes, block_sizes, output_size=total
    )
    return begin + offset_in_block


class ExpertParallelDispatcher:
    """Exact token dispatch and combine over an expert-parallel process group (uneven
    all-to-all, split sizes read on the host)."""

    #: the split sizes are read on the host: torch.compile breaks the block's graph here
    host_sync = True

    def __init__(self, group: ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.degree = group.size()
        if num_experts % self.degree:
            raise ValueError(
                f"expert parallel degree {self.degree} does not divide {num_experts} experts"
            )
        self.num_experts = num_experts

    def __repr__(self) -> str:
        return f"ExpertParallelDispatcher(degree={self.degree}, experts={self.num_experts})"

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """Send routed token copies to their experts' ranks; see the module docstring."""
        if counts.numel() != self.num_experts:
            raise ValueError(
                f"dispatch: counts has {counts.numel()} experts, the layer has {self.num_experts}"
            )
        recv, in_splits, out_splits = self._sizes(counts)
        received = all_to_all_v(x, out_splits, in_splits, self.group)
        total = sum(out_splits)
        perm = _expert_major_order(recv, total)
        inverse = inverse_permutation(perm)
        grouped = permute_rows(received, perm, inverse)
        return grouped, recv.sum(0), (perm, inverse, in_splits, out_splits)

    # host values: torch.compile breaks the graph at this call, whether they are read or
    # replayed (traced, the replay specializes on the sizes first: more graphs compiled)
    @torch.compiler.disable
    def _sizes(self, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """Rows received per (source rank, local expert) ``[P, E/P]``, and the rows sent to and
        received from each rank: exchanged and read on the host in the forward, replayed in
        the recompute of a checkpointed one (same routing, same sizes: ``recompute_tape``; a
        recompute that routed otherwise fails ``all_to_all_v``'s check of the rows sent)."""
        def read() -> tuple[torch.Tensor, list[int], list[int]]:
            local = self.num_experts // self.degree
            with torch.no_grad():
                send = counts.to(torch.int64).view(self.degree, local)
                recv = exchange_counts(send, self.group)
                # one host sync: the collective needs the split sizes on the host
                splits = torch.stack([send.sum(1), recv.sum(1)]).cpu()
            return recv, splits[0].tolist(), splits[1].tolist()

        return recorded_or_replayed(read)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Return expert outputs to the ranks (and rows) their tokens came from."""
        perm, inverse, in_splits, out_splits = state
        back = permute_rows(y, inverse, perm)
        return all_to_all_v(back, in_splits, out_splits, self.group)

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """Nothing is dropped."""
        return torch.zeros_like(counts)


class TokenExpertParallelDispatcher(TokenExchange, ExpertParallelDispatcher):
    """:class:`ExpertParallelDispatcher` whose layer exchanges each token once per rank holding
    one of its experts, and one weighted sum back (``run_tokens``,
    ``torchtitan_omni.distributed.expert_tokens``); nothing dropped."""

    def __init__(self, group: ProcessGroup, num_experts: int) -> None:
        super().__init__(group, num_experts)
        check_header_fits(num_experts // self.degree)

    def __repr__(self) -> str:
        return f"TokenExpertParallelDispatcher(degree={self.degree}, experts={self.num_experts})"


class CapacityExpertParallelDispatcher(CapacityDispatcher):
    """Capacity-padded dispatch over an expert-parallel group: equal all-to-all of fixed-size
    slot blocks (``torchtitan_omni.modules.moe_capacity``). ``tokens`` (tokens per micro-batch
    of a rank) must be the same on every rank of the group: it sets the block size."""

    def __init__(self, group: ProcessGroup, num_experts: int, top_k: int, factor: float,
                 tokens: int | None) -> None:
        if tokens is None:
            raise ValueError("capacity-padded expert parallel needs the tokens per micro-batch")
        super().__init__(num_experts, top_k, factor, tokens, ranks=group.size())
        self.group = group

    def exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        return all_to_all_blocks(blocks, self.group)


class ChunkedCapacityExpertParallelDispatcher(ChunkedExchange, CapacityExpertParallelDispatcher):
    """:class:`CapacityExpertParallelDispatcher` whose ``run`` exchanges in ``chunks``
    overlapped with the experts (``torchtitan_omni.distributed.expert_overlap``); the same
    drops and counts."""

    def __init__(self, group: ProcessGroup, num_experts: int, top_k: int, factor: float,
                 tokens: int | None, chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"expert dispatch chunks must be >= 1, got {chunks}")
        super().__init__(group, num_experts, top_k, factor, tokens)
        self.chunks = chunks

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", chunks={self.chunks})"


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Turn the experts' ``[E, ...]`` parameters into DTensors sharded on dim 0 over ``ep``;
    returns E."""
    params = list(experts.named_parameters(recurse=False))
    if not params:
        raise ValueError(f"{type(experts).__name__} has no parameters of its own to shard")
    num_experts = params[0][1].shape[0]
    degree = ep_mesh.size()
    for name, p in params:
        if isinstance(p, DTensor):
            raise ValueError(f"experts parameter {name!r} is already distributed")
        if p.shape[0] != num_experts:
            raise ValueError(
                f"experts parameter {name!r} has {p.shape[0]} rows on dim 0, expected one per "
                f"expert ({num_experts})"
            )
        if num_experts % degree:
            raise ValueError(
                f"expert_parallel_degree {degree} does not divide the {num_experts} experts"
            )
        dist_p = nn.Parameter(
            distribute_tensor(p, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad
        )
        experts.register_parameter(name, dist_p)
    return num_experts


def expert_parallel_layers(module: nn.Module) -> list[nn.Module]:
    """The MoE layers within ``module`` (itself included) whose dispatcher exchanges tokens
    over an expert-parallel group of more than one rank."""
    layers = []
    for m in module.modules():
        group = getattr(getattr(m, "dispatcher", None), "group", None)
        if isinstance(group, dist.ProcessGroup) and group.size() > 1:
            layers.append(m)
    return layers


def find_moe_layer(model: nn.Module, experts_name: str) -> nn.Module:
    """The module holding the ``dispatcher`` for the experts at ``experts_name`` (the experts
    module itself or its parent)."""
    experts = model.get_submodule(experts_name)
    if hasattr(experts, "dispatcher"):
        return experts
    parent_name = experts_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    if not hasattr(parent, "dispatcher"):
        raise ValueError(
            f"the plan lists {experts_name!r} as experts, but neither it nor its parent has a "
            "`dispatcher` attribute (see torchtitan_omni.distributed.expert_parallel)"
        )
    return parent


def make_dispatcher(num_experts: int, top_k: int, group: ProcessGroup | None,
                    capacity_factor: float, tokens: int | None, chunks: int = 1,
                    unit: str = "copies", exchange: str = "nccl"):
    """The dispatcher for a layer: exact or capacity-padded (``capacity_factor`` > 0), over
    ``group`` or local (None); None when the default local exact one fits. ``chunks`` > 1:
    the capacity-padded expert-parallel exchange in that many overlapped chunks
    (``torchtitan_omni.distributed.expert_overlap``; the start-up check refuses chunks > 1
    without EP, where there is nothing to exchange; here they leave the local dispatcher
    as it is). ``unit`` (``parallelism.expert_dispatch``): "tokens" sends each token once per
    rank (``torchtitan_omni.distributed.expert_tokens``), "gather" gathers the group's tokens
    and reduce-scatters the results (``torchtitan_omni.distributed.expert_gather``; needs
    ``tokens``); both exact dispatch only; without EP they leave the local dispatcher as it
    is, like ``chunks``. ``exchange``
    (``parallelism.expert_exchange``): "nvshmem" moves the exact dispatcher's rows with split
    sizes on the device (``torchtitan_omni.distributed.expert_device_splits``; needs
    ``tokens``)."""
    if chunks < 1:
        raise ValueError(f"expert dispatch chunks must be >= 1, got {chunks}")
    if chunks > 1 and not capacity_factor > 0:
        raise ValueError("expert dispatch chunks > 1 need the capacity-padded dispatcher "
                         "(capacity factor > 0): the exact one reads its splits on the host")
    if unit not in ("copies", "tokens", "gather"):
        raise ValueError(
            f"expert dispatch unit must be 'copies', 'tokens' or 'gather', got {unit!r}")
    if unit != "copies" and capacity_factor > 0:
        raise ValueError(f"expert dispatch {unit!r} is exact only: capacity factor must be 0")
    if capacity_factor > 0:
        if group is None or group.size() == 1:
            return CapacityDispatcher(num_experts, top_k, capacity_factor, tokens)
        if chunks > 1:
            return ChunkedCapacityExpertParallelDispatcher(
                group, num_experts, top_k, capacity_factor, tokens, chunks)
        return CapacityExpertParallelDispatcher(group, num_experts, top_k, capacity_factor, tokens)
    if group is None or group.size() == 1:
        return None
    if unit == "tokens":
        return TokenExpertParallelDispatcher(group, num_experts)
    if unit == "gather":
        if tokens is None:
            raise ValueError("the gather expert dispatch needs the tokens per micro-batch")
        return GatherExpertParallelDispatcher(group, num_experts, tokens)
    if exchange == "nvshmem":
        if tokens is None:
            raise ValueError("the device-split expert exchange needs the tokens per micro-batch")
        return DeviceSplitExpertParallelDispatcher(group, num_experts, tokens * top_k)
    return ExpertParallelDispatcher(group, num_experts)


def apply_expert_parallel(model: nn.Module, experts_names: list[str], ep_mesh: DeviceMesh | None,
                          capacity_factor: float = 0.0, tokens: int | None = None,
                          chunks: int = 1, unit: str = "copies", exchange: str = "nccl") -> None:
    """Shard each experts module over ``ep`` (when given) and install the dispatcher chosen by
    :func:`make_dispatcher`; ``tokens``: tokens per micro-batch of a rank (capacity);
    ``chunks``: ``parallelism.expert_dispatch_chunks``; ``unit``:
    ``parallelism.expert_dispatch``; ``exchange``: ``parallelism.expert_exchange``."""
    group = ep_mesh.get_group() if ep_mesh is not None else None
    for name in experts_names:
        experts = model.get_submodule(name)
        if ep_mesh is not None:
            num_experts = shard_experts(experts, ep_mesh)
        else:
            num_experts = next(experts.parameters(recurse=False)).shape[0]
        layer = find_moe_layer(model, name)
        dispatcher = make_dispatcher(num_experts, getattr(layer, "top_k", 1), group,
                                     capacity_factor, tokens, chunks, unit, exchange)
        if dispatcher is not None:
            layer.dispatcher = dispatcher
