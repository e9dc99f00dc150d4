"""Where the GPU time of a profiled step goes: a PyTorch profiler (Chrome) trace summarized.

Prints the step's wall time, the GPU kernel time (and so how idle the GPU was), the kernel
time by kind (matrix products, attention, communication, the rest), the top kernels, the
longest idle gaps, the host syncs (CUDA ``*Synchronize`` calls, by the host op that made
them: a sync per MoE layer, say, shows as one op's count equal to the layer count; and the
kernels the driver loaded on their first launch, which can hold the host too), the
host's compiling (frames compiled, kernels autotuned at their first launch), the compiled
graphs' calls on the host (by graph: a graph called once per tensor or chunk shows as many
calls, each a dynamo entry and a generated wrapper) and the GPU timeline by part of the
model (the LLM, each encoder, the optimizer; forward and backward):
how long each held the GPU, how much of that it computed and how long the GPU sat idle
waiting for it; then the host side by part: each host thread's time in each part, inside
top-level torch ops or outside them (Python, hooks, unrecorded waits), the GPU work it queued
and the host time per launch, and the caching allocator's driver calls (a ``cudaFree`` waits
for the whole device).
Traces come from TorchTitan's profiler, e.g. ``--profiling.enable_profiling
--profiling.profile_freq 6`` writes ``<dump_folder>/profile_traces/iteration_6/rank0_trace.json``.

    python3 scripts/summarize_trace.py outputs/x/profile_traces/iteration_6/rank0_trace.json

``--fixed-part SMALL LARGE`` compares one point profiled at one and at twice the tokens per step
(8K and 16K rows, same layout, same rank): per kind and per kernel, the time that does not grow
with tokens, 2 x small - large (what a step of no tokens would still spend), and the same for
the step's GPU span, its compute time and its idle time.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from collections import defaultdict

KINDS = (
    ("communication", re.compile(r"nccl|all_?gather|reduce_?scatter|all_?to_?all", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|sm\d+_xmma|cublas|matmul", re.I)),
)


#: trace categories of host work (torch ops, Python, profiler ranges) and of CUDA API calls
HOST_CATS = ("cpu_op", "python_function", "user_annotation")
CUDA_API = ("cuda_runtime", "cuda_driver")


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if pattern.search(name):
            return label
    return "other"


def load_events(path: str) -> list[dict]:
    """The trace's events."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


