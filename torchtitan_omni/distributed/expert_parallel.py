"""Expert parallel: experts split over the ``ep`` mesh, tokens exchanged by all-to-all.

The contract with the MoE layer (``torchtitan_omni.modules.moe``): the layer routes its local
tokens, sorts the routed copies by expert and calls its ``dispatcher``::

    x_local, counts_local, state = moe.dispatcher.dispatch(x_sorted, counts)
    y_local = moe.experts(x_local, counts_local)        # grouped GEMM over local experts
    y_sorted = moe.dispatcher.combine(y_local, state)

``x_sorted`` is ``[N, dim]`` (N = tokens x top_k, grouped by expert id), ``counts`` ``[E]``
int64 routed copies per expert. Without EP the dispatcher is the identity
(``torchtitan_omni.modules.moe.LocalDispatcher``). With EP degree P, rank r owns experts
``[r E/P, (r+1) E/P)``: :class:`ExpertParallelDispatcher` first exchanges the per-expert counts, then sends every
token copy to its expert's rank (uneven all-to-all), regroups what arrived by local expert,
and ``combine`` undoes both steps. The experts' parameters (``[E, ...]``) become DTensors
sharded on dim 0 over ``ep``; their forward must use ``w.to_local()`` when ``w`` is a DTensor.
The ``ep`` mesh borrows ranks from dp_shard x sp, so with sequence parallel the tokens of
every SP slice in an EP group are exchanged too.

Experts' FSDP is applied by ``torchtitan_omni.distributed.parallelize`` over the ``efsdp``
mesh (never the dense one): the ranks holding the same experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_omni.distributed.comm import ProcessGroup, all_to_all_v, exchange_counts


class _Permute(Function):
    """``x[perm]`` whose backward is ``grad[inverse]`` (gathers only: deterministic)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


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


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class ExpertParallelDispatcher:
    """Token dispatch and combine over an expert-parallel process group."""

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
        local = self.num_experts // self.degree
        with torch.no_grad():
            send = counts.to(torch.int64).view(self.degree, local)
            recv = exchange_counts(send, self.group)
            # One host sync per layer: the collective needs the split sizes on the host.
            splits = torch.stack([send.sum(1), recv.sum(1)]).cpu()
        in_splits, out_splits = splits[0].tolist(), splits[1].tolist()
        received = all_to_all_v(x, out_splits, in_splits, self.group)
        total = sum(out_splits)
        perm = _expert_major_order(recv, total)
        inverse = _inverse(perm)
        grouped = _Permute.apply(received, perm, inverse)
        return grouped, recv.sum(0), (perm, inverse, in_splits, out_splits)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Return expert outputs to the ranks (and rows) their tokens came from."""
        perm, inverse, in_splits, out_splits = state
        back = _Permute.apply(y, inverse, perm)
        return all_to_all_v(back, in_splits, out_splits, self.group)


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
        dist_p = nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad)
        experts.register_parameter(name, dist_p)
    return num_experts


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


def apply_expert_parallel(model: nn.Module, experts_names: list[str], ep_mesh: DeviceMesh) -> None:
    """Shard each experts module over ``ep`` and install the all-to-all dispatcher."""
    group = ep_mesh.get_group()
    for name in experts_names:
        experts = model.get_submodule(name)
        num_experts = shard_experts(experts, ep_mesh)
        find_moe_layer(model, name).dispatcher = ExpertParallelDispatcher(group, num_experts)
