"""Row gathers whose backward is a gather or a placement at distinct rows, never a colliding
scatter-add: deterministic on GPU, and no sort (an ``index``/``index_select`` backward adds
rows with atomics, or sorts them first when determinism is asked for).

Used by the expert-parallel dispatchers' permutations and the token dispatch's per-token sums
(``torchtitan_omni.distributed.expert_parallel``, ``expert_tokens``); the MoE layer's own sort
and un-sort of its routed copies use ``modules.local_copies``' row maps.
"""

from __future__ import annotations

import torch
from torch.autograd import Function


class _PermuteRows(Function):
    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[perm] = arange``: where each position of a permutation went
    (one placement on the device, no sort)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inverse


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` of ``x``'s rows, whose backward is
    ``grad[inverse]`` (``inverse[perm] = arange``)."""
    return _PermuteRows.apply(x, perm, inverse)


class _SpreadRows(Function):
    @staticmethod
    def forward(ctx, src, rows, slots, copies: int, sum_dim: int):
        ctx.save_for_backward(slots)
        # the grid's other side is src's row count, read here: a size computed outside and
        # passed in is, under dynamic shapes, a node of the caller's graph, which dynamo cannot
        # save from this function's graph (it failed so in the token dispatch)
        n = src.shape[0]
        ctx.layout = (n, copies) if sum_dim == 1 else (copies, n)
        ctx.sum_dim = sum_dim
        return src.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        return sum_slots(grad, slots, ctx.layout, ctx.sum_dim), None, None, None, None


def spread_rows(src: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, copies: int,
                sum_dim: int) -> torch.Tensor:
    """``src.index_select(0, rows)`` where ``rows`` repeat ``src``'s rows: output row i stands
    at position ``slots[i]`` (distinct) of a grid of ``copies`` copies of ``src`` stacked along
    ``sum_dim`` (``(len(src), copies)`` for ``sum_dim`` 1, ``(copies, len(src))`` for 0; e.g. a
    token's k routed copies: ``rows = slots // k``, ``copies`` k, ``sum_dim`` 1). The backward
    places each gradient row at its slot and sums the grid over ``sum_dim``."""
    return _SpreadRows.apply(src, rows, slots, copies, sum_dim)


def sum_slots(rows: torch.Tensor, slots: torch.Tensor, layout: tuple[int, int],
              sum_dim: int) -> torch.Tensor:
    """Each row of ``rows`` placed at its position ``slots[i]`` (distinct) of a ``layout = (a,
    b)`` grid, the other positions zero, then the grid summed over ``sum_dim``: the adjoint of
    :func:`spread_rows` (a placement, no colliding scatter-add; differentiable)."""
    a, b = layout
    width = rows.shape[-1]
    grid = rows.new_zeros(a * b, width).index_put((slots,), rows)
    return grid.view(a, b, width).sum(sum_dim)
