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

    python3 scripts/summarize_pyspy.py OUT_DIR/pyspy_native.txt [--top 15]
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


def summarize(stacks: list[tuple[list[str], int]], top: int = 15) -> list[str]:
    """The per-thread table, then each busy thread's innermost and inclusive Python
    frames."""
    samples, blocked, in_encoder = Counter(), Counter(), Counter()
    innermost: dict[str, Counter] = {}
    inclusive: dict[str, Counter] = {}
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
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output (with --threads)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    with open(args.raw) as f:
        stacks = read_raw(f)
    print(f"{args.raw}: " + "\n".join(summarize(stacks, args.top)))


if __name__ == "__main__":
    main()
