"""Exact expert-parallel dispatch by gathering the group's tokens
(``parallelism.expert_dispatch = "gather"``).

The all-to-all dispatchers (``expert_parallel``, ``expert_tokens``) send each rank the rows its
experts need, so the sizes of what arrives depend on the routing: NCCL's uneven all-to-all
wants them on the host, and reading them makes the host wait for the GPU once per MoE layer
and pass. This dispatcher sends no routed rows at all:

1. every rank gathers the tokens of its expert-parallel group, with their router choices and
   weights (all-gather: ``ranks x tokens`` rows, the same count whatever the routing);
2. each rank picks, among all those tokens' ``k`` choices, the copies its own experts hold,
   sorts them by local expert on the device, and runs its experts over them (grouped GEMM
   whose group sizes are device values: rows past the last group belong to no expert and are
   never read, forward and backward);
3. it puts the outputs back in (token, choice) order and sums each gathered token's copies
   weighed by their router weights (the copies of other ranks' experts count zero): one
   partial output per token of the group;
4. a reduce-scatter adds the partial outputs over the ranks and hands each rank its own
   tokens' rows.

Nothing is read on the host and every shape is fixed by the tokens per micro-batch, so the
layer is one graph to ``torch.compile``. Each exchange moves ``(ranks - 1) x tokens`` rows per
rank each way, against ``tokens x top_k x (ranks - 1) / ranks`` for the copies dispatcher: 4x
fewer at EP2 with top 8, 2x fewer at EP4, the same at EP8. The price is memory: the sorted
copies live in a buffer sized for the worst case (``ranks x tokens x top_k`` rows: every copy
of the group on this rank), 2x the copies dispatcher's average at EP2. On CUDA the passes over
that buffer (the gather, the experts' SwiGLU product and input-gradient sum, the un-sort and
sum, their backwards) touch only the rows this rank's experts use (``modules.local_copies``'
kernels: a quarter of the buffer on average at EP4).

The backward is the collectives' adjoints (reduce-scatter of the gathered rows' gradients,
all-gather of the output gradients) through torch's functional collectives. Exact: nothing is
dropped; the output is the copies dispatcher's up to floating-point summation order (each
token's experts are summed per rank, then over ranks), router weights rounded to the tokens'
dtype as the copies path rounds them when it weighs the expert outputs. All index maps are
permutations or placements at distinct rows (``modules.row_maps``): deterministic on GPU.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_omni.compat import all_gather_traceable, reduce_scatter_traceable
from torchtitan_omni.distributed.comm import ProcessGroup
from torchtitan_omni.modules.local_copies import combine_copies, gather_copies
from torchtitan_omni.modules.moe import combine, gather_sorted, sort_by_expert, sorted_inverse


class GatherExpertParallelDispatcher:
    """Exact expert-parallel dispatch without routed all-to-alls (see the module docstring):
    ``run_tokens`` all-gathers the group's tokens, runs this rank's experts over the copies
    routed to them, and reduce-scatters the weighted sums. ``tokens``: the most tokens a rank
    brings to one call (tokens per micro-batch); fewer are padded to it, so every rank of the
    group gathers the same rows. ``kernels``: the passes over the worst-case buffer through
    ``modules.local_copies`` over the used rows only (its Triton kernels on CUDA, torch's ops
    elsewhere), or, False, over every row, those past this rank's copies masked to zero (the
    baseline of ``scripts/bench_gather_dispatch.py``)."""

    host_sync = False

    def __init__(self, group: ProcessGroup, num_experts: int, tokens: int,
                 kernels: bool = True) -> None:
        self.group = group
        self.kernels = kernels
        self.degree = group.size()
        self.rank = group.rank()
        if num_experts % self.degree:
            raise ValueError(
                f"expert parallel degree {self.degree} does not divide {num_experts} experts")
        if tokens < 1:
            raise ValueError(f"the gather dispatch needs the tokens per micro-batch, got {tokens}")
        self.num_experts = num_experts
        self.tokens = tokens

    def __repr__(self) -> str:
        return (f"GatherExpertParallelDispatcher(degree={self.degree}, "
                f"experts={self.num_experts}, tokens={self.tokens})")

    def run_tokens(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                   indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[N, D]``: each token's router-weighted sum of its ``k`` experts' outputs.

        ``x`` ``[N, D]`` tokens, ``weights``/``indices`` ``[N, k]`` the router's choices,
        ``counts`` ``[E]`` copies per (global) expert (unused: nothing is sized by it)."""
        del counts
        n, dim = x.shape
        k = indices.shape[1]
        if n > self.tokens:
            raise ValueError(f"expert dispatch 'gather': {n} tokens on this rank, the layer is "
                             f"sized for {self.tokens} (tokens per micro-batch)")
        pad = self.tokens - n
        if pad:  # padding tokens route nowhere (-1) with weight 0
            x = torch.cat([x, x.new_zeros(pad, dim)])
            weights = torch.cat([weights, weights.new_zeros(pad, k)])
            indices = torch.cat([indices, indices.new_full((pad, k), -1)])
        x_all = all_gather_traceable(x, self.group)  # [R, D], R = ranks x tokens
        w_all = all_gather_traceable(weights.to(x.dtype), self.group)  # [R, k]
        with torch.no_grad():
            ids = all_gather_traceable(indices, self.group, differentiable=False)
        partial = self.run_local(experts, x_all, w_all, ids)
        return reduce_scatter_traceable(partial, self.group)[:n]

    def run_local(self, experts: nn.Module, x_all: torch.Tensor, w_all: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        """``[R, D]``: this rank's experts over the copies of the gathered tokens ``x_all``
        ``[R, D]`` routed to them (``ids`` ``[R, k]`` global expert ids, -1 for none), each
        token's copies weighed by ``w_all`` ``[R, k]`` and summed; the copies of other ranks'
        experts count zero. No communication (what one rank computes between the exchanges)."""
        local = self.num_experts // self.degree
        k = ids.shape[1]
        with torch.no_grad():
            mine = ids.reshape(-1) - self.rank * local  # [R * k] local expert ids
            key = torch.where((mine >= 0) & (mine < local), mine, local)  # local: not here
            # this rank's copies grouped by local expert, then the rest (stable: by token)
            order, per_key = sort_by_expert(key, local + 1)
            counts_local = per_key[:local]
            count = counts_local.sum()
        inverse = sorted_inverse(order)
        if self.kernels:
            # rows past `count` are neither written nor read (grouped GEMM ignores them)
            y = experts(gather_copies(x_all, order, inverse, count, k), counts_local,
                        used_rows=count)
            return combine_copies(y, w_all, order, inverse, count)
        used = (torch.arange(order.numel(), device=order.device) < count).unsqueeze(1)
        # rows past this rank's copies: zero in, and their outputs and input gradients (which
        # grouped GEMM leaves unspecified past its last group) masked out
        rows = torch.where(used, gather_sorted(x_all, order, k, inverse), 0)
        y = torch.where(used, experts(rows, counts_local), 0)
        # back in (token, choice) order, each token's copies weighed and summed (the copies of
        # other ranks' experts are zero here): [R, D]
        return combine(y, order, w_all, inverse)

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """Nothing is dropped."""
        return torch.zeros_like(counts)
