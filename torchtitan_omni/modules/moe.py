"""Mixture of experts with Qwen3-MoE semantics, and the dispatcher interface expert parallel uses.

Routing (``MoE``): a bias-free ``gate`` ``Linear(dim, E)``, softmax over the experts in float32
(or wider), top-k, and (``norm_topk_prob``) the k weights renormalized to sum to one. Each
token's output is the weighted sum of its k experts' SwiGLU outputs.

Experts (``GroupedExperts``) are three stacked parameters: ``w1``/``w3`` ``[E, H, D]`` (gate and
up projections) and ``w2`` ``[E, D, H]`` (down), laid out like Hugging Face's per-expert
``gate_proj``/``up_proj``/``down_proj`` weights stacked on a new dim 0. On CUDA with bf16
inputs they compute with ``torch._grouped_mm``; otherwise with an exact matmul per expert
(``torchtitan_omni.modules.segment_mm``, one opaque operator to ``torch.compile``), or one
batched matmul for padded groups. Each projection goes through ``GroupedExperts.project``
(:func:`grouped_linear` over the forward's :class:`ExpertGroups`), which LoRA's experts mixin
extends (``torchtitan_omni.modules.lora``).

Dispatcher interface (what expert parallel replaces)
----------------------------------------------------
``MoE.forward`` routes its tokens, sorts the ``N * k`` routed copies by expert
(:func:`sort_by_expert`, :func:`gather_sorted`) and hands them to ``MoE.dispatcher``::

    x_local, counts_local, state = dispatcher.dispatch(x_sorted, counts)
    y_local = experts(x_local, counts_local)
    y_sorted = dispatcher.combine(y_local, state)

- ``x_sorted``: ``[N * k, D]`` routed copies grouped by global expert id; ``counts``: int64
  ``[E]`` copies per expert;
- ``x_local``/``counts_local``: the copies this rank's experts must process, either exact
  groups (``[M, D]`` grouped by *local* expert, ``counts_local`` rows each) or padded groups
  (``[local experts, R, D]``, ``counts_local`` None: R rows each, unused rows zero);
- ``combine`` returns ``experts``' outputs to the rows of ``x_sorted`` they came from (zero
  for a copy the dispatcher dropped);
- ``dispatcher.dropped(counts, copies)``: ``[E]`` copies it drops per expert;
- ``dispatcher.host_sync``: whether it reads device values on the host (the exact
  expert-parallel all-to-all reads its split sizes), which makes ``torch.compile`` break the
  block's graph there;
- optionally ``dispatcher.run(experts, x_sorted, counts) -> y_sorted``: a dispatcher that
  interleaves its exchanges with the experts (the chunked expert-parallel one calls
  ``experts`` once per chunk) does all three steps itself (:func:`run_experts`);
- optionally ``dispatcher.run_tokens(experts, x, weights, indices, counts) -> out``: a
  dispatcher that moves tokens rather than sorted copies and returns each token's weighted
  sum of its experts itself (``torchtitan_omni.distributed.expert_tokens``, one row per token
  and destination rank); the layer then skips the sort, gather and :func:`combine`.

The layer then weighs each copy by its routing weight and sums a token's k copies
(:func:`combine`). The default :class:`LocalDispatcher` is the identity (every expert is
local, nothing dropped); ``torchtitan_omni.modules.moe_capacity.CapacityDispatcher`` drops
copies beyond a fixed capacity per expert, and ``torchtitan_omni.distributed.expert_parallel``
installs the all-to-all ones (``parallelism.expert_capacity_factor`` chooses exact or
capacity-padded). ``GroupedExperts.forward(x, counts)`` computes with whatever slice of
experts the rank holds: when its parameters are DTensors (sharded on dim 0 over the ``ep``
mesh) it uses their local shards, and ``counts`` has one entry per local expert.

A spec's ``OmniParallelPlan.experts`` patterns name ``GroupedExperts`` modules (e.g.
``"llm.layers.*.moe.experts"``); the owning ``MoE`` (the name without its last segment) holds
the ``dispatcher`` to replace.

Routing statistics: ``MoE.forward`` returns ``(output, RoutingStats)``: per expert, the
router's assignments, the summed router probabilities (differentiable) and the copies the
dispatcher dropped. Returned, not kept on the module, so a block is a pure function that
``torch.compile`` can take as one graph. The foundation turns the statistics of all its layers
into the Switch Transformer auxiliary loss with :func:`load_balancing_loss` (Hugging Face's
``load_balancing_loss_func``), and the trainer logs the counts.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_omni.compat import grouped_mm
from torchtitan_omni.modules import init
from torchtitan_omni.modules.local_copies import (
    combine_copies,
    gather_copies,
    swiglu_rows,
)
from torchtitan_omni.modules.row_maps import inverse_permutation
from torchtitan_omni.modules.segment_mm import segment_mm


class Dispatcher(Protocol):
    """Moves sorted token copies to the experts' ranks and back (see the module docstring)."""

    host_sync: bool

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, Any]: ...

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor: ...

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor: ...


