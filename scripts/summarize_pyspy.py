"""Where a py-spy sample of a training rank spends its time, thread by thread.

Reads py-spy's raw (collapsed) output, one stack per line, ``frame;frame;...;frame count``, the
first frame naming the thread (``--threads``), as ``scripts/pyspy_rank0.sh`` records it. For
each thread: its samples (py-spy counts only a thread's busy samples unless ``--idle``), how
many of them sat in a kernel launch that waited for room in the GPU's full launch queue
(``sched_yield`` under ``cuLaunchKernel``: only native samples show it; docs/performance.md,
"Launch queues"), how many were inside an encoder's code (by their Python frames, which a
backward's autograd nodes do not have), the innermost Python frames (where the Python
time goes) and the inclusive ones (the samples with a frame anywhere on their stack, counted
once each: what a region costs with everything it calls, as a profiler's cumulative column). A
sample with over 10% of its samples in inductor's compiling is flagged: the rank had not
reached steady state.

Then the busiest threads' time by region (:data:`REGIONS`: the compiled graphs' generated
code, FSDP's hooks, the optimizer, the loss head, ...): the samples with a frame of the region
anywhere on their stack, so regions overlap (the optimizer's compiled update counts in both)
and do not add up to the thread. With the sampling rate and window (``--rate``, ``--seconds``,
as ``pyspy_rank0.sh`` records: 100 Hz for the Python sample, 40 Hz for the native one) and the
job's mean step (``--step-ms``; from the log of steps taken without the sampler, which pauses
the process for each native sample), each region also gets its host milliseconds per step: its
share of the sampling instants times the step.

    python3 scripts/summarize_pyspy.py OUT_DIR/pyspy_py.txt [--top 15] [--seconds 10 --step-ms 190]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

#: a Python frame as py-spy prints it: ``function (path/file.py:line)``
PYTHON_FRAME = re.compile(r"^(?P<function>.+) \((?P<file>[^()]+\.py|<frozen [^>]+>):\d+\)$")
#: native frames of a kernel launch, and of a launch waiting for room in the queue
LAUNCH_FRAME = re.compile(r"cuLaunchKernel|cudaLaunchKernel")
YIELD_FRAME = re.compile(r"^sched_yield\b")
#: the encoders' own code (torchtitan_omni/encoders/)
ENCODER_FILE = re.compile(r"torchtitan_omni/encoders/")
#: inductor compiling: its compile workers' threads and code (idle in steady state, where
#: py-spy records none of their samples)
COMPILE_THREAD = re.compile(r"^(InductorSubproc|subproc_worker_timer) ")
COMPILE_FILE = re.compile(r"torch/_inductor/(compile_worker|async_compile)")
#: the share of samples in inductor's compiling above which a sample is not steady state
COMPILING_SHARE = 0.1
#: regions of a training step's host time, each a pattern any frame of a sample may match
#: (Python frames by file or function, native ones by symbol)
REGIONS = (
    ("compiled graphs' generated code", re.compile(r"[(/][a-z0-9]{40,}\.py:\d+\)$")),
    ("AOT autograd's runtime wrappers", re.compile(r"torch/_functorch/_aot_autograd/")),
    ("FSDP's hooks", re.compile(r"torch/distributed/fsdp/")),
    ("collectives (c10d)", re.compile(r"distributed_c10d\.py|_functional_collectives\.py|"
                                      r"^c10d::")),
    ("kernel launches (driver)", LAUNCH_FRAME),
    ("optimizer (step, zero_grad, LR)",
     re.compile(r"torch/optim/|torchtitan_omni/components/(optimizer|adam_update)\.py")),
    ("gradient clipping", re.compile(r"^(clip_grad\w*|_norm_and_clip\w*) \(")),
    ("loss head", re.compile(r"torchtitan_omni/modules/linear_cross_entropy\.py")),
    ("garbage collection", re.compile(r"^GarbageCollection\.\w+ \(")),
    ("data loading", re.compile(r"torch/utils/data/")),
)


def read_raw(lines) -> list[tuple[list[str], int]]:
    """(frames, samples) of each line of py-spy's raw output (blank lines skipped)."""
    stacks = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {number} is not py-spy's raw format (stack;...;frame count): "
                             f"{line[:80]!r}")
        stacks.append((stack.split(";"), int(count)))
    return stacks


def thread_name(frame: str) -> str:
    """``thread (123): MainThread`` -> ``MainThread (123)``; ``thread (123)`` -> ``thread 123``."""
    match = re.match(r"^thread \((\d+)\)(?:: (.+))?$", frame)
    if not match:
        return frame
    tid, name = match.groups()
    return f"{name} ({tid})" if name else f"thread {tid}"


