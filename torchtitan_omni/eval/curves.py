"""Loss curves of training runs: reading TensorBoard logs, smoothing, comparing runs.

A run's curves are its TensorBoard scalars, ``{tag: {step: value}}``. TorchTitan writes one
event folder per launch (``<dump_folder>/<metrics.save_tb_folder>/<timestamp>/``), so a resumed
run has several: they are read in launch order and a later launch's value of a step replaces
an earlier one. The tags plotted are the training losses (``loss_metrics/<name>``, the total
is ``global_avg_loss``) and the validation losses (``validation/loss``,
``validation/loss/<name>``, ``validation/mix/<mix>``) of ``torchtitan_omni.eval.validator``.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Iterable, Sequence

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

Curve = dict[int, float]
TRAIN_PREFIX = "loss_metrics/"
TRAIN_TOTAL = "loss_metrics/global_avg_loss"
VAL_TOTAL = "validation/loss"
VAL_LOSS_PREFIX = "validation/loss/"
VAL_MIX_PREFIX = "validation/mix/"


def event_files(run_dir: str) -> list[str]:
    """TensorBoard event files under ``run_dir`` (any depth), oldest launch first."""
    files = glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True)
    # launch folders are timestamps and file names carry the creation time: sort by both
    return sorted(files, key=lambda f: (os.path.dirname(f), os.path.basename(f)))


def read_scalars(run_dir: str) -> dict[str, Curve]:
    """Every scalar of the run's TensorBoard logs as ``{tag: {step: value}}``."""
    files = event_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir} (was the run "
                                "started with --metrics.enable_tensorboard?)")
    out: dict[str, Curve] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            curve = out.setdefault(tag, {})
            for event in acc.Scalars(tag):
                curve[int(event.step)] = float(event.value)
    return out


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with weight ``weight`` in
    [0, 1), debiased so the first points are not pulled towards zero."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** n))
    return out


def relative_difference(reference: Curve, other: Curve) -> tuple[float, float, int]:
    """``(max, mean, n)`` of ``|other - reference| / |reference|`` over the ``n`` steps both
    curves have."""
    steps = sorted(set(reference) & set(other))
    if not steps:
        return math.nan, math.nan, 0
    diffs = [abs(other[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in steps]
    return max(diffs), sum(diffs) / len(diffs), len(steps)


def loss_tags(scalars: dict[str, Curve]) -> list[str]:
    """The loss tags of a run, training first, then validation per loss, then per mix."""
    train = sorted(t for t in scalars if t.startswith(TRAIN_PREFIX)
                   and t != "loss_metrics/global_max_loss")
    val = sorted(t for t in scalars if t == VAL_TOTAL or t.startswith(VAL_LOSS_PREFIX))
    mix = sorted(t for t in scalars if t.startswith(VAL_MIX_PREFIX))
    return train + val + mix


def loss_name(tag: str) -> str:
    """The loss a training or validation tag measures ("total" for the weighted sum)."""
    if tag in (TRAIN_TOTAL, VAL_TOTAL):
        return "total"
    for prefix in (VAL_LOSS_PREFIX, TRAIN_PREFIX):
        if tag.startswith(prefix):
            return tag[len(prefix):]
    return tag


def compare_runs(runs: Sequence[dict[str, Curve]], tags: Iterable[str] | None = None
                 ) -> dict[str, list[tuple[float, float, int]]]:
    """Per tag shared by every run: each later run's :func:`relative_difference` from the
    first."""
    if len(runs) < 2:
        raise ValueError("comparing needs at least two runs")
    shared = set(runs[0]).intersection(*runs[1:])
    wanted = [t for t in (tags if tags is not None else loss_tags(runs[0])) if t in shared]
    return {t: [relative_difference(runs[0][t], r[t]) for r in runs[1:]] for t in wanted}