def step_kernels(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """The profiled step's own kernels and those queued before the trace opened.

    A kernel whose launch call is not in the trace was queued before it opened: the previous
    step's tail (its optimizer, say), still running when this step's recording began. Where
    the trace records no launches at all, every kernel counts as the step's own."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    launches = launch_calls(events)
    queued = [e for e in kernels if launches and _correlation(e) not in launches]
    own = [e for e in kernels if not launches or _correlation(e) in launches]
    return own, queued


def kernel_times(kernels: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Kernel time (us) by kind and by name (its first 90 characters)."""
    by_name: dict[str, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e["name"][:90]] += e["dur"]
        by_kind[kind(e["name"])] += e["dur"]
    return by_kind, by_name


def compute_busy(kernels: list[dict]) -> float:
    """Time (us) in which at least one non-communication kernel ran."""
    return _union(
        [(e["ts"], e["ts"] + e["dur"]) for e in kernels if kind(e["name"]) != "communication"]
    )


def summarize(path: str, top: int = 20) -> str:
    events = load_events(path)
    own, queued = step_kernels(events)
    kernels = own + queued
    # The profiler's warm-up steps leave ProfilerStep spans but no kernels: the window of the
    # recorded kernels is the profiled GPU time. Kinds and top kernels count this step's
    # launches only.
    start = min(e["ts"] for e in kernels)
    wall_us = max(e["ts"] + e["dur"] for e in kernels) - start
    by_kind, by_name = kernel_times(own)
    comm = sum(e["dur"] for e in kernels if kind(e["name"]) == "communication")
    busy = compute_busy(kernels)
    lines = [f"{path}: GPU window {wall_us / 1e3:.1f} ms, compute kernels busy {busy / 1e3:.1f} ms "
             f"({100 * busy / wall_us:.0f}%), communication kernels {comm / 1e3:.1f} ms (their own "
             "stream, overlapping)"]
    if queued:
        until = max(e["ts"] + e["dur"] for e in queued) - start
        lines.append(f"  of which queued before the trace opened (the previous step's tail, not "
                     f"in the kinds and top kernels below): {len(queued)} kernels, "
                     f"{sum(e['dur'] for e in queued) / 1e3:.1f} ms, until {until / 1e3:.1f} ms")
    lines += [
        f"  {k:14s} {v / 1e3:9.1f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
    ]
    lines.append("  top kernels:")
    for name, dur in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {dur / 1e3:9.1f} ms  {name}")
    lines += idle_gaps(events, kernels, top)
    lines += host_syncs(events, start, start + wall_us)
    lines += compiles(events, start, start + wall_us)
    lines += compiled_calls(events, top)
    lines += by_part(events, kernels)
    lines += host_by_part(events, top)
    return "\n".join(lines)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def idle_gaps(
    events: list[dict], kernels: list[dict], top: int, min_us: float = 2000.0
) -> list[str]:
    """The longest stretches with no compute kernel running, each with the host ops that were
    running when it began (what the GPU was waiting for)."""
    compute = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in kernels if kind(e["name"]) != "communication"
    )
    gaps, end = [], None
    for start, stop in compute:
        if end is not None and start - end >= min_us:
            gaps.append((start - end, end))
        end = stop if end is None else max(end, stop)
    host = [
        e
        for e in events
        if e.get("cat") in HOST_CATS + ("cuda_runtime",)
        and "dur" in e
    ]
    # Idle time outside these gaps is spread over short ones: kernels shorter than the host
    # needs to launch the next (a launch-bound phase).
    out = [
        f"  GPU compute idle in gaps >= {min_us / 1e3:.0f} ms: "
        f"{sum(g for g, _ in gaps) / 1e3:.1f} ms "
        f"({len(gaps)} gaps); longest, with the host ops open at their start:"
    ]
    for gap, at in sorted(gaps, reverse=True)[:top]:
        open_ops = sorted(
            (e for e in host if e["ts"] <= at <= e["ts"] + e["dur"]), key=lambda e: -e["ts"]
        )
        names = " < ".join(dict.fromkeys(str(e["name"])[:60] for e in open_ops[:4]))
        out.append(f"  {gap / 1e3:9.1f} ms  {names or '(no host op)'}")
    return out


def host_syncs(events: list[dict], start: float, stop: float) -> list[str]:
    """The CUDA synchronize calls the host made while the recorded kernels ran, counted by the
    innermost torch op open around each (the one that waited: ``_local_scalar_dense`` for an
    ``.item()``, ``aten::to`` / ``copy_`` for a device-to-host copy)."""
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]
             and start <= e["ts"] <= stop]
    by_op: dict[str, int] = defaultdict(int)
    for sync in syncs:
        op = innermost_op(ops, sync["ts"])
        caller = op["name"] if op else "(no torch op)"
        by_op[f"{sync['name']} in {caller}"[:100]] += 1
    out = [f"  host syncs in the GPU window: {len(syncs)}"]
    out += [f"  {n:9d}x  {name}" for name, n in sorted(by_op.items(), key=lambda kv: -kv[1])]
    # the caching allocator's trips to the driver: cudaFree (and unmapping expandable
    # segments) waits for the whole device, a host sync no Synchronize call shows
    memory: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if (e.get("cat") in CUDA_API and MEMORY_CALL.search(e["name"])
                and start <= e["ts"] <= stop):
            memory[e["name"]][0] += 1
            memory[e["name"]][1] += e.get("dur", 0.0)
    out += [f"  {int(n):9d}x  {name} ({dur / 1e3:.1f} ms on the host)"
            for name, (n, dur) in sorted(memory.items(), key=lambda kv: -kv[1][1])]
    return out + lazy_loads(events, ops, start, stop)


