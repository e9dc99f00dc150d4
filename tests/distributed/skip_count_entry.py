"""``TRAIN_FILE=tests.distributed.skip_count_entry run_train.sh ...``: the omni trainer, where
each rank's data pipeline reports skipped samples of its own (rank ``r``: ``r + 3`` too long,
``7 (r + 1)`` corrupt media, on top of what it really skipped), and each rank appends to
``$OMNI_STEP_FILE`` each line's ``data/skipped_*`` values next to its own counts."""

from __future__ import annotations

import json
import os

import torch

import torchtitan_omni  # noqa: F401  (device selection first)
from tests.checkpoint.train_entry import run
from torchtitan_omni.train import OmniTrainer


class RanksSkipDifferently(OmniTrainer):
    def skipped_sample_counts(self) -> dict[str, int]:
        rank = torch.distributed.get_rank()
        counts = super().skipped_sample_counts()
        counts["too_long"] = counts.get("too_long", 0) + rank + 3
        counts["corrupt_media"] = counts.get("corrupt_media", 0) + 7 * (rank + 1)
        return counts

    def on_line_logged(self, step: int, losses: dict[str, float], metrics: dict) -> None:
        path = os.environ.get("OMNI_STEP_FILE")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({
                    "step": step, "rank": torch.distributed.get_rank(),
                    "line": {k: v for k, v in metrics.items() if k.startswith("data/skipped_")},
                    "own": self.skipped_sample_counts()}) + "\n")


if __name__ == "__main__":
    run(RanksSkipDifferently)
