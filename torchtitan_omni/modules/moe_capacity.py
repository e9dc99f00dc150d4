"""Capacity-padded expert dispatch: fixed-size expert slots, no host synchronization.

Every source rank gives each expert at most ``C`` slots::

    C = ceil(capacity_factor x tokens x top_k / num_experts)

with ``tokens`` the rank's tokens per micro-batch: a number every rank knows without reading a
device value (the configured maximum under expert parallel, so that all ranks of a group agree
on ``C``; the local batch's own token count without expert parallel). The routed copies of an
expert beyond its ``C`` slots are dropped, earliest tokens first (the sort by expert is stable,
so slots go to the lowest token indices). A dropped copy gets a zero expert output, so it adds
nothing to its token (as if its combine weight were zero; the block's residual path carries
the token) and sends no gradient to its expert or router weight.

Layout: the ``[N * k, D]`` copies, sorted by expert, are gathered into ``[E * C, D]`` slots
(expert-major, empty slots zero). With expert parallel degree P, experts ``[j E/P, (j+1) E/P)``
live on rank j, so slot block j (``E/P * C`` rows) goes to rank j by an equal-split all-to-all
(``torchtitan_omni.distributed.expert_parallel``); without it the blocks stay here. Either
way the experts get ``[E/P, P * C, D]``: every local expert a fixed number of rows. Shapes
and split sizes depend only on ``C``, so nothing is read back to the host and a block with this
dispatcher compiles as one graph.

The permutations are gathers whose backward is a gather too (no scatter-add atomics), so the
results are deterministic on GPU.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch
from torch.autograd import Function


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """``ceil(factor * tokens * top_k / num_experts)`` in exact integer arithmetic.

    ``factor`` is read as the decimal it was written as (1.1 is 11/10), so ``C`` never depends
    on binary rounding; works on the symbolic sizes of ``torch.compile`` too.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"expert capacity factor must be a finite number > 0, got {factor}")
    f = Fraction(repr(float(factor)))
    den = f.denominator * num_experts
    return (f.numerator * tokens * top_k + den - 1) // den


class SlotLayout(NamedTuple):
    """Where each sorted copy goes, for ``E`` experts of ``C`` slots each (see the module
    docstring). ``M`` is the number of copies."""

    #: ``[E * C]``: the copy in each slot, ``M`` for an empty slot (reads a zero row)
    src: torch.Tensor
    #: ``[M]``: the slot of each copy, ``E * C`` for a dropped copy (reads a zero row)
    dst: torch.Tensor


def slot_layout(counts: torch.Tensor, copies: int, cap: int) -> SlotLayout:
    """Slots of ``copies`` copies sorted by expert, ``counts`` ``[E]`` per expert, ``cap``
    slots per expert. Device ops only, with shapes fixed by ``E``, ``cap`` and ``copies``."""
    counts = counts.to(torch.int64)
    experts = counts.shape[0]
    ends = counts.cumsum(0)
    starts = ends - counts
    slot = torch.arange(cap, device=counts.device)
    src = torch.where(slot < counts[:, None], starts[:, None] + slot, copies).reshape(-1)
    row = torch.arange(copies, device=counts.device)
    # the expert of each sorted copy: how many experts end at or before it
    expert = torch.searchsorted(ends, row, right=True)
    offset = row - starts[expert]
    dst = torch.where(offset < cap, expert * cap + offset, experts * cap)
    return SlotLayout(src, dst)


def dropped_copies(counts: torch.Tensor, cap: int) -> torch.Tensor:
    """``[E]`` int64: the copies of each expert beyond its ``cap`` slots."""
    return (counts.to(torch.int64) - cap).clamp(min=0)


class _PaddedGather(Function):
    """``cat([x, 0])[index]`` whose backward is ``cat([grad, 0])[inverse]``.

    Exact adjoint when every real row of ``x`` is read at most once (true of slot layouts):
    then row i's gradient is the one output row that read it, or zero.
    """

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return _pad(x).index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _pad(grad).index_select(0, inverse), None, None


def _pad(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])