def innermost_op(ops: list[dict], at: float) -> dict | None:
    """The innermost of ``ops`` open at time ``at``: the latest to open among those still open
    (the op whose call was running then), or None."""
    around = [e for e in ops if e["ts"] <= at <= e["ts"] + e["dur"]]
    return max(around, key=lambda e: e["ts"]) if around else None


def lazy_loads(events: list[dict], ops: list[dict], start: float, stop: float) -> list[str]:
    """The kernels the CUDA driver loaded on their first launch (CUPTI's "Lazy Function
    Loading"), each with the torch op that launched it and that op's host time. A load can hold
    the host like a sync that no Synchronize call shows: a GEMM of a shape not seen before (an
    encoder's row count changes every step) can pick a cuBLAS kernel not yet loaded. In the
    twenty-third session's trace one ``aten::mm`` of the audio tower's backward held the host
    194 ms, until every kernel queued before it had run, and its load came at that moment."""
    loads = [e for e in events if e.get("cat") == "overhead" and "Lazy" in str(e.get("name"))
             and start <= e["ts"] <= stop]
    if not loads:
        return []
    out = [f"  kernels loaded at their first launch in the GPU window: {len(loads)} (a load "
           "can hold the host until the queued kernels have run); the op that launched each, "
           "and its host time:"]
    for load in sorted(loads, key=lambda e: e["ts"]):
        op = innermost_op(ops, load["ts"])
        out.append(f"  {(op['dur'] if op else 0.0) / 1e3:9.1f} ms  "
                   f"{op['name'][:60] if op else '(no torch op)'} at "
                   f"{(load['ts'] - start) / 1e3:.1f} ms")
    return out


#: the host's compile work: dynamo's compile of a frame (its whole-compile event), and
#: Inductor's autotuning of a kernel's configs at the kernel's first launch, which may come
#: steps after its graph was compiled
FRAME_COMPILE = "dynamo"
AUTOTUNE = "CachingAutotuner.benchmark_all_configs"


def compiles(events: list[dict], start: float, stop: float) -> list[str]:
    """This rank's host compiling while the recorded kernels ran: frames compiled and kernels
    autotuned (the autotuning may fall inside a frame's compile). One rank's compile stalls
    every rank at the next collective; their traces show it as a long collective kernel, not
    as a compile."""
    host = [e for e in events if e.get("cat") in HOST_CATS and "dur" in e
            and start <= e["ts"] <= stop]
    frames = [e for e in host if e["name"] == FRAME_COMPILE]
    tunes = [e for e in host if e["name"].startswith(AUTOTUNE)]
    if not (frames or tunes):
        return []
    return [f"  compiling on this host in the GPU window: {len(frames)} frame compile(s), "
            f"{sum(e['dur'] for e in frames) / 1e3:.1f} ms; {len(tunes)} kernel autotuning(s) "
            f"at first launch, {sum(e['dur'] for e in tunes) / 1e3:.1f} ms (every rank waits "
            "for it at its next collective)"]


#: inductor's host range around one call of a compiled graph's generated code, and dynamo's
#: guard check before a compiled frame runs
COMPILED_CALL = re.compile(r"^## Call CompiledFxGraph (\w+)")
CACHE_LOOKUP = "TorchDynamo Cache Lookup"


