"""Mixture of experts with Qwen3-MoE semantics, and the dispatcher interface expert parallel uses.

Routing (``MoE``): a bias-free ``gate`` ``Linear(dim, E)``, softmax over the experts in float32 (or wider),
top-k, and (``norm_topk_prob``) the k weights renormalized to sum to one. Each token's output
is the weighted sum of its k experts' SwiGLU outputs.

Experts (``GroupedExperts``) are three stacked parameters: ``w1``/``w3`` ``[E, H, D]`` (gate and
up projections) and ``w2`` ``[E, D, H]`` (down), laid out like Hugging Face's per-expert
``gate_proj``/``up_proj``/``down_proj`` weights stacked on a new dim 0. On CUDA with bf16
inputs they compute with ``torch._grouped_mm``; otherwise with an exact per-expert loop. Each
projection goes through ``GroupedExperts.project`` (:func:`grouped_linear` over the forward's
:class:`ExpertGroups`), which LoRA's experts mixin extends (``torchtitan_omni.modules.lora``).

Dispatcher interface (what expert parallel replaces)
----------------------------------------------------
``MoE.forward`` routes its tokens, sorts the ``N * k`` routed copies by expert
(:func:`sort_by_expert`, :func:`gather_sorted`) and hands them to ``MoE.dispatcher``::

    x_local, counts_local, state = dispatcher.dispatch(x_sorted, counts)
    y_local = experts(x_local, counts_local)
    y_sorted = dispatcher.combine(y_local, state)

- ``x_sorted``: ``[N * k, D]`` routed copies grouped by global expert id; ``counts``: int64
  ``[E]`` copies per expert;
- ``x_local``/``counts_local``: the copies this rank's experts must process, grouped by
  *local* expert, and how many each local expert gets;
- ``combine`` returns ``experts``' outputs to the rows of ``x_sorted`` they came from.

The layer then weighs each copy by its routing weight and sums a token's k copies
(:func:`combine`). The default :class:`LocalDispatcher` is the identity (every expert is
local); ``torchtitan_omni.distributed.expert_parallel`` installs the all-to-all one.
``GroupedExperts.forward(x, counts)`` computes with whatever slice of experts the rank holds:
when its parameters are DTensors (sharded on dim 0 over the ``ep`` mesh) it uses their local
shards, and ``counts`` has one entry per local expert.

A spec's ``OmniParallelPlan.experts`` patterns name ``GroupedExperts`` modules (e.g.
``"llm.layers.*.moe.experts"``); the owning ``MoE`` (the name without its last segment) holds
the ``dispatcher`` to replace.

Load balancing: every forward records, per layer, the number of (token, expert) assignments
and the summed router probabilities of each expert (``MoE.balance``). The foundation turns the
records of all its layers into the Switch Transformer auxiliary loss with
:func:`load_balancing_loss` (Hugging Face's ``load_balancing_loss_func``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_omni.modules import init


class Dispatcher(Protocol):
    """Moves sorted token copies to the experts' ranks and back (see the module docstring)."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """No expert parallel: every expert is local, so dispatch and combine are identities."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return x, counts, None

    def combine(self, y: torch.Tensor, state: None) -> torch.Tensor:
        del state
        return y


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertGroups:
    """Rows of a ``[M, in]`` input grouped by local expert: ``counts`` per expert, with the
    host split sizes (loop path) and int32 end offsets (grouped GEMM) computed once and shared
    by every projection of one forward."""

    def __init__(self, counts: torch.Tensor, compute_dtype: torch.dtype | None = None) -> None:
        self.counts = counts
        #: bfloat16 under CUDA autocast (inputs and weights are cast), else None
        self.compute_dtype = compute_dtype
        self._splits: list[int] | None = None
        self._offsets: torch.Tensor | None = None

    @property
    def splits(self) -> list[int]:
        if self._splits is None:
            self._splits = self.counts.tolist()  # syncs with the device (loop path only)
        return self._splits

    @property
    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts, dim=0, dtype=torch.int32)
        return self._offsets


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm wants bf16 and 16-byte aligned rows (multiples of 8 bf16 elements).
    return (
        x.is_cuda and hasattr(torch, "_grouped_mm")
        and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
    )