class LocalDispatcher:
    """No expert parallel: every expert is local, so dispatch and combine are identities."""

    host_sync = False

    def dispatch(
        self, x: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        return x, counts, None

    def combine(self, y: torch.Tensor, state: None) -> torch.Tensor:
        del state
        return y

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """Nothing is dropped."""
        return torch.zeros_like(counts)


#: the stacked weights of ``GroupedExperts``
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertGroups:
    """How the rows of one experts forward are grouped by local expert, shared by its three
    projections: exact groups (``x`` ``[M, in]`` sorted by expert, ``counts`` per expert; the
    int32 end offsets for grouped GEMM are computed once) or padded groups (``x`` ``[E, R, in]``,
    ``counts`` None). ``compute_dtype``: what inputs and weights are cast to (the experts'
    ``compute_dtype``, else bfloat16 under CUDA autocast), or None."""

    def __init__(
        self, counts: torch.Tensor | None, compute_dtype: torch.dtype | None = None
    ) -> None:
        self.counts = counts
        self.compute_dtype = compute_dtype
        self._offsets: torch.Tensor | None = None

    def offsets(self, x: torch.Tensor) -> torch.Tensor:
        """int32 end offsets of the groups over the flattened rows of ``x``."""
        if self._offsets is None:
            if self.counts is None:  # padded: every group has the same rows
                ends = torch.arange(1, x.shape[0] + 1, device=x.device, dtype=torch.int32)
                self._offsets = ends * x.shape[1]
            else:
                # cast after the sum: inductor lowers cumsum(dtype=int32) of int64 counts to
                # int64, which grouped_mm refuses in a compiled graph
                self._offsets = torch.cumsum(self.counts, dim=0).to(torch.int32)
        return self._offsets


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm wants bf16 and 16-byte aligned rows (multiples of 8 bf16 elements).
    return (
        x.is_cuda and hasattr(torch, "_grouped_mm")
        and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
    )


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups,
                   use_grouped_mm: bool | None = None) -> torch.Tensor:
    """``x[rows of e] @ w[e].T`` for every local expert e, ``w`` ``[E_local, out, in]``: exact
    groups ``[M, in] -> [M, out]``, padded groups ``[E, R, in] -> [E, R, out]``. Grouped GEMM on
    CUDA bf16 (unless ``use_grouped_mm`` is False), else an exact matmul per expert (exact
    groups; one opaque operator, no host read in a compiled graph) or one batched matmul
    (padded groups)."""
    if groups.compute_dtype is not None:
        x, w = x.to(groups.compute_dtype), w.to(groups.compute_dtype)
    grouped = use_grouped_mm is not False and _grouped_mm_usable(x, w)
    if groups.counts is None:  # padded groups
        if not grouped:
            return x @ w.transpose(-2, -1)
        out = grouped_mm(x.flatten(0, 1), w.transpose(-2, -1), groups.offsets(x))
        return out.view(*x.shape[:2], -1)
    if grouped:
        return grouped_mm(x, w.transpose(-2, -1), groups.offsets(x))
    return segment_mm(x, w.transpose(-2, -1), groups.counts)


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
        #: None: grouped_mm when usable (CUDA, bf16); False: always the exact per-expert path
        self.use_grouped_mm: bool | None = None
        #: the dtype the projections compute in, set by the framework when no FSDP unit casts
        #: the parameters (``torchtitan_omni.distributed.parallelize``); None: as they come,
        #: or bfloat16 under CUDA autocast
        self.compute_dtype: torch.dtype | None = None
        #: set by the framework where expert parallel leaves these experts out of FSDP (each
        #: expert on one rank: ``distributed.parallelize.experts_outside_fsdp``), so no FSDP
        #: hooks run around them and their block can compile as one graph
        self.outside_fsdp = False

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds (all of them unless expert parallel shards them)."""
        return _local(self.w1).shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor | None,
                used_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Exact groups: ``x`` ``[M, D]`` sorted by local expert, ``counts`` ``[local experts]``;
        padded groups: ``x`` ``[local experts, R, D]``, ``counts`` None. Same shape out.
        ``used_rows`` (exact groups, a device scalar: ``counts.sum()``) says that the rows past
        the groups are never read: SwiGLU's product and its backward then skip them
        (``modules.local_copies``; the gather dispatch's worst-case buffer), and those rows of
        the output and of ``x``'s gradient are left unspecified."""
        local = self.num_local_experts
        n_groups = x.shape[0] if counts is None else counts.shape[0]
        if n_groups != local:
            raise ValueError(
                f"GroupedExperts got token counts for {n_groups} experts but holds "
                f"{local} (local) experts"
            )
        dtype = self.compute_dtype
        if (
            dtype is None
            and x.is_cuda
            and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") == torch.bfloat16
        ):
            # Without FSDP's mixed precision, TorchTitan autocasts; grouped_mm does not.
            dtype = torch.bfloat16
        if used_rows is not None and counts is None:
            raise ValueError("GroupedExperts: used_rows is for exact groups (counts given); "
                             "padded groups have no rows past them")
        groups = ExpertGroups(counts, dtype)
        if used_rows is not None:
            h = swiglu_rows(self.project(x, "w1", groups), self.project(x, "w3", groups),
                            used_rows)
        else:
            h = F.silu(self.project(x, "w1", groups)) * self.project(x, "w3", groups)
        return self.project(h, "w2", groups)

    def project(self, x: torch.Tensor, which: str, groups: ExpertGroups) -> torch.Tensor:
        """One of the three projections (``"w1"``, ``"w3"``: ``D -> H``; ``"w2"``: ``H -> D``)
        of every row by its expert. Mixins (LoRA) extend it."""
        return grouped_linear(x, self.compute_weight(which), groups, self.use_grouped_mm)

    def compute_weight(self, which: str) -> torch.Tensor:
        """The local weight ``which`` as the projections read it: the parameter's local
        tensor, or its compute-dtype copy when one is kept (:meth:`keep_compute_copy`), whose
        gradient goes to the parameter in the parameter's dtype, or stays with the copy (in
        the compute dtype, for the optimizer to read) where the copy requires a gradient."""
        weight = _local(getattr(self, which))
        copy = getattr(self, _copy_name(which), None)
        if copy is None:
            return weight
        return copy if copy.requires_grad else read_compute_copy(weight, copy)

    def keep_compute_copy(self, which: str, copy: torch.Tensor) -> None:
        """Read ``copy`` (the local weight ``which`` in ``compute_dtype``, same shape) instead
        of casting the weight in every forward and recompute. Whoever changes the weight keeps
        the copy equal to its cast (``torchtitan_omni.components.compute_copies``). A buffer
        left out of the state dict: checkpoints hold the weights only."""
        weight = _local(getattr(self, which))
        if copy.shape != weight.shape or copy.dtype != self.compute_dtype:
            raise ValueError(
                f"GroupedExperts.{which}: a compute copy must be {tuple(weight.shape)} in "
                f"{self.compute_dtype}, got {tuple(copy.shape)} in {copy.dtype}")
        self.register_buffer(_copy_name(which), copy, persistent=False)

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Truncated-normal experts (``out_std`` for the down projection ``w2``)."""
        init.trunc_normal_(self.w1, std=std)
        init.trunc_normal_(self.w3, std=std)
        init.trunc_normal_(self.w2, std=std if out_std is None else out_std)


def _copy_name(which: str) -> str:
    return f"{which}_compute_copy"


class _ReadComputeCopy(torch.autograd.Function):
    """Forward: the kept copy (the weight's cast, read instead of casting it again); backward:
    the copy's gradient to the weight, in the weight's dtype, as the cast's backward gives."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return grad.to(ctx.weight_dtype) if ctx.needs_input_grad[0] else None, None


def read_compute_copy(weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """``copy`` (equal to ``weight.to(copy.dtype)``) in place of that cast: the same forward
    and the same gradient for ``weight``, without reading the weight."""
    return _ReadComputeCopy.apply(weight, copy)


def run_experts(dispatcher: Dispatcher, experts: nn.Module, x_sorted: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """Dispatch, experts, combine: the experts' output for every sorted copy. A dispatcher
    with a ``run`` method drives the experts itself (to overlap its communication with them)."""
    run = getattr(dispatcher, "run", None)
    if run is not None:
        return run(experts, x_sorted, counts)
    x_local, counts_local, state = dispatcher.dispatch(x_sorted, counts)
    return dispatcher.combine(experts(x_local, counts_local), state)


def narrow_sort_keys(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """``keys`` (integers in ``[0, bound)``) in the narrowest integer dtype that holds them,
    for a stable sort: torch's CUDA radix sort makes one pass per 8 bits of the key's dtype,
    and at a MoE layer's sizes every pass costs the same latency whatever the row count
    (64K keys on an H200: 168 us for argsort and searchsorted in int64, 80 us in uint8).
    The order is the same in any dtype that holds the keys."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max + 1:
            return keys.to(dtype)
    return keys


def sort_by_expert(
    expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the flattened ``[N * k]`` assignments grouped by expert, and tokens per expert.

    Stable (a token's assignments keep their order inside an expert group) and free of
    host-device syncs and atomics, so deterministic on GPU.
    """
    flat = narrow_sort_keys(expert_indices.reshape(-1), num_experts)
    order = torch.argsort(flat, stable=True)
    # each expert's first position (its id fits the keys' dtype, the count past the last may not)
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    starts = torch.searchsorted(flat[order], experts)
    return order, torch.diff(starts, append=starts.new_full((1,), flat.numel()))


def gather_sorted(x: torch.Tensor, order: torch.Tensor, top_k: int,
                  inverse: torch.Tensor | None = None) -> torch.Tensor:
    """The token of every sorted assignment: ``x[order // top_k]`` ``[N * k, D]``.
    ``inverse``: ``order``'s inverse permutation where the caller has it (:func:`sorted_inverse`).

    One gather of repeated rows (:func:`~torchtitan_omni.modules.local_copies.gather_copies`
    with every row used: a Triton kernel on CUDA), whose backward sums each token's k slots'
    gradients in one pass (no atomic index_add, so deterministic, and no sort). Why the row
    maps rather than torch's index ops: compiled, those moved a layer's rows at 0.6-1.2 TB/s
    on an H200 (a zero fill, a placement and a sum in the backward; docs/performance.md,
    thirty-sixth session).
    """
    if inverse is None:
        inverse = sorted_inverse(order)
    return gather_copies(x, order, inverse, _every_row(order), top_k)


def sorted_inverse(order: torch.Tensor) -> torch.Tensor:
    """Where each (token, choice) slot went in the sort by expert (``inverse[order] = arange``),
    outside autograd: what :func:`gather_sorted`'s backward and :func:`combine` read, computed
    once per layer when the caller passes it to both."""
    with torch.no_grad():
        return inverse_permutation(order)


def _every_row(order: torch.Tensor) -> torch.Tensor:
    # the row maps' count (a device scalar) when every sorted copy is used
    return torch.full((), order.numel(), dtype=order.dtype, device=order.device)


def combine(out_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
            inverse: torch.Tensor | None = None) -> torch.Tensor:
    """Undo the sort and sum each token's k expert outputs weighted by ``weights`` ``[N, k]``
    (``inverse`` as for :func:`gather_sorted`).

    The weights are rounded to the outputs' dtype (as every dispatcher weighs its copies), the
    products and their sum are float32, and the result is rounded once to the outputs' dtype
    (:func:`~torchtitan_omni.modules.local_copies.combine_copies` with every row used: one
    kernel per pass on CUDA that reads each copy once). Why not a batched matmul (``[1, k] x
    [k, D]`` per token): cuBLAS runs such shapes on small-tile kernels far below the memory
    bandwidth. Autograd keeps the outputs and weights, not the float32 products."""
    if inverse is None:
        inverse = sorted_inverse(order)
    return combine_copies(out_sorted, weights, order, inverse, _every_row(order))


class RoutingStats(NamedTuple):
    """One MoE layer's routing over the tokens of one forward (returned by ``MoE.forward``)."""

    #: ``[E]``: router probabilities summed over the tokens (differentiable; float32 or wider)
    prob_sum: torch.Tensor
    #: ``[E]`` int64: the router's (token, expert) assignments per expert, before any drop
    routed: torch.Tensor
    #: ``[E]`` int64: assignments the dispatcher dropped (over capacity) per expert
    dropped: torch.Tensor


def load_balancing_loss(stats: list[RoutingStats], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer load-balancing loss over several layers, as Hugging Face computes it.

    ``E * sum_e f_e * P_e`` with ``f_e`` the assignments to expert e per token and ``P_e`` the
    mean router probability of e, both pooled over all layers' tokens (HF's
    ``load_balancing_loss_func`` without an attention mask). Perfect balance gives ``top_k``.
    Assignments count the router's choices, dropped ones included.
    """
    if not stats:
        raise ValueError("load_balancing_loss needs the routing statistics of at least one layer")
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    assignments = torch.stack([s.routed for s in stats]).sum(0).to(probs.dtype)
    rows = assignments.sum() / top_k  # tokens over all layers: each has top_k assignments
    return num_experts * ((assignments / rows) * (probs / rows)).sum()


class MoE(nn.Module):
    """Token-choice top-k MoE (Qwen3-MoE): softmax router, renormalized top-k, SwiGLU experts.

    ``forward(x)`` returns ``(output, RoutingStats)``.
    """

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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities ``[N, E]`` (at least float32), top-k weights and indices
        ``[N, k]``."""
        logits = self.gate(x)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, indices = self.route(x)
        order, counts = sort_by_expert(indices, self.num_experts)
        run_tokens = getattr(self.dispatcher, "run_tokens", None)
        if run_tokens is not None:  # the dispatcher weighs and sums each token's experts
            out = run_tokens(self.experts, x, weights, indices, counts)
        else:
            inverse = sorted_inverse(order)
            y_sorted = run_experts(self.dispatcher, self.experts,
                                   gather_sorted(x, order, self.top_k, inverse), counts)
            out = combine(y_sorted, order, weights, inverse)
        out = out.to(x.dtype).reshape(shape)
        dropped = self.dispatcher.dropped(counts, order.numel())
        return out, RoutingStats(probs.sum(dim=0), counts, dropped)

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Router and experts: truncated normal (``out_std`` for the experts' ``w2``)."""
        init.trunc_normal_(self.gate.weight, std=std)
        self.experts.init_weights(std, out_std)
