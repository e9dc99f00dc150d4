"""MoE statistics of training: expert load per layer and dropped token copies.

The trainer adds every micro-batch's routing counts (``OmniOutput.moe_counts``: per layer and
expert, the router's assignments and the copies dropped over capacity) to a
:class:`MoECounter` on the device, with no host read. At a log step it reduces them once
(loads over the expert-parallel group: the tokens each expert's rank computes; drops over all
ranks) and reads them on the host once; :func:`moe_metrics` turns them into per-step scalars:

- ``moe/layer_<i>/{min,max,mean}_tokens``: tokens (routed copies) per expert of layer i;
- ``moe/layer_<i>/max_over_mean``: its imbalance (1 is perfect balance);
- ``moe/max_over_mean``, ``moe/worst_layer``: the most imbalanced layer;
- ``moe/dropped_tokens``: (token, expert) copies dropped over capacity, summed over ranks;
  ``moe/dropped_fraction``: their share of all routed copies.

Values are means per step over the steps since the last log (``metrics.log_freq``).
"""

from __future__ import annotations

import torch

#: the metric whose presence adds the MoE field to the console line
MAX_OVER_MEAN = "moe/max_over_mean"
DROPPED = "moe/dropped_tokens"


class MoECounter:
    """Routing counts summed on the device since the last log step."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.steps = 0

    def add(self, counts: torch.Tensor | None) -> None:
        """Add one micro-batch's ``[2, layers, experts]`` counts (None: no MoE)."""
        if counts is None:
            return
        counts = counts.detach()
        self.counts = counts.clone() if self.counts is None else self.counts + counts

    def end_step(self) -> None:
        """Mark the end of a training step (the counts are averaged per step)."""
        self.steps += 1

    def take(self) -> tuple[torch.Tensor | None, int]:
        """The counts and the number of steps they cover; starts a new interval."""
        counts, steps = self.counts, self.steps
        self.counts, self.steps = None, 0
        return counts, steps


def moe_metrics(loads: torch.Tensor, routed: torch.Tensor, dropped: torch.Tensor,
                steps: int) -> dict[str, float]:
    """Scalars from host tensors: ``loads`` ``[layers, experts]`` (summed over the EP group),
    ``routed``/``dropped`` ``[layers]`` (summed over all ranks), over ``steps`` steps."""
    steps = max(steps, 1)
    loads = loads.double() / steps
    out: dict[str, float] = {}
    worst, worst_ratio = 0, 0.0
    for i, layer in enumerate(loads):
        mean = float(layer.mean())
        ratio = float(layer.max()) / mean if mean > 0 else 0.0
        out[f"moe/layer_{i}/min_tokens"] = float(layer.min())
        out[f"moe/layer_{i}/max_tokens"] = float(layer.max())
        out[f"moe/layer_{i}/mean_tokens"] = mean
        out[f"moe/layer_{i}/max_over_mean"] = ratio
        if ratio > worst_ratio:
            worst, worst_ratio = i, ratio
    total_routed, total_dropped = float(routed.sum()), float(dropped.sum())
    out[MAX_OVER_MEAN] = worst_ratio
    out["moe/worst_layer"] = worst
    out[DROPPED] = total_dropped / steps
    out["moe/dropped_fraction"] = total_dropped / total_routed if total_routed else 0.0
    return out


def console_summary(metrics: dict) -> str:
    """One console field, e.g. ``moe: max/mean 1.84 (layer 3) dropped 120 (0.52%)``; empty
    without MoE metrics."""
    if MAX_OVER_MEAN not in metrics:
        return ""
    return (f"moe: max/mean {metrics[MAX_OVER_MEAN]:.2f} (layer {metrics['moe/worst_layer']}) "
            f"dropped {metrics[DROPPED]:,.0f} ({100 * metrics['moe/dropped_fraction']:.2f}%)")
