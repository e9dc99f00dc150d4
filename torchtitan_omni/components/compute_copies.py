"""Compute-dtype copies of the MoE experts' weights, kept by the optimizer
(``parallelism.expert_compute_copies``).

Why: where the experts cast their own weights (expert parallel with the experts outside FSDP,
or no FSDP, under autocast), every forward and every recompute reads each float32 expert
weight and writes its bfloat16 cast, and the work does not grow with tokens: on one EP4 rank's
share of the 30B-A3B 12-layer cut (1.8B expert parameters, full AC) the casts took 8.5 ms of
a 190 ms step (docs/performance.md). With a copy in the compute dtype that the optimizer
writes as it updates the weight (2 more bytes a parameter; in the compiled update's kernel,
``compile.components`` with ``"optimizer"``), the projections read the copy instead. The
forward, the gradients and the updates are the same, bit for bit; the copies cost 2 bytes an
expert parameter of memory.

The copies are refreshed from the weights before the first step (after any checkpoint or
weights load) and written by every optimizer step after it; nothing else changes the weights
of a training run.

With ``gradients`` (the trainer's choice where each expert weight gets one gradient a step:
one micro-batch, experts run once per layer), each copy also takes its weight's gradient, in
the compute dtype: the product the projections' backward computes, which the cast to the
weight's float32 would only widen. The optimizer reads it where it reads the weight's
gradient (``components.optimizer``), widening it in its kernel, and clipping's norm reads it
in float32. That drops a pass over every expert gradient (read 2 bytes, write 4) and 2 bytes
an expert parameter from the optimizer's read and clipping's; the expert gradients take half
the memory. The updates are the same, bit for bit. A second gradient into a copy before the
optimizer clears them would be summed in the compute dtype: it raises instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from torchtitan_omni.components.expert_weights import self_casting_experts
from torchtitan_omni.modules.moe import EXPERT_WEIGHTS, _local


class ComputeCopies:
    """Each expert weight (the parameter, a DTensor under expert parallel) and the copy of
    its local tensor in the experts' compute dtype."""

    def __init__(self, copies: dict[torch.Tensor, torch.Tensor]) -> None:
        self.copies = copies

    def __len__(self) -> int:
        return len(self.copies)

    @property
    def numel(self) -> int:
        """Elements the copies hold."""
        return sum(c.numel() for c in self.copies.values())

    @torch.no_grad()
    def refresh(self) -> None:
        """Every copy set to its weight's cast."""
        for param, copy in self.copies.items():
            copy.copy_(_local(param))


def keep_expert_compute_copies(model_parts: Iterable[nn.Module],
                               autocast_dtype: torch.dtype | None,
                               gradients: bool = False) -> ComputeCopies:
    """A compute copy for each weight of every ``GroupedExperts`` that casts its own weights
    (``components.expert_weights.self_casting_experts``: outside FSDP, or, with FSDP off,
    under an autocast to ``autocast_dtype``); none where the weights already are in that
    dtype. With ``gradients``, the copy of each trained weight takes its gradient (see the
    module docstring). The copies are uninitialized until :meth:`ComputeCopies.refresh`."""
    copies: dict[torch.Tensor, torch.Tensor] = {}
    for name, module, dtype in self_casting_experts(model_parts, autocast_dtype):
        if _local(module.w1).dtype == dtype:
            continue
        for which in EXPERT_WEIGHTS:
            param = getattr(module, which)
            copy = torch.empty_like(_local(param), dtype=dtype,
                                    memory_format=torch.contiguous_format)
            if gradients and param.requires_grad:
                copy.requires_grad_(True)
                copy.register_hook(
                    _one_gradient_a_step(copy, f"{name}.{which}" if name else which))
            module.keep_compute_copy(which, copy)
            copies[param] = copy
    return ComputeCopies(copies)


def _one_gradient_a_step(copy: torch.Tensor, name: str):
    # a leaf's hook sees each gradient before autograd adds it to .grad, which the
    # optimizer's zero_grad sets to None
    def check(grad: torch.Tensor) -> None:
        if copy.grad is not None:
            raise RuntimeError(
                f"{name}: a second gradient before the optimizer's zero_grad; the experts' "
                f"gradients in {copy.dtype} hold one backward's (parallelism."
                "expert_compute_copies with one micro-batch a step and the experts run once "
                "per layer)")
    return check