def python_frame(frame: str) -> str | None:
    """``function (file)`` of a Python frame, else None (native frames, the thread's name)."""
    match = PYTHON_FRAME.match(frame)
    return f"{match['function']} ({match['file']})" if match else None


def summarize(stacks: list[tuple[list[str], int]], top: int = 15,
              instants: float | None = None, step_ms: float | None = None) -> list[str]:
    """The per-thread table, then each busy thread's innermost and inclusive Python
    frames, then the two busiest threads' :data:`REGIONS`; in milliseconds per step too when
    the sampling ``instants`` (rate times seconds) and the mean ``step_ms`` are given."""
    samples, blocked, in_encoder = Counter(), Counter(), Counter()
    innermost: dict[str, Counter] = {}
    inclusive: dict[str, Counter] = {}
    regions: dict[str, Counter] = {}
    compiling = 0
    for frames, n in stacks:
        thread = thread_name(frames[0])
        samples[thread] += n
        body = frames[1:]
        if COMPILE_THREAD.match(thread) or any(COMPILE_FILE.search(f) for f in body):
            compiling += n
        if any(LAUNCH_FRAME.search(f) for f in body) and any(YIELD_FRAME.match(f) for f in body):
            blocked[thread] += n
        if any(ENCODER_FILE.search(f) for f in body):
            in_encoder[thread] += n
        for region, pattern in REGIONS:
            if any(pattern.search(f) for f in body):
                regions.setdefault(thread, Counter())[region] += n
        python = [p for p in map(python_frame, body) if p]
        if python:
            innermost.setdefault(thread, Counter())[python[-1]] += n
            # each frame once a sample (recursion), outer frames first among equal counts
            inclusive.setdefault(thread, Counter()).update(dict.fromkeys(python, n))
    total = sum(samples.values())
    out = [f"{total} samples",
           f"  {'thread':34s} {'samples':>8s} {'share':>6s} {'blocked in launch queue':>24s} "
           f"{'in an encoder':>14s}"]
    for thread, n in samples.most_common():
        out.append(f"  {thread[:34]:34s} {n:8d} {100 * n / total:5.1f}% "
                   f"{blocked[thread]:10d} ({100 * blocked[thread] / n:5.1f}%) "
                   f"{in_encoder[thread]:14d}")
    if total and compiling > COMPILING_SHARE * total:
        out.append(f"  warning: {100 * compiling / total:.0f}% of the samples are inductor "
                   "compiling (its compile workers): the rank was still compiling, not in "
                   "steady state; sample after a later step (pyspy_rank0.sh's TRAIN_LOG and "
                   "AFTER_STEP)")
    for thread, _ in samples.most_common(3):
        if thread not in innermost:
            continue
        out.append(f"  innermost Python frames, {thread}:")
        for frame, count in innermost[thread].most_common(top):
            out.append(f"  {count:8d}  {frame[:110]}")
        out.append(f"  inclusive Python frames (anywhere on the stack), {thread}:")
        for frame, count in inclusive[thread].most_common(top):
            out.append(f"  {count:8d}  {100 * count / samples[thread]:5.1f}%  {frame[:100]}")
    per_step = instants is not None and step_ms is not None
    for thread, n in samples.most_common(2):
        out.append(f"  regions, {thread} (a sample counts in each region on its stack)"
                   + (f"; ms a step of {step_ms:g} ms:" if per_step else ":"))
        if per_step:
            out.append(f"  {'the thread, busy':34s} {n:8d} {100:5.1f}% "
                       f"{n / instants * step_ms:8.1f}")
        for region, _ in REGIONS:
            count = regions.get(thread, Counter())[region]
            line = f"  {region:34s} {count:8d} {100 * count / n:5.1f}%"
            out.append(line + (f" {count / instants * step_ms:8.1f}" if per_step else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output (with --threads)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--rate", type=float, default=100.0,
                   help="samples a second py-spy took (pyspy_rank0.sh: 100 Python, 40 native)")
    p.add_argument("--seconds", type=float, help="the sampling window, seconds")
    p.add_argument("--step-ms", type=float, help="the job's mean step without the sampler, ms")
    args = p.parse_args()
    if (args.seconds is None) != (args.step_ms is None):
        p.error("--seconds and --step-ms go together (a region's ms a step needs both)")
    with open(args.raw) as f:
        stacks = read_raw(f)
    instants = None if args.seconds is None else args.rate * args.seconds
    print(f"{args.raw}: " + "\n".join(summarize(stacks, args.top, instants, args.step_ms)))


if __name__ == "__main__":
    main()
