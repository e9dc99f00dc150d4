"""Host values a checkpointed forward records for its recompute to replay.

Under full activation checkpointing a unit's forward runs twice: in the forward pass, and
again in the backward (the recompute). The recompute repeats the forward exactly, so the values
it derives are the ones the forward derived. Some of them cost a host sync to get: the exact
expert-parallel dispatcher (``torchtitan_omni.distributed.expert_parallel``) reads its
all-to-all split sizes on the host, once per MoE layer and pass. With a tape, the forward
records them and the recompute replays them: that read, and the count exchange before it,
happen once per layer and step instead of twice, and the recompute no longer makes the host
wait for the GPU in the middle of the backward.

:func:`checkpoint_contexts` is a ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant):
each checkpointed call gets its own tape, recording while its forward runs and replaying, in
call order, while its recompute runs. A module gets such a value through
:func:`recorded_or_replayed` (or asks :func:`active_tape` which of the two is going on: None
outside a taped checkpoint). Without grad the forward context is never entered,
so nothing is recorded for a recompute that cannot come.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# the forward runs on the caller's thread, the recompute on autograd's: each sets its own
_local = threading.local()


class RecomputeTape:
    """Values recorded in a checkpointed forward, replayed in its recompute in the same
    order."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.replaying = False
        self._cursor = 0

    def record(self, value: Any) -> None:
        """Keep ``value`` for the recompute."""
        self.entries.append(value)

    def start(self, replaying: bool) -> None:
        """Begin a run: recording (appending), or replaying from the first value."""
        self.replaying, self._cursor = replaying, 0

    def replay(self) -> Any:
        """The next recorded value (the recompute asks in the forward's order)."""
        if self._cursor >= len(self.entries):
            raise RuntimeError(
                f"activation recompute asked for recorded value {self._cursor + 1}, but its "
                f"forward recorded {len(self.entries)}: the checkpointed forward did not "
                "repeat itself")
        value = self.entries[self._cursor]
        self._cursor += 1
        return value

    def running(self, replaying: bool) -> _TapeRunning:
        """A context (re-enterable) with this tape active on the current thread, recording, or
        replaying from the start."""
        return _TapeRunning(self, replaying)


class _TapeRunning:
    def __init__(self, tape: RecomputeTape, replaying: bool) -> None:
        self.tape, self.replaying = tape, replaying
        self.outer: list[RecomputeTape | None] = []

    def __enter__(self) -> RecomputeTape:
        self.outer.append(getattr(_local, "tape", None))
        self.tape.start(self.replaying)
        _local.tape = self.tape
        return self.tape

    def __exit__(self, *exc: object) -> None:
        _local.tape = self.outer.pop()


def active_tape() -> RecomputeTape | None:
    """The tape of the checkpointed call running on this thread, if any."""
    return getattr(_local, "tape", None)


def recorded_or_replayed(compute: Callable[[], T]) -> T:
    """``compute()``, recorded on the active tape in a checkpointed forward; in its recompute,
    the recorded value instead (``compute`` is not called); outside a tape, ``compute()``."""
    tape = active_tape()
    if tape is not None and tape.replaying:
        return tape.replay()
    value = compute()
    if tape is not None:
        tape.record(value)
    return value


def checkpoint_contexts() -> tuple[_TapeRunning, _TapeRunning]:
    """``context_fn`` of ``torch.utils.checkpoint``: (forward context, recompute context) over
    one new tape."""
    tape = RecomputeTape()
    return tape.running(replaying=False), tape.running(replaying=True)
