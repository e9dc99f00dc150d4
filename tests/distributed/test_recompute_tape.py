"""The recompute tape (``torchtitan_omni.distributed.recompute_tape``) under
``torch.utils.checkpoint``: what a checkpointed forward records, its recompute replays in order
(the function runs twice, the recorded source is read once); a recompute asking for more than
was recorded fails naming it; no tape outside a checkpoint, without grad, or on another thread;
``recorded_or_replayed`` computes once per checkpointed call."""

import itertools
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torchtitan_omni.distributed.recompute_tape import active_tape, checkpoint_contexts


def _scaled(source, runs: list[str]):
    """``sin(x * a) * b`` (sin keeps its input for the backward: a recompute) with a and b
    drawn from ``source`` in the forward, replayed in the recompute."""
    def fn(x):
        tape = active_tape()
        assert tape is not None
        runs.append("replay" if tape.replaying else "record")
        if tape.replaying:
            a, b = tape.replay(), tape.replay()
        else:
            a, b = next(source), next(source)
            tape.record(a)
            tape.record(b)
        return torch.sin(x * a) * b
    return fn


def test_the_recompute_replays_what_the_forward_recorded():
    source = itertools.count(2)  # 2, 3, then 4, 5, ... if read again
    runs: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = checkpoint(_scaled(source, runs), x, use_reentrant=False,
                   context_fn=checkpoint_contexts)
    y.sum().backward()
    assert runs == ["record", "replay"]
    two = torch.tensor(2.0)
    torch.testing.assert_close(y.detach(), torch.sin(two).expand(3) * 3)
    torch.testing.assert_close(x.grad, torch.cos(two).expand(3) * 6)  # a, b = 2, 3: not 4, 5
    assert next(source) == 4


def test_a_recompute_asking_for_more_fails():
    calls = itertools.count()

    def fn(x):
        tape = active_tape()
        if tape.replaying:
            tape.replay()
            tape.replay()  # one more than the forward recorded
        else:
            tape.record(next(calls))
        return torch.sin(x)

    x = torch.ones(2, requires_grad=True)
    y = checkpoint(fn, x, use_reentrant=False, context_fn=checkpoint_contexts)
    with pytest.raises(RuntimeError, match="asked for recorded value 2, but its forward "
                                           "recorded 1"):
        y.sum().backward()


def test_no_tape_outside_a_checkpoint_without_grad_or_on_another_thread():
    assert active_tape() is None
    seen = {}

    def fn(x):
        seen["tape"] = active_tape()
        other = threading.Thread(target=lambda: seen.setdefault("other", active_tape()))
        other.start()
        other.join()
        return x + 1

    with torch.no_grad():
        checkpoint(fn, torch.ones(2), use_reentrant=False, context_fn=checkpoint_contexts)
    assert seen == {"tape": None, "other": None}
    seen.clear()
    checkpoint(fn, torch.ones(2, requires_grad=True), use_reentrant=False,
               context_fn=checkpoint_contexts)
    assert seen["tape"] is not None and seen["other"] is None
    assert active_tape() is None  # restored on leaving


def test_recorded_or_replayed_computes_once_per_checkpointed_call():
    from torchtitan_omni.distributed.recompute_tape import recorded_or_replayed

    source = itertools.count(2)

    def fn(x):
        return torch.sin(x) * recorded_or_replayed(lambda: next(source))

    assert recorded_or_replayed(lambda: next(source)) == 2  # no tape: computed
    x = torch.ones(2, requires_grad=True)
    y = checkpoint(fn, x, use_reentrant=False, context_fn=checkpoint_contexts)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(torch.ones(2)) * 3)  # 3 in both runs
    assert next(source) == 4