def compiled_calls(events: list[dict], top: int = 6) -> list[str]:
    """The compiled graphs' calls on the host, by graph (its hash): how many, and the host time
    in their generated code (which launches the graph's kernels), with dynamo's cache lookups
    before them. A call costs the host its entry and wrapper whatever its graph's size, so a
    graph called once per tensor or per chunk shows as many calls (the forty-first session's
    optimizer step: 62 calls of three graphs, one per tensor)."""
    calls: dict = defaultdict(lambda: [0, 0.0])
    lookups = [0, 0.0]
    for e in events:
        if "dur" not in e or e.get("cat") not in HOST_CATS:
            continue
        match = COMPILED_CALL.match(str(e["name"]))
        if match:
            calls[match.group(1)][0] += 1
            calls[match.group(1)][1] += e["dur"]
        elif e["name"] == CACHE_LOOKUP:
            lookups[0] += 1
            lookups[1] += e["dur"]
    if not calls:
        return []
    out = [f"  compiled graphs' calls on the host: {sum(n for n, _ in calls.values())} calls of "
           f"{len(calls)} graphs, {sum(d for _, d in calls.values()) / 1e3:.1f} ms in their "
           f"generated code; dynamo's cache lookups: {lookups[0]}, {lookups[1] / 1e3:.1f} ms; "
           "the most called graphs (calls, host time, per call):"]
    for graph, (n, dur) in sorted(calls.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:top]:
        out.append(f"  {n:6d}x {dur / 1e3:8.1f} ms {dur / n / 1e3:7.2f} ms  {graph[:16]}")
    return out


#: memory calls of the caching allocators: device (cudaFree waits for the device) and pinned
#: host memory (cudaHostAlloc page-locks, cudaFreeHost waits for the device)
MEMORY_CALL = re.compile(r"^(cudaFree|cudaMalloc|cuMemUnmap|cuMemMap|cuMemCreate|cuMemRelease|"
                         r"cuMemAddressFree|cudaHostAlloc|cudaFreeHost|cudaHostRegister)")
#: FSDP2's profiler ranges that open a unit's work: "FSDP::pre_forward (llm.layers.3)"
FSDP_MARK = re.compile(r"^FSDP::(pre_forward|pre_backward) \(([^)]*)\)")
OPTIMIZER = "Optimizer.step#"
AUTOGRAD = "autograd::engine::evaluate_function"


def part_of(fqn: str) -> str:
    """The model part an FSDP unit belongs to: "encoders.vision" for its blocks, "llm" for
    the foundation's layers and experts."""
    segments = fqn.split(".")
    return ".".join(segments[:2]) if segments[0] in ("encoders", "decoders") else segments[0]


