"""Chunked capacity-padded expert dispatch: each chunk's all-to-alls overlap the experts of
its neighbours (``parallelism.expert_dispatch_chunks`` > 1).

The capacity-padded dispatcher (``torchtitan_omni.modules.moe_capacity``,
``expert_parallel.CapacityExpertParallelDispatcher``) sends ``[E x C, D]`` expert-major slots in
one all-to-all, runs the experts on all of them, and sends the outputs back in a second one:
the experts wait for the whole exchange and the exchange back waits for the whole experts
pass. Its splits are static (``C`` is a config value), so the exchange can be cut without any
host read. With ``n`` chunks, chunk ``c`` holds slots ``[a_c, a_c + w_c)`` of every (source
rank, expert) block (``w_c`` = ``C // n`` or one more; no divisibility needed, and chunks past
``C`` are skipped). The schedule of one layer::

    send(0)
    for c in 0 .. n-1:
        send(c + 1)             # launched, not waited
        y_c = experts(recv(c))  # waits for chunk c only, while chunk c+1 travels
        back(c)                 # launched, not waited: travels while chunk c+1 computes
    wait for every back(c)

Every exchange is a launch/wait pair of functional collective ops
(``comm.all_to_all_blocks_launch`` / ``all_to_all_blocks_wait``) whose backward is asynchronous
too: the wait's backward launches the reverse exchange of the gradient, the launch's backward
waits for it. The autograd engine runs ready nodes in reverse creation order, so the order in
which the forward creates the pairs sets the backward's schedule::

    launch every back(c)'s reverse          # the waits of back(c) were created last
    for c in n-1 .. 0:
        wait back(c)'s reverse; experts(c) backward   # back(c-1 .. 0)'s reverses in flight
        launch send(c)'s reverse            # travels during experts(c-1) backward
        (wait send(c+1)'s reverse)
    wait send(0)'s reverse; the chunks' gradients concatenated once (the split's backward)

``ChunkedExchange.trace`` (a test hook) records these launches and waits. ``torch.compile``
traces the pairs (functional ops, no work handles), and AOT autograd's backward graph keeps this
order (``tests/distributed/test_moe_dispatch.py`` checks both).

Drops and counts are those of one chunk: the slot layout (which copies get a slot) is computed
once with the full ``C``, and only then are the slots reordered chunk-major (a permutation of
slot indices, folded into the one gather that fills them), so the same copies are dropped and
:meth:`dropped` counts them as before. Per slot the experts compute the same rows, so outputs
and gradients equal one chunk's up to float summation order (the expert weights' gradients
sum over chunks).

The experts module runs once per chunk: under FSDP (the experts' ``efsdp`` unit) each call
passes its hooks; with ``reshard_after_forward`` the experts' parameters are gathered again per
chunk, which this trades against the overlap (measured on GPU next). In backward FSDP's hooks
run per chunk inside the schedule above: the pre-backward all-gather (with
``reshard_after_forward``) after back(c)'s reverse is waited, while the other chunks' reverses
travel; the post-backward reduce-scatter of the gradients so far right after experts(c)
backward, before send(c)'s reverse is launched (n reduce-scatters per layer, summing to one).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from torchtitan_omni.distributed.comm import (
    ProcessGroup, all_to_all_blocks_launch, all_to_all_blocks_wait,
)
from torchtitan_omni.modules.moe_capacity import padded_gather, slot_layout
from torchtitan_omni.modules.row_maps import inverse_permutation


def chunk_widths(cap: int, chunks: int) -> list[int]:
    """Slots per chunk of ``cap`` slots cut into ``chunks`` near-equal, non-empty pieces (the
    first ``cap % chunks`` one slot wider; fewer pieces when ``cap < chunks``)."""
    n = max(1, min(chunks, cap))
    return [cap // n + (1 if c < cap % n else 0) for c in range(n)] if cap else [0]


def chunk_major_order(experts: int, cap: int, widths: list[int],
                      device: torch.device) -> torch.Tensor:
    """``order[new] = old``: the ``[E x C]`` expert-major slots reordered chunk by chunk, each
    chunk ``[E, w_c]`` expert-major (so its rows for rank j's experts are one block)."""
    slots = torch.arange(experts * cap, device=device).view(experts, cap)
    pieces, start = [], 0
    for width in widths:
        pieces.append(slots[:, start:start + width].reshape(-1))
        start += width
    return torch.cat(pieces)


class ChunkedExchange:
    """Mixin of a capacity-padded expert-parallel dispatcher
    (``moe_capacity.CapacityDispatcher`` with ``group`` and ``chunks``): :meth:`run` cuts the
    exchange into ``chunks`` and overlaps it with the experts (see the module docstring);
    ``expert_parallel.ChunkedCapacityExpertParallelDispatcher`` is the class. Its
    ``dispatch`` and ``combine`` (one chunk) stay available."""

    group: ProcessGroup
    num_experts: int
    chunks: int
    # the capacity dispatcher's methods (annotations only, so its methods are the ones found)
    capacity: Callable[[int], int]
    check_counts: Callable[[torch.Tensor], None]
    rank_blocks: Callable[[torch.Tensor, int], torch.Tensor]
    expert_rows: Callable[[torch.Tensor, int], torch.Tensor]
    output_blocks: Callable[[torch.Tensor, int], torch.Tensor]

    #: test hook (eager only): called ``(event, exchange, chunk)`` when the backward launches
    #: (``"launch"``) or waits for (``"wait"``) the gradient exchange of a chunk's
    #: ``"dispatch"`` or ``"combine"`` all-to-all
    trace: Callable[[str, str, int], None] | None = None

    def _hook(self, event: str, exchange: str, chunk: int) -> Callable[[], None] | None:
        trace = self.trace
        return None if trace is None else partial(trace, event, exchange, chunk)

    def run(self, experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sorted copies ``[N * k, D]`` -> the experts' outputs, one row per copy (zero for a
        dropped copy), chunk by chunk with the exchanges in flight during the experts, forward
        and backward."""
        self.check_counts(counts)
        cap = self.capacity(x.shape[0])
        widths = chunk_widths(cap, self.chunks)
        layout = slot_layout(counts, x.shape[0], cap)
        total = self.num_experts * cap
        order = chunk_major_order(self.num_experts, cap, widths, counts.device)
        # position of every old slot in the chunk-major order; the extra entry keeps the
        # "dropped" marker (total) of the copies without a slot
        position = inverse_permutation(order)
        position = torch.cat([position, position.new_full((1,), total)])
        src, dst = layout.src.index_select(0, order), position.index_select(0, layout.dst)
        slots = padded_gather(x, src, dst)
        # one split (not n slices): its backward concatenates the chunks' gradients once
        pieces = torch.split(slots, [self.num_experts * w for w in widths])

        def send(c: int) -> torch.Tensor:
            return all_to_all_blocks_launch(self.rank_blocks(pieces[c], widths[c]), self.group,
                                            self._hook("wait", "dispatch", c))

        backs: list[torch.Tensor] = []
        pending = [send(0)]
        for c, width in enumerate(widths):
            if c + 1 < len(widths):
                pending.append(send(c + 1))  # travels while chunk c computes
            arrived = all_to_all_blocks_wait(pending[c], self.group,
                                             self._hook("launch", "dispatch", c))
            y = experts(self.expert_rows(arrived, width), None)
            # launched now, waited after the last chunk: travels while chunk c+1 computes
            backs.append(all_to_all_blocks_launch(self.output_blocks(y, width), self.group,
                                                  self._hook("wait", "combine", c)))
        # Every wait after every chunk: in backward (reverse creation order) their nodes run
        # first, so every chunk's gradient combine exchange is launched before any chunk's
        # experts backward, each waited just before its own chunk's.
        out_dim = backs[0].shape[-1]
        back = torch.cat([
            all_to_all_blocks_wait(b, self.group, self._hook("launch", "combine", c))
            .reshape(self.num_experts * w, out_dim)
            for c, (b, w) in enumerate(zip(backs, widths))])
        return padded_gather(back, dst, src)
