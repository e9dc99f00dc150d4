"""Exact grouped matrix products as one opaque operator, for devices and dtypes without
``torch._grouped_mm`` (CPU float32/float64, CUDA float32).

``segment_mm(x, w, counts)``: ``x`` ``[M, K]`` holds ``counts[g]`` consecutive rows for group
``g``; row block ``g`` is multiplied by ``w[g]`` ``[K, N]``; the result is ``[M, N]``. It is
what ``torch._grouped_mm(x, w, offs=cumsum(counts))`` computes, done as one matmul per group.
Rows past the last group (``M > sum(counts)``: the device-split expert exchange's unused
buffer rows) belong to no group: their output is zero and they add nothing to ``w``'s
gradient.

The per-group split needs the counts on the host. Registered as a custom operator (with a
fake implementation and its own backward), it is one node to ``torch.compile``: the block
around it stays one graph, and the host read happens inside the operator at run time. On
CUDA with bf16 the experts use ``torch._grouped_mm`` instead, which needs no host read at all.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("torchtitan_omni::segment_mm", mutates_args=())
def segment_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[M, K]`` rows in groups of ``counts`` times ``w`` ``[G, K, N]`` -> ``[M, N]``."""
    sizes = _with_tail(counts.tolist(), x.shape[0])
    parts = torch.split(x, sizes, dim=0)
    out = [part @ w[g] for g, part in enumerate(parts[:-1])]
    return torch.cat([*out, x.new_zeros((sizes[-1], w.shape[-1]))], dim=0)


def _with_tail(sizes: list[int], rows: int) -> list[int]:
    """The groups' sizes and, last, the rows past them."""
    tail = rows - sum(sizes)
    if tail < 0:
        raise ValueError(f"segment_mm: groups of {sizes} rows ({sum(sizes)}) exceed {rows} rows")
    return [*sizes, tail]


@segment_mm.register_fake
def _segment_mm_fake(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[-1]))


@torch.library.custom_op("torchtitan_omni::segment_mm_weight_grad", mutates_args=())
def segment_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor,
                           counts: torch.Tensor) -> torch.Tensor:
    """Per group ``x_g^T @ grad_g``: the gradient of ``w`` ``[G, K, N]`` in :func:`segment_mm`."""
    sizes = _with_tail(counts.tolist(), x.shape[0])
    blocks = zip(torch.split(x, sizes, dim=0)[:-1], torch.split(grad, sizes, dim=0)[:-1])
    return torch.stack([xg.transpose(0, 1) @ gg for xg, gg in blocks])


@segment_mm_weight_grad.register_fake
def _segment_mm_weight_grad_fake(x, grad, counts):
    return x.new_empty((counts.shape[0], x.shape[1], grad.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    x, w, counts = inputs
    ctx.save_for_backward(x, w, counts)


def _backward(ctx, grad):
    x, w, counts = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = segment_mm(grad, w.transpose(-2, -1), counts)
    if ctx.needs_input_grad[1]:
        grad_w = segment_mm_weight_grad(x, grad, counts).to(w.dtype)
    return grad_x, grad_w, None


segment_mm.register_autograd(_backward, setup_context=_setup_context)


# FLOP counters (torch.utils.flop_counter) see the operator, not the matmuls inside it.
@register_flop_formula(torch.ops.torchtitan_omni.segment_mm)
def _segment_mm_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


@register_flop_formula(torch.ops.torchtitan_omni.segment_mm_weight_grad)
def _segment_mm_weight_grad_flops(x_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[1]