def _phase_marks(events: list[dict]) -> dict:
    """Per host thread, the time-ordered ``(ts, (part, pass))`` at which its work switches: an
    FSDP unit's pre-forward or pre-backward (a pre-forward inside the autograd engine is an
    activation-checkpoint recompute: backward), an optimizer step and its end (back to the
    unit before it)."""
    autograd: dict = defaultdict(list)
    for e in events:
        if str(e.get("name", "")).startswith(AUTOGRAD) and "dur" in e:
            autograd[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    raw: dict = defaultdict(list)
    for e in events:
        name, tid = str(e.get("name", "")), e.get("tid")
        if e.get("cat") not in HOST_CATS:
            continue
        if name.startswith(OPTIMIZER) and "dur" in e:
            raw[tid] += [(e["ts"], ("optimizer", "step")), (e["ts"] + e["dur"], None)]
            continue
        match = FSDP_MARK.match(name)
        if match:
            backward = match.group(1) == "pre_backward" or any(
                a <= e["ts"] <= b for a, b in autograd.get(tid, ()))
            raw[tid].append((e["ts"], (part_of(match.group(2)),
                                       "backward" if backward else "forward")))
    marks = {}
    for tid, seq in raw.items():
        resolved, unit = [], None
        for at, mark in sorted(seq, key=lambda m: m[0]):
            if mark is None:  # an optimizer step ended
                resolved.append((at, unit))
            else:
                unit = unit if mark[0] == "optimizer" else mark
                resolved.append((at, mark))
        marks[tid] = resolved
    return marks


def _correlation(event: dict):
    return event.get("args", {}).get("correlation")


def launch_calls(events: list[dict]) -> dict:
    """The host's launch calls by correlation id: runtime launches, and driver launches
    (Triton's kernels, compiled code)."""
    return {_correlation(e): e for e in events
            if e.get("cat") in CUDA_API and _correlation(e) is not None}


def by_part(events: list[dict], kernels: list[dict]) -> list[str]:
    """The compute stream's timeline by part and pass. Each kernel belongs to the phase its
    launching host thread was in (the latest FSDP unit to start there); the time the GPU sat
    idle before a kernel belongs to that kernel's phase (the GPU was waiting for its launch or
    for its inputs), so the timelines add up to the GPU window of compute."""
    marks = _phase_marks(events)
    if not marks:
        return ["  by part: no FSDP unit ranges in the trace (one GPU, or no FSDP)"]
    starts = {tid: [at for at, _ in m] for tid, m in marks.items()}
    launches = launch_calls(events)

    def phase(kernel: dict) -> tuple[str, str]:
        launch = launches.get(_correlation(kernel))
        if launch is None:
            return ("(launch not recorded)", "")
        tid = launch.get("tid")
        at = bisect.bisect_right(starts.get(tid, []), launch["ts"]) - 1
        found = marks[tid][at][1] if at >= 0 else None
        return found or ("(before any unit)", "")

    rows: dict = {}
    # the end of the compute timeline covered so far, from the first compute kernel's start
    cursor = min((e["ts"] for e in kernels if kind(e["name"]) != "communication"), default=0.0)
    for e in sorted(kernels, key=lambda e: e["ts"]):
        row = rows.setdefault(phase(e), {"timeline": 0.0, "busy": 0.0, "comm": 0.0, "n": 0,
                                         "leads": []})
        row["n"] += 1
        if kind(e["name"]) == "communication":
            row["comm"] += e["dur"]
            continue
        launch = launches.get(_correlation(e))
        if launch is not None and "dur" in launch:
            row["leads"].append(e["ts"] - (launch["ts"] + launch["dur"]))
        start, end = e["ts"], e["ts"] + e["dur"]
        if end <= cursor:
            continue  # wholly under another compute kernel
        busy = end - max(start, cursor)
        row["busy"] += busy
        row["timeline"] += max(0.0, start - cursor) + busy
        cursor = end
    out = ["  by part (kernels by the FSDP unit their host thread was in; idle time goes to "
           "the kernel that ran next; host lead: the median time from a compute kernel's launch "
           "call to its start, near zero where the GPU waits for the host's launches):",
           f"  {'part':24s} {'pass':9s} {'timeline':>10s} {'computing':>10s} {'idle':>9s} "
           f"{'comm kernels':>13s} {'kernels':>8s} {'host lead':>10s}"]
    for (part, pass_), r in rows.items():
        lead = (f"{statistics.median(r['leads']) / 1e3:7.1f} ms" if r["leads"]
                else "         -")
        out.append(f"  {part:24s} {pass_:9s} {r['timeline'] / 1e3:7.1f} ms "
                   f"{r['busy'] / 1e3:7.1f} ms {(r['timeline'] - r['busy']) / 1e3:6.1f} ms "
                   f"{r['comm'] / 1e3:10.1f} ms {r['n']:8d} {lead}")
    return out


#: the host calls that queue GPU work (kernels, copies, memsets)
LAUNCH = re.compile(r"LaunchKernel|Memcpy|Memset", re.I)
#: a launch call longer than this waited for a slot in the GPU's full launch queue (a launch
#: takes a few microseconds, under the profiler tens; docs/performance.md, "Launch queues")
BLOCKED_LAUNCH_US = 100.0


def _top_level(ops: list[dict]) -> list[dict]:
    """The host ops of one thread not nested in an earlier one (time order)."""
    out, reach = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= reach:
            out.append(e)
            reach = e["ts"] + e["dur"]
    return out


def host_by_part(events: list[dict], top: int = 6) -> list[str]:
    """The host side of ``by_part``: how long each host thread stayed in each part and pass
    (from the mark that opened it to the next mark on that thread, or to the thread's last
    event), how much of that ran inside torch ops (top-level ``cpu_op`` spans: dispatch and
    launches) and how much outside them (Python, hooks, waits no op records), the GPU work it
    queued and the host time per launch; the longest ops of each encoder's forward; then the
    longest top-level host ops of the main thread before its first mark (the step's start:
    data, inputs, the loss normalizers), what the GPU waits for when the host falls behind."""
    marks = _phase_marks(events)
    if not marks:
        return []
    launches: dict = defaultdict(list)
    blocked: dict = defaultdict(list)
    ends: dict = defaultdict(float)
    ops: dict = defaultdict(list)
    for e in events:
        if "dur" not in e or "tid" not in e:
            continue
        if e.get("cat") in CUDA_API and LAUNCH.search(str(e["name"])):
            launches[e["tid"]].append(e["ts"])
            if e["dur"] > BLOCKED_LAUNCH_US:
                blocked[e["tid"]].append((e["ts"], e["dur"]))
        if e.get("cat") in HOST_CATS + CUDA_API:
            ends[e["tid"]] = max(ends[e["tid"]], e["ts"] + e["dur"])
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)
    rows: dict = {}
    by_op: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for tid, seq in marks.items():
        times = sorted(launches.get(tid, []))
        waits = sorted(blocked.get(tid, []))
        wait_starts = [ts for ts, _ in waits]
        top_ops = _top_level(ops.get(tid, []))
        op_starts = [e["ts"] for e in top_ops]
        bounds = [at for at, _ in seq] + [ends[tid]]
        for (at, phase), stop in zip(seq, bounds[1:]):
            if phase is None or stop <= at:
                continue
            row = rows.setdefault(phase, [0.0, 0, 0.0, 0, 0.0])
            row[0] += stop - at
            row[1] += bisect.bisect_left(times, stop) - bisect.bisect_left(times, at)
            for _, dur in waits[bisect.bisect_left(wait_starts, at):
                                bisect.bisect_left(wait_starts, stop)]:
                row[3] += 1
                row[4] += dur
            for e in top_ops[bisect.bisect_left(op_starts, at):bisect.bisect_left(op_starts, stop)]:
                row[2] += min(e["ts"] + e["dur"], stop) - e["ts"]
                by_op[phase][str(e["name"])][0] += e["dur"]
                by_op[phase][str(e["name"])][1] += 1
    out = ["  host by part (time each host thread spent in the part, inside torch ops and "
           "outside them, the GPU work it queued; blocked: launch calls over "
           f"{BLOCKED_LAUNCH_US:.0f} us, which waited for room in a full launch queue):",
           f"  {'part':24s} {'pass':9s} {'host':>10s} {'in ops':>10s} {'outside':>10s} "
           f"{'launches':>9s} {'per launch':>11s} {'blocked':>8s} {'waiting':>10s}"]
    for (part, pass_), (host_us, n, in_ops, n_blocked, waited) in rows.items():
        per = f"{host_us / n:8.1f} us" if n else "         -"
        out.append(f"  {part:24s} {pass_:9s} {host_us / 1e3:7.1f} ms {in_ops / 1e3:7.1f} ms "
                   f"{(host_us - in_ops) / 1e3:7.1f} ms {n:9d} {per:>11s} {n_blocked:8d} "
                   f"{waited / 1e3:7.1f} ms")
    for (part, pass_), names in by_op.items():
        if part.startswith("encoders.") and pass_ == "forward":
            out.append(f"  {part} forward, longest top-level ops (total, count):")
            for name, (dur, n) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]:
                out.append(f"  {dur / 1e3:9.1f} ms {n:6d}x  {name[:70]}")
    # the main thread: the one whose first mark is a forward
    main_tid = min(marks, key=lambda t: (marks[t][0][1][1] != "forward", marks[t][0][0]))
    first = marks[main_tid][0][0]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and "dur" in e and e["ts"] <= first]
    begin = max((e["ts"] for e in steps), default=None)
    if begin is None:
        return out
    top_level = _top_level([e for e in events if e.get("tid") == main_tid
                            and e.get("cat") in HOST_CATS and "dur" in e and begin <= e["ts"]
                            and e["ts"] + e["dur"] <= first
                            and not str(e["name"]).startswith("ProfilerStep#")])
    out.append(f"  host before the first unit (step start to its first mark): "
               f"{(first - begin) / 1e3:.1f} ms, {sum(e['dur'] for e in top_level) / 1e3:.1f} ms "
               "of it in top-level host ops; the longest:")
    for e in sorted(top_level, key=lambda e: -e["dur"])[:top]:
        out.append(f"  {e['dur'] / 1e3:9.1f} ms  {str(e['name'])[:80]}")
    return out


