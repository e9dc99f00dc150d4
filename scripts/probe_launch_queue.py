"""How many kernel launches the host can queue behind a busy GPU before a launch blocks.

The GPU is kept busy by one long-running kernel; the host then launches tiny kernels one by one
and times each launch. The first launch that takes much longer than the others is the one that
found the queue full: the host can run at most that many kernels ahead of the GPU. Compare the
driver's default with ``CUDA_SCALE_LAUNCH_QUEUES=4x`` (what ``run_train.sh`` sets;
docs/performance.md, "Launch queues")::

    python3 scripts/probe_launch_queue.py
    CUDA_SCALE_LAUNCH_QUEUES=4x python3 scripts/probe_launch_queue.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def launches_before_blocking(latencies_s: list[float], threshold_s: float) -> int | None:
    """Index of the first launch slower than ``threshold_s`` (the launches before it went
    straight into the queue), or None when none was."""
    return next((i for i, t in enumerate(latencies_s) if t > threshold_s), None)


def probe(launches: int, busy_cycles: int) -> list[float]:
    """Each launch's host time while the GPU runs a ``busy_cycles`` spin kernel."""
    x = torch.zeros(1, device="cuda")
    x.add_(1)  # load the kernel before timing
    torch.cuda.synchronize()
    # torch's own spin kernel (used by its stream tests): busy for a known number of cycles
    torch.cuda._sleep(busy_cycles)  # noqa: SLF001
    latencies = []
    last = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
        now = time.perf_counter()
        latencies.append(now - last)
        last = now
    torch.cuda.synchronize()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--busy-cycles", type=int, default=3_000_000_000,
                        help="GPU clock cycles the spin kernel runs (about 1.5 s on an H100)")
    parser.add_argument("--threshold-us", type=float, default=200.0,
                        help="a launch slower than this found the queue full")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_launch_queue: needs a CUDA GPU (none is visible)")
    setting = os.environ.get("CUDA_SCALE_LAUNCH_QUEUES") or "driver default"
    probe(100, args.busy_cycles // 10)  # warm-up: the first timed pass otherwise blocks at once
    latencies = probe(args.launches, args.busy_cycles)
    blocked = launches_before_blocking(latencies, args.threshold_us * 1e-6)
    if blocked is None:
        print(f"CUDA_SCALE_LAUNCH_QUEUES={setting}: none of {args.launches} launches blocked "
              "(raise --busy-cycles or --launches)")
    else:
        print(f"CUDA_SCALE_LAUNCH_QUEUES={setting}: {blocked} launches queued, "
              f"launch {blocked + 1} blocked")


if __name__ == "__main__":
    main()
