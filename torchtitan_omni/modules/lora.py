"""LoRA layers: low-rank adapters added in place to ``nn.Linear`` and grouped-experts modules.

An adapted projection computes ``y = W x + (alpha / r) B A x`` with ``A`` ``[r, in]`` drawn
like ``nn.Linear``'s weights (uniform in +-1/sqrt(in)) and ``B`` ``[out, r]`` zero, so at
initialization the model is exactly its base model.

:func:`add_lora` puts a mixin first in the module's class
(``torchtitan_omni.modules.wrapping.extend_class``, as activation checkpointing does) and
registers the adapters as parameters of the module itself. Therefore

- the base weights keep their names (checkpoints and Hugging Face maps are unchanged) and are
  frozen (``requires_grad = False``);
- FSDP shards the adapters with their module's unit, and expert parallel shards the experts'
  ``[E, ...]`` adapters on dim 0 like the experts;
- the layout-invariant init names them (:func:`init_adapters`, called by
  ``OmniModel.init_weights``).

Grouped experts (``torchtitan_omni.modules.moe.GroupedExperts``) get one adapter pair per
projection and expert, stacked: ``w1``/``w3`` (``[E, H, D]``) take ``A`` ``[E, r, D]`` and
``B`` ``[E, H, r]``, ``w2`` (``[E, D, H]``) takes ``A`` ``[E, r, H]`` and ``B`` ``[E, D, r]``.
The delta runs as a parallel grouped path over the same expert groups
(``grouped_linear(grouped_linear(x, A), B)``); ``B A`` is never formed in training.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.modules.wrapping import extend_class
from torchtitan_omni.modules import init
from torchtitan_omni.modules.linear_cross_entropy import LinearHead
from torchtitan_omni.modules.moe import (
    EXPERT_WEIGHTS,
    ExpertGroups,
    GroupedExperts,
    _local,
    grouped_linear,
)


class LoraLinear(nn.Module):
    """Mixin for ``nn.Linear``: ``forward(x) = W x + b + scale * B A dropout(x)``."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_delta(x)

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution ``scale * B A dropout(x)``."""
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout, training=True)
        # scaling the rank-r intermediate is cheaper than scaling the output
        return F.linear(F.linear(x, self.lora_a) * self.lora_scale, self.lora_b)

    def lora_pairs(self) -> dict[str, tuple[str, str]]:
        """Base parameter name -> its (A, B) adapter names."""
        return {"weight": ("lora_a", "lora_b")}


class LoraGroupedExperts(GroupedExperts):
    """Mixin for ``GroupedExperts`` (and its subclasses): each projection adds its experts'
    grouped adapter path."""

    lora_scale: float
    lora_dropout: float

    def project(self, x: torch.Tensor, which: str, groups: ExpertGroups) -> torch.Tensor:
        out = super().project(x, which, groups)
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout, training=True)
        a = _local(getattr(self, f"{which}_lora_a"))
        b = _local(getattr(self, f"{which}_lora_b"))
        h = grouped_linear(x, a, groups, self.use_grouped_mm) * self.lora_scale
        return out + grouped_linear(h, b, groups, self.use_grouped_mm).to(out.dtype)

    def lora_pairs(self) -> dict[str, tuple[str, str]]:
        """Base parameter name -> its (A, B) adapter names."""
        return {w: (f"{w}_lora_a", f"{w}_lora_b") for w in EXPERT_WEIGHTS}


LORA_MIXINS = (LoraLinear, LoraGroupedExperts)


def is_lora(module: nn.Module) -> bool:
    """Whether :func:`add_lora` adapted ``module``."""
    return isinstance(module, LORA_MIXINS)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why LoRA cannot adapt ``module`` (None: it can)."""
    if is_lora(module):
        return "it already has LoRA adapters"
    if isinstance(module, GroupedExperts):
        return None
    if isinstance(module, LinearHead):
        return ("it is a text head whose loss reads its weight directly; train it in full with "
                "lora.train_modules instead")
    if isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward:
            return f"{type(module).__name__} computes its own forward (e.g. a float8 linear)"
        return None
    return "only nn.Linear and grouped experts take adapters"


def _new_param(like: torch.Tensor, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=like.device, dtype=like.dtype))


def add_lora(module: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Adapt ``module`` in place (see the module docstring): freeze its own parameters and add
    rank-``rank`` adapters scaled by ``alpha / rank``; returns the adapters' local names."""
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"cannot add LoRA to {type(module).__name__}: {reason}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for p in module.parameters(recurse=False):
        p.requires_grad_(False)
    state = {"lora_scale": alpha / rank, "lora_dropout": float(dropout)}
    if isinstance(module, GroupedExperts):
        params = {}
        for w in EXPERT_WEIGHTS:
            base = getattr(module, w)  # [E, out, in]
            experts, out_dim, in_dim = base.shape
            params[f"{w}_lora_a"] = _new_param(base, experts, rank, in_dim)
            params[f"{w}_lora_b"] = _new_param(base, experts, out_dim, rank)
        extend_class(module, LoraGroupedExperts, **state)
    else:
        weight = cast(nn.Linear, module).weight  # [out, in]
        params = {"lora_a": _new_param(weight, rank, weight.shape[1]),
                  "lora_b": _new_param(weight, weight.shape[0], rank)}
        extend_class(module, LoraLinear, **state)
    for name, p in params.items():
        module.register_parameter(name, p)
    return list(params)


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear | LoraGroupedExperts]]:
    """Every adapted module of ``model`` with its name, in model order."""
    return [(n, cast(LoraLinear | LoraGroupedExperts, m)) for n, m in model.named_modules()
            if is_lora(m)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_adapter_key(name: str) -> bool:
    """Whether a tensor name (a checkpoint key) is a LoRA adapter's."""
    return name.rsplit(".", 1)[-1].endswith(("lora_a", "lora_b"))


def adapter_names(model: nn.Module) -> set[str]:
    """Names (relative to ``model``) of every adapter parameter."""
    return {_join(prefix, n) for prefix, m in lora_modules(model)
            for pair in m.lora_pairs().values() for n in pair}


def merge_table(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """Base weight name -> (A name, B name, scale) for every adapted weight of ``model``."""
    return {_join(prefix, base): (_join(prefix, a), _join(prefix, b), m.lora_scale)
            for prefix, m in lora_modules(model) for base, (a, b) in m.lora_pairs().items()}


@torch.no_grad()
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """``W + scale * B A`` (per expert for stacked ``[E, ...]`` weights), computed in float32
    or wider and returned in the wider of the weight's and the adapters' dtypes."""
    wide = torch.promote_types(torch.promote_types(weight.dtype, a.dtype), torch.float32)
    delta = torch.matmul(b.to(wide), a.to(wide)) * scale
    out_dtype = torch.promote_types(weight.dtype, a.dtype)
    return (weight.to(wide) + delta).to(out_dtype)


def init_adapters(model: nn.Module) -> int:
    """Layout-invariant init of every adapter: ``A`` uniform in +-1/sqrt(in) (``nn.Linear``'s
    default), ``B`` zero. Call inside ``torchtitan_omni.modules.init.init_context``; returns
    the number of adapted modules."""
    modules = lora_modules(model)
    for _, module in modules:
        for a_name, b_name in module.lora_pairs().values():
            a = getattr(module, a_name)
            bound = a.shape[-1] ** -0.5
            init.uniform_(a, -bound, bound)
            init.zeros_(getattr(module, b_name))
    return len(modules)