def fixed_part(small: str, large: str, top: int = 12) -> str:
    """What of a step does not grow with its tokens: ``small`` and ``large`` are the same
    point's step profiled at one and at twice the tokens per step (same layout and rank). A
    time t that grows linearly with tokens is t = fixed + per_token x tokens, so its fixed part
    is 2 x t(small) - t(large): per kernel kind, per kernel, and for the step's GPU span (its
    own kernels' first start to last end), compute time and idle time. The kernels queued
    before a trace opened (the previous step's tail) are left out of both."""
    steps = []
    for path in (small, large):
        own, _ = step_kernels(load_events(path))
        span = max(e["ts"] + e["dur"] for e in own) - min(e["ts"] for e in own)
        steps.append((span, compute_busy(own), *kernel_times(own)))
    (span_s, busy_s, kind_s, name_s), (span_l, busy_l, kind_l, name_l) = steps

    def line(label: str, a: float, b: float) -> str:
        return (f"  {a / 1e3:9.1f} {b / 1e3:9.1f} {(2 * a - b) / 1e3:9.1f} {(b - a) / 1e3:9.1f}"
                f"  {label}")

    def by_fixed(a: dict[str, float], b: dict[str, float], magnitude: bool) -> list[str]:
        """The keys of either trace, largest fixed part first (by size where ``magnitude``)."""
        def fixed(k: str) -> float:
            f = 2 * a.get(k, 0.0) - b.get(k, 0.0)
            return abs(f) if magnitude else f
        return sorted(set(a) | set(b), key=lambda k: -fixed(k))

    lines = [f"fixed part (2 x small - large) of {small} against {large}:",
             f"  {'small':>9} {'large':>9} {'fixed':>9} {'grows':>9}  (ms; grows: large - small, "
             "what the small step's tokens cost)",
             line("GPU span of the step's own kernels", span_s, span_l),
             line("compute busy", busy_s, busy_l),
             line("idle (span - compute busy)", span_s - busy_s, span_l - busy_l)]
    lines += [line(f"kind [{k}]", kind_s.get(k, 0.0), kind_l.get(k, 0.0))
              for k in by_fixed(kind_s, kind_l, magnitude=False)]
    lines.append(f"  kernels with the largest fixed parts (a kernel in one trace only: compiled "
                 f"kernels can differ between shapes), top {top}:")
    lines += [line(k, name_s.get(k, 0.0), name_l.get(k, 0.0))
              for k in by_fixed(name_s, name_l, magnitude=True)[:top]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="*")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--fixed-part", nargs=2, metavar=("SMALL", "LARGE"),
                   help="one point's step at one and at twice the tokens: what does not grow")
    args = p.parse_args()
    if not args.traces and not args.fixed_part:
        p.error("give traces to summarize, or --fixed-part SMALL LARGE")
    for path in args.traces:
        print(summarize(path, args.top))
    if args.fixed_part:
        print(fixed_part(*args.fixed_part, top=args.top))


if __name__ == "__main__":
    main()
