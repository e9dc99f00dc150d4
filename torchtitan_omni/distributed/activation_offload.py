"""Activation offload: the tensors a block saves for backward wait in pinned host memory.

``[omni] activation_offload = true`` gives the LLM's blocks (the plan's ``ac_units`` of the
``llm`` part) the :class:`OffloadedActivations` mixin: during their forward, every saved
tensor of at least :data:`MIN_BYTES` that is not a parameter is copied to pinned host memory
and copied back when backward needs it: without activation checkpointing everything the
block saves, with full checkpointing the block inputs it keeps (per-op checkpointing caches the
matrix-product outputs itself: those stay). Longer sequences fit; the copies go over PCIe on
the compute stream, so steps slow down by their time. Parameters (FSDP's gathered weights) are
never copied: they are on the GPU anyway.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_omni.modules.wrapping import extend_class

#: smaller saved tensors stay where they are (copy latency would outweigh the memory)
MIN_BYTES = 1 << 20


def _pack(tensor: torch.Tensor, min_bytes: int):
    if isinstance(tensor, nn.Parameter) or tensor.numel() * tensor.element_size() < min_bytes:
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                       pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, host


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


class OffloadedActivations(nn.Module):
    """Mixin: the unit's saved tensors live in host memory between forward and backward."""

    _omni_offload_min_bytes: int

    def forward(self, *args, **kwargs):
        min_bytes = self._omni_offload_min_bytes
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _pack(t, min_bytes), _unpack):
            return super().forward(*args, **kwargs)


def offload_activations(units: list[nn.Module], min_bytes: int = MIN_BYTES) -> int:
    """Give each unit the :class:`OffloadedActivations` mixin; returns how many."""
    for unit in units:
        extend_class(unit, OffloadedActivations, _omni_offload_min_bytes=min_bytes)
    return len(units)