def _grouped_linear_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def _grouped_linear_loop(x: torch.Tensor, w: torch.Tensor, splits: list[int]) -> torch.Tensor:
    outs = [xe @ w[e].transpose(0, 1) for e, xe in enumerate(torch.split(x, splits, dim=0))]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(x.shape[0], w.shape[-2])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups,
                   use_grouped_mm: bool | None = None) -> torch.Tensor:
    """``x[rows of e] @ w[e].T`` for every local expert e: ``x`` ``[M, in]`` sorted by expert,
    ``w`` ``[E_local, out, in]`` -> ``[M, out]``. Grouped GEMM on CUDA bf16 (unless
    ``use_grouped_mm`` is False), else the exact per-expert loop."""
    if groups.compute_dtype is not None:
        x, w = x.to(groups.compute_dtype), w.to(groups.compute_dtype)
    if use_grouped_mm is not False and _grouped_mm_usable(x, w):
        return _grouped_linear_mm(x, w, groups.offsets)
    return _grouped_linear_loop(x, w, groups.splits)


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as ``w1``/``w3`` ``[E, H, D]`` and ``w2`` ``[E, D, H]``.

    ``active_fraction`` (``top_k / E``, set by ``MoE``) tells ``torchtitan_omni.flops`` how much
    of these parameters one token uses.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.active_fraction = 1.0
        #: None: grouped_mm when usable (CUDA, bf16); False: always the exact loop
        self.use_grouped_mm: bool | None = None

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds (all of them unless expert parallel shards them)."""
        return _local(self.w1).shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, D]`` sorted by local expert, ``counts`` ``[local experts]`` -> ``[M, D]``."""
        local = self.num_local_experts
        if counts.shape[0] != local:
            raise ValueError(
                f"GroupedExperts got token counts for {counts.shape[0]} experts but holds "
                f"{local} (local) experts"
            )
        dtype = None
        if x.is_cuda and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
            # Without FSDP's mixed precision, TorchTitan autocasts; grouped_mm does not.
            dtype = torch.bfloat16
        groups = ExpertGroups(counts, dtype)
        h = F.silu(self.project(x, "w1", groups)) * self.project(x, "w3", groups)
        return self.project(h, "w2", groups)

    def project(self, x: torch.Tensor, which: str, groups: ExpertGroups) -> torch.Tensor:
        """One of the three projections (``"w1"``, ``"w3"``: ``[M, D] -> [M, H]``; ``"w2"``:
        ``[M, H] -> [M, D]``) of every row by its expert. Mixins (LoRA) extend it."""
        return grouped_linear(x, _local(getattr(self, which)), groups, self.use_grouped_mm)

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Truncated-normal experts (``out_std`` for the down projection ``w2``)."""
        init.trunc_normal_(self.w1, std=std)
        init.trunc_normal_(self.w3, std=std)
        init.trunc_normal_(self.w2, std=std if out_std is None else out_std)


def sort_by_expert(expert_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the flattened ``[N * k]`` assignments grouped by expert, and tokens per expert.

    Stable (a token's assignments keep their order inside an expert group) and free of
    host-device syncs and atomics, so deterministic on GPU.
    """
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    edges = torch.searchsorted(flat[order], bounds)
    return order, edges[1:] - edges[:-1]


def gather_sorted(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """The token of every sorted assignment: ``x[order // top_k]`` ``[N * k, D]``.

    Expanding instead of indexing with repeated rows keeps the backward a plain sum over the
    k copies (no atomic index_add, so deterministic).
    """
    return x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, x.shape[-1])[order]


def combine(out_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo the sort and sum each token's k expert outputs weighted by ``weights`` ``[N, k]``."""
    n, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    per_token = out_sorted[inverse].view(n, k, -1)
    return torch.bmm(weights.to(per_token.dtype).unsqueeze(1), per_token).squeeze(1)


@dataclass
class BalanceRecord:
    """One MoE layer's routing statistics over the tokens of one forward."""

    #: ``[E]``: how many of the ``N * k`` assignments went to each expert (no grad)
    assignments: torch.Tensor
    #: ``[E]``: router probabilities summed over the N tokens (differentiable; float32 or wider)
    prob_sum: torch.Tensor
    #: number of tokens N
    tokens: int


def load_balancing_loss(records: list[BalanceRecord], num_experts: int) -> torch.Tensor:
    """Switch Transformer load-balancing loss over several layers, as Hugging Face computes it.

    ``E * sum_e f_e * P_e`` with ``f_e`` the assignments to expert e per token and ``P_e`` the
    mean router probability of e, both pooled over all layers' tokens (HF's
    ``load_balancing_loss_func`` without an attention mask). Perfect balance gives ``top_k``.
    """
    if not records:
        raise ValueError("load_balancing_loss needs the routing records of at least one layer")
    rows = sum(r.tokens for r in records)
    assignments = torch.stack([r.assignments for r in records]).sum(0) / rows
    probs = torch.stack([r.prob_sum for r in records]).sum(0) / rows
    return num_experts * (assignments * probs).sum()


class MoE(nn.Module):
    """Token-choice top-k MoE (Qwen3-MoE): softmax router, renormalized top-k, SwiGLU experts."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.experts.active_fraction = top_k / num_experts
        self.dispatcher: Dispatcher = LocalDispatcher()
        #: routing statistics of the last forward (read by the foundation's aux_losses)
        self.balance: BalanceRecord | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities ``[N, E]`` (at least float32), top-k weights and indices ``[N, k]``."""
        logits = self.gate(x)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, indices = self.route(x)
        with torch.no_grad():
            flat = indices.reshape(-1)
            assignments = torch.zeros(self.num_experts, device=x.device, dtype=probs.dtype)
            assignments.scatter_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
        self.balance = BalanceRecord(assignments, probs.sum(dim=0), x.shape[0])
        order, counts = sort_by_expert(indices, self.num_experts)
        x_local, counts_local, state = self.dispatcher.dispatch(
            gather_sorted(x, order, self.top_k), counts
        )
        y_sorted = self.dispatcher.combine(self.experts(x_local, counts_local), state)
        return combine(y_sorted, order, weights).to(x.dtype).reshape(shape)

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Router and experts: truncated normal (``out_std`` for the experts' ``w2``)."""
        init.trunc_normal_(self.gate.weight, std=std)
        self.experts.init_weights(std, out_std)
