"""What a rank's GPU memory held at its peak, from a CUDA memory snapshot.

Reads the pickle TorchTitan writes with ``--profiling.enable_memory_snapshot`` (every
``profiling.profile_freq`` steps, ``<dump_folder>/<save_memory_snapshot_folder>/iteration_N/
rankR_memory_snapshot.pickle``: ``torch.cuda.memory._snapshot()``, the allocator's segments now
and its ring buffer of the last allocations and frees, each with the stack that made it).

The trace is replayed on one device: each ``alloc`` adds its bytes, each ``free_completed``
takes them back (``free_requested`` still holds them: another stream may be using the block).
The bytes live before the trace's window opened are the blocks active now less the trace's net
change, so every point of the window has an absolute figure. At the highest one (the window's
peak of active memory, as ``torch.cuda.max_memory_allocated`` counts it) the live blocks are
grouped by where they were allocated:

- ``--by site``: the innermost frame in this repository's code or TorchTitan's
  (``torchtitan_omni/``, ``models/``, ``scripts/``, ``torchtitan/``: the module or function
  that asked for the memory) and the innermost Python frame (torch's function, or the line of
  inductor's generated code that allocates the buffer);
- ``--by repo``: that repository frame alone, which is stable from tree to tree (generated
  files are named by hash), for comparing two trees' snapshots;

and blocks from before the window are one line (the default prints both groupings). A peak
made at a compile step (autotuning's buffers) and one made in steady state read differently:
snapshots at two steps tell them apart.

    python3 scripts/summarize_memory.py SNAPSHOT.pickle [--device N] [--top 20] [--by site|repo]
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections import defaultdict
from dataclasses import dataclass, field

GIB = 1024**3
#: frames of the code whose allocations this summary names: this repository's and TorchTitan's
REPO_FILE = re.compile(r"(torchtitan_omni|models|scripts|torchtitan)/[^/].*\.py$")
#: the allocator's states of a block that holds memory
ACTIVE_STATES = ("active_allocated", "active_pending_free")


@dataclass
class Peak:
    """The window's peak of active memory and what was live at it."""

    device: int
    entries: int
    index: int  # the trace entry that made the peak (-1: no allocation in the window)
    peak_bytes: int  # absolute: the bytes before the window plus the window's net change
    before_window_bytes: int  # of the peak, blocks allocated before the window opened
    active_now_bytes: int
    reserved_now_bytes: int
    by_site: dict[str, list[int]] = field(default_factory=dict)  # site -> [bytes, blocks]


def _python_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if str(f.get("filename", "")).endswith(".py")]


def _fmt(frame: dict) -> str:
    path = str(frame["filename"])
    match = REPO_FILE.search(path)
    short = match.group(0) if match else path.rsplit("/", 1)[-1]
    return f"{short}:{frame['line']} {frame['name']}"


def site_of(frames: list[dict], by: str = "site") -> str:
    """Where a block was allocated: its stack (innermost frame first, as the snapshot stores
    it) reduced to its innermost repository frame, with its innermost Python frame for
    ``by == "site"``."""
    python = _python_frames(frames)
    if not python:
        return "(no Python frame)"
    repo = [f for f in python if REPO_FILE.search(str(f["filename"]))]
    outer = _fmt(repo[0]) if repo else "(no repository frame)"
    if by == "repo":
        return outer
    inner = _fmt(python[0])
    return outer if inner == outer else f"{outer} <- {inner}"


def summarize(snapshot: dict, device: int | None = None, by: str = "site") -> Peak:
    """The peak of ``snapshot``'s trace on ``device`` (default: the one device with a trace,
    as a rank's own snapshot has) and its live blocks by site."""
    traces = snapshot.get("device_traces") or []
    if device is None:
        traced = [i for i, t in enumerate(traces) if t]
        if len(traced) != 1:
            raise ValueError(f"{len(traced)} devices have a trace ({traced}): pass --device")
        device = traced[0]
    if not 0 <= device < len(traces):
        raise ValueError(f"the snapshot has no trace for device {device} "
                         f"({len(traces)} devices)")
    trace = traces[device]
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    active_now = sum(b["size"] for s in segments for b in s.get("blocks", [])
                     if b.get("state") in ACTIVE_STATES)
    reserved_now = sum(s["total_size"] for s in segments)

    net, high, high_at = 0, 0, -1
    for i, entry in enumerate(trace):
        if entry["action"] == "alloc":
            net += entry["size"]
            if net > high or high_at < 0:
                high, high_at = net, i
        elif entry["action"] == "free_completed":
            net -= entry["size"]
    before_window = active_now - net
    if high_at < 0:
        return Peak(device, len(trace), -1, before_window, before_window, active_now,
                    reserved_now)

    live: dict[int, tuple[int, list[dict]]] = {}
    freed_from_before = 0
    for entry in trace[:high_at + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = (entry["size"], entry.get("frames") or [])
        elif entry["action"] == "free_completed":
            if live.pop(entry["addr"], None) is None:
                freed_from_before += entry["size"]
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        row = sites[site_of(frames, by)]
        row[0] += size
        row[1] += 1
    return Peak(device, len(trace), high_at, before_window + high, before_window -
                freed_from_before, active_now, reserved_now, dict(sites))


def report(peak: Peak, top: int = 20) -> str:
    """The summary as text: the peak, then its live bytes by site, largest first."""
    lines = [f"device {peak.device}: {peak.entries} trace entries; now "
             f"{peak.active_now_bytes / GIB:.2f} GiB active, {peak.reserved_now_bytes / GIB:.2f}"
             f" GiB reserved"]
    if peak.index < 0:
        lines.append("no allocation in the trace's window")
        return "\n".join(lines)
    lines.append(f"peak of active memory in the window: {peak.peak_bytes / GIB:.2f} GiB at "
                 f"entry {peak.index} of {peak.entries}")
    lines.append(f"  {peak.before_window_bytes / GIB:8.3f} GiB  from before the window "
                 "(parameters, optimizer states, ...)")
    ranked = sorted(peak.by_site.items(), key=lambda kv: -kv[1][0])
    for site, (size, count) in ranked[:top]:
        lines.append(f"  {size / GIB:8.3f} GiB  {count:5d} blocks  {site}")
    rest = ranked[top:]
    if rest:
        lines.append(f"  {sum(r[1][0] for r in rest) / GIB:8.3f} GiB  "
                     f"{sum(r[1][1] for r in rest):5d} blocks  ({len(rest)} more sites)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a memory snapshot pickle")
    parser.add_argument("--device", type=int, default=None,
                        help="the CUDA device of the trace (default: the one with a trace)")
    parser.add_argument("--top", type=int, default=20, help="sites to list")
    parser.add_argument("--by", choices=("site", "repo", "site,repo"), default="site,repo",
                        help="group by repository frame and innermost frame, or the first "
                        "alone, or both one after the other (the snapshot read once)")
    args = parser.parse_args()
    try:
        with open(args.snapshot, "rb") as handle:
            snapshot = pickle.load(handle)
        peaks = [summarize(snapshot, args.device, by) for by in args.by.split(",")]
    except (OSError, pickle.UnpicklingError, ValueError, KeyError) as error:
        raise SystemExit(f"summarize_memory: {args.snapshot}: {error}") from None
    for by, peak in zip(args.by.split(","), peaks):
        print(f"-- by {by}")
        print(report(peak, args.top))


if __name__ == "__main__":
    main()
