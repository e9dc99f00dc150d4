"""Where a training step makes the host wait for the GPU: a diagnostic, not a benchmark.

Runs the trainer (the same arguments as ``run_train.sh`` / ``python -m torchtitan_omni.train``,
one process per GPU) with ``torch.cuda.set_sync_debug_mode("warn")`` from step ``--from-step``
on, and prints each place in torchtitan-omni or TorchTitan code whose call waited for the
device, with how often it did per step. A wait empties the GPU's queue: whatever the host
launches next runs with the GPU idle until the queue fills again, which is what costs time
in launch-bound phases such as the encoders (``docs/performance.md``, "Host syncs").

    PYTHONPATH=$PWD python3 scripts/list_host_syncs.py --from-step 4 -- \\
        --job.config_file train_configs/llama_omni_debug.toml --training.steps 8
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings

import torch

from torchtitan.tools.logging import init_logger

from torchtitan_omni.train import OmniTrainer, parse_job_config_or_exit

OURS = ("torchtitan_omni", os.sep + "torchtitan" + os.sep, "scripts" + os.sep)


def call_site(depth: int = 3) -> str:
    """The innermost ``depth`` frames of this project's or TorchTitan's code on the stack."""
    frames = [f for f in traceback.extract_stack()[:-2] if any(o in f.filename for o in OURS)
              and not f.filename.endswith("list_host_syncs.py")]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(frames[-depth:]))


class SyncListingTrainer(OmniTrainer):
    """The trainer, counting the host waits of every step from ``from_step`` on."""

    from_step = 4
    sites: collections.Counter = collections.Counter()
    steps_seen = 0

    def train_step(self, data_iterator):
        if self.step == self.from_step:
            torch.cuda.set_sync_debug_mode("warn")
        if self.step >= self.from_step:
            type(self).steps_seen += 1
        return super().train_step(data_iterator)


def record(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` that counts sync warnings by call site, shows the others."""
    if "synchronizing" in str(message):
        SyncListingTrainer.sites[call_site()] += 1
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def report(sites: collections.Counter, steps: int) -> str:
    """A markdown table of the sites, most frequent first."""
    lines = [f"host waits over {steps} steps (rank {os.environ.get('RANK', '0')})", "",
             "| per step | call site (innermost first) |", "| --- | --- |"]
    for site, n in sites.most_common():
        lines.append(f"| {n / max(steps, 1):.1f} | {site or '(outside project code)'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-step", type=int, default=4,
                        help="first step counted (earlier ones compile and warm up)")
    args, train_args = parser.parse_known_args()
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if not torch.cuda.is_available():
        sys.exit("list_host_syncs.py: needs a CUDA GPU (the sync debug mode is CUDA's)")
    init_logger()
    SyncListingTrainer.from_step = args.from_step
    warnings.simplefilter("always")
    warnings.showwarning = record
    trainer = SyncListingTrainer(parse_job_config_or_exit(train_args))
    try:
        trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
        print(report(SyncListingTrainer.sites, SyncListingTrainer.steps_seen), flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
