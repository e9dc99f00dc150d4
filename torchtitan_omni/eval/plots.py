"""PNG loss curves (matplotlib, the ``eval`` extra) and the markdown summary of a run.

``plot_run`` writes one figure per loss (training raw and smoothed, validation raw and
smoothed on the same axes: ``loss_<name>.png``) and one per validation modality mix
(``val_mix_<mix>.png``); ``plot_comparison`` overlays several runs, one figure per tag.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from torchtitan_omni.eval.curves import (
    TRAIN_PREFIX, VAL_MIX_PREFIX, VAL_TOTAL, Curve, loss_name, loss_tags, smooth,
)


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415  (the optional [eval] extra)
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install -e '.[eval]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415  (after choosing the Agg backend)

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def _xy(curve: Curve) -> tuple[list[int], list[float]]:
    steps = sorted(curve)
    return steps, [curve[s] for s in steps]


def _draw(ax, curve: Curve, label: str, color: str, smoothing: float, marker: str = "") -> None:
    steps, values = _xy(curve)
    ax.plot(steps, values, color=color, alpha=0.3, marker=marker, label=f"{label} (raw)")
    if len(values) > 1 and smoothing > 0:
        ax.plot(steps, smooth(values, smoothing), color=color, label=f"{label} (smoothed)")


def _save(plt, fig, ax, title: str, path: str) -> str:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(scalars: dict[str, Curve], out_dir: str, smoothing: float = 0.6,
             title: str = "") -> list[str]:
    """Write the run's loss figures into ``out_dir``; returns their paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    tags = loss_tags(scalars)
    by_loss: dict[str, dict[str, str]] = {}
    for tag in tags:
        if tag.startswith(VAL_MIX_PREFIX):
            continue
        kind = "train" if tag.startswith(TRAIN_PREFIX) else "validation"
        by_loss.setdefault(loss_name(tag), {})[kind] = tag
    paths = []
    for name, kinds in by_loss.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        if "train" in kinds:
            _draw(ax, scalars[kinds["train"]], "training", "tab:blue", smoothing)
        if "validation" in kinds:
            _draw(ax, scalars[kinds["validation"]], "validation", "tab:orange", smoothing, "o")
        path = os.path.join(out_dir, f"loss_{_safe(name)}.png")
        paths.append(_save(plt, fig, ax, f"{title} {name} loss".strip(), path))
    for tag in tags:
        if not tag.startswith(VAL_MIX_PREFIX):
            continue
        mix = tag[len(VAL_MIX_PREFIX):]
        fig, ax = plt.subplots(figsize=(7, 4))
        _draw(ax, scalars[tag], f"validation text loss, {mix}", "tab:green", smoothing, "o")
        path = os.path.join(out_dir, f"val_mix_{_safe(mix)}.png")
        paths.append(_save(plt, fig, ax, f"{title} validation: {mix} documents".strip(), path))
    return paths


def plot_comparison(runs: Sequence[tuple[str, dict[str, Curve]]], tags: Sequence[str],
                    out_dir: str, smoothing: float = 0.6) -> list[str]:
    """One figure per tag with every run's curve (``compare_<tag>.png``); returns the paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []
    for tag in tags:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (label, scalars) in enumerate(runs):
            if tag in scalars:
                marker = "o" if tag.startswith("validation") else ""
                _draw(ax, scalars[tag], label, colors[i % len(colors)], smoothing, marker)
        path = os.path.join(out_dir, f"compare_{_safe(tag)}.png")
        paths.append(_save(plt, fig, ax, tag, path))
    return paths


def summary_markdown(scalars: dict[str, Curve], title: str, command: str = "",
                     figures: Sequence[str] = ()) -> str:
    """A markdown page: per loss tag its first, last and lowest value, and the figures
    (paths relative to the page)."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += ["| curve | steps | first | last | lowest (step) |", "| --- | --- | --- | --- | --- |"]
    for tag in loss_tags(scalars):
        steps, values = _xy(scalars[tag])
        if not steps:
            continue
        low = min(range(len(values)), key=values.__getitem__)
        lines.append(f"| `{tag}` | {steps[0]}-{steps[-1]} ({len(steps)}) | {values[0]:.4f} | "
                     f"{values[-1]:.4f} | {values[low]:.4f} ({steps[low]}) |")
    if VAL_TOTAL in scalars and len(scalars[VAL_TOTAL]) > 1:
        _, values = _xy(scalars[VAL_TOTAL])
        trend = "fell" if values[-1] < values[0] else "did not fall"
        lines += ["", f"Validation loss {trend}: {values[0]:.4f} -> {values[-1]:.4f}."]
    if figures:
        lines += [""] + [f"![{os.path.basename(f)}]({f})" for f in figures]
    return "\n".join(lines) + "\n"