def padded_gather(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows ``x[index]`` (index ``len(x)`` reads zeros); the backward gathers by ``inverse``."""
    return _PaddedGather.apply(x, index, inverse)


class CapacityDispatcher:
    """Capacity-padded dispatch over ``ranks`` expert-parallel ranks (see the module docstring).

    This class is the single-rank case (no expert parallel): the slot blocks stay local.
    ``torchtitan_omni.distributed.expert_parallel`` subclasses it with the all-to-all in
    :meth:`exchange`. ``tokens``: the tokens per micro-batch the capacity is sized for; None
    uses the local batch's own count (only valid on one rank: ranks of a group must agree).
    """

    #: split sizes are static: nothing is read on the host, a block compiles as one graph
    host_sync = False

    def __init__(self, num_experts: int, top_k: int, factor: float,
                 tokens: int | None = None, ranks: int = 1) -> None:
        capacity(1, top_k, num_experts, factor)  # validates the factor
        if num_experts % ranks:
            raise ValueError(
                f"expert parallel degree {ranks} does not divide {num_experts} experts"
            )
        if tokens is not None and tokens < 1:
            raise ValueError(f"capacity tokens must be >= 1, got {tokens}")
        self.num_experts, self.top_k, self.factor = num_experts, top_k, factor
        self.tokens, self.ranks = tokens, ranks

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ranks={self.ranks}, experts={self.num_experts}, "
                f"factor={self.factor}, tokens={self.tokens})")

    def capacity(self, copies: int) -> int:
        """Slots per expert and source rank for a batch of ``copies`` routed copies."""
        tokens = self.tokens if self.tokens is not None else copies // self.top_k
        return capacity(tokens, self.top_k, self.num_experts, self.factor)

    def exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[ranks, ...]``: block j to rank j, block i back from rank i (identity here)."""
        return blocks

    def check_counts(self, counts: torch.Tensor) -> None:
        """Refuse routed counts of another layer (a wrong number of experts)."""
        if counts.shape[0] != self.num_experts:
            raise ValueError(
                f"dispatch: counts has {counts.shape[0]} experts, the layer has {self.num_experts}"
            )

    def rank_blocks(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """``[E x width, D]`` expert-major slots -> ``[ranks, local experts x width, D]``: block
        j holds rank j's experts (what one exchange sends)."""
        local, dim = self.num_experts // self.ranks, slots.shape[-1]
        return slots.reshape(self.ranks, local * width, dim)

    def expert_rows(self, arrived: torch.Tensor, width: int) -> torch.Tensor:
        """Exchanged ``[ranks, local x width, D]`` -> ``[local experts, ranks x width, D]``:
        each local expert's slots from every source rank, the experts' input."""
        local, dim = self.num_experts // self.ranks, arrived.shape[-1]
        grouped = arrived.reshape(self.ranks, local, width, dim).transpose(0, 1)
        return grouped.reshape(local, self.ranks * width, dim)

    def output_blocks(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """Expert outputs ``[local, ranks x width, D]`` -> ``[ranks, local x width, D]``: block
        j goes back to source rank j (the inverse of :meth:`expert_rows`)."""
        local, dim = self.num_experts // self.ranks, y.shape[-1]
        blocks = y.reshape(local, self.ranks, width, dim).transpose(0, 1)
        return blocks.reshape(self.ranks, local * width, dim)

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """Copies sorted by expert -> ``[local experts, ranks * C, D]`` (empty slots zero)."""
        self.check_counts(counts)
        cap = self.capacity(x.shape[0])
        layout = slot_layout(counts, x.shape[0], cap)
        slots = padded_gather(x, layout.src, layout.dst)
        arrived = self.exchange(self.rank_blocks(slots, cap))
        return self.expert_rows(arrived, cap), None, (layout, cap)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """Expert outputs ``[local experts, ranks * C, D]`` -> one row per sorted copy (zero
        for a dropped copy)."""
        layout, cap = state
        back = self.exchange(self.output_blocks(y, cap))
        back = back.reshape(self.num_experts * cap, y.shape[-1])
        return padded_gather(back, layout.dst, layout.src)

    def dropped(self, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """``[E]`` int64: copies this rank drops per expert."""
        return dropped_copies(counts, self.capacity(copies))
