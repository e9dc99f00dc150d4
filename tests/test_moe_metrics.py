"""The trainer's MoE statistics from routing counts: per-layer expert load, the worst layer's
imbalance, dropped copies per step, and the console field."""

from __future__ import annotations

import torch

from torchtitan_omni.components.moe_metrics import MoECounter, console_summary, moe_metrics


def test_counter_sums_micro_batches_and_steps():
    counter = MoECounter()
    counter.add(None)  # a dense foundation
    assert counter.take() == (None, 0)
    a = torch.tensor([[[1, 2]], [[0, 1]]])
    counter.add(a)
    counter.add(a)
    counter.end_step()
    counter.add(a)
    counter.end_step()
    counts, steps = counter.take()
    assert counts.tolist() == [[[3, 6]], [[0, 3]]] and steps == 2
    assert a.tolist() == [[[1, 2]], [[0, 1]]]  # the first micro-batch's tensor is not modified
    assert counter.take() == (None, 0)


def test_metrics_per_layer_worst_layer_and_drops():
    loads = torch.tensor([[4, 4, 4, 4], [2, 10, 4, 0]])  # summed over 2 steps
    m = moe_metrics(loads, routed=torch.tensor([16, 16]), dropped=torch.tensor([0, 4]), steps=2)
    assert (m["moe/layer_1/min_tokens"], m["moe/layer_1/max_tokens"]) == (0.0, 5.0)
    assert m["moe/layer_1/mean_tokens"] == 2.0 and m["moe/layer_0/max_over_mean"] == 1.0
    assert m["moe/max_over_mean"] == 2.5 and m["moe/worst_layer"] == 1
    assert m["moe/dropped_tokens"] == 2.0 and m["moe/dropped_fraction"] == 4 / 32
    assert console_summary(m) == "moe: max/mean 2.50 (layer 1) dropped 2 (12.50%)"
    assert console_summary({"loss": 1.0}) == ""
