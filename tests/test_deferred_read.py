"""``components.deferred_read``: a log step's device values read on the host later, and the
log windows timed by the events behind them (the GPU side, that the host does not wait and that
a window covers the GPU's time, is in ``test_gpu_fast_paths.py``)."""

import torch

from tests.harness import metrics_processor


def test_deferred_read_gives_back_names_shapes_and_exact_counts():
    """On CPU the copy is the read: each value comes back under its name, in its shape, as
    float64 (counts up to 2**53 exactly)."""
    from torchtitan_omni.components.deferred_read import DeferredRead

    big = 2**40 + 1
    read = DeferredRead({"loss": torch.tensor([0.5]), "loads": torch.tensor([[big, 2], [3, 4]]),
                         "norm": torch.tensor(7.0)})
    got = read.result()
    assert list(got) == ["loss", "loads", "norm"]
    assert got["loss"].tolist() == [0.5] and got["norm"].shape == ()
    assert got["loads"].shape == (2, 2) and int(got["loads"][0, 0]) == big
    assert read.done()


class _Mark:
    """A stand-in for a timed CUDA event: recorded at ``t`` seconds of the GPU's clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_Mark") -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event's


def test_a_marked_window_is_timed_between_the_previous_mark_and_its_own():
    """A deferred line's throughput covers the interval between the previous log step's mark
    and its own (the GPU's clock), not the host's time between queuing them; a window without
    a mark before it (the first) or without its own (CPU) is timed on the host. Its step time
    is that interval over the training steps counted since the previous line."""
    metrics = metrics_processor()

    def line(tokens: int, mark: _Mark | None, steps: int = 1) -> float:
        metrics.ntokens_since_last_log = tokens
        metrics.steps_since_last_log = steps  # the trainer counts one per train_step
        window = metrics.close_window(mark)
        assert metrics.steps_since_last_log == 0 and window.steps == steps
        metrics.log_losses(1, 1.0, 1.0, {"text": 1.0}, 1.0, window=window)
        return metrics.last_metrics["throughput(tps)"]

    first = line(100, _Mark(10.0))  # no mark before it: the host's (tiny) interval
    assert first > 100 / 0.5
    assert line(1000, _Mark(12.5)) == 1000 / 2.5
    assert metrics.last_metrics["time_metrics/end_to_end(s)"] == 2.5
    assert line(600, _Mark(14.0), steps=3) == 600 / 1.5  # a line every 3 steps
    assert metrics.last_metrics["time_metrics/end_to_end(s)"] == 0.5  # seconds per step
    assert line(50, None) > 50 / 0.5  # unmarked (CPU): the host's interval again
