"""``TRAIN_FILE=tests.checkpoint.train_entry run_train.sh ...``: the omni trainer, with every
step's named losses appended at full precision to ``$OMNI_LOSS_FILE`` by rank 0 (the console
prints 5 decimals; the resume tests compare exactly)."""

from __future__ import annotations

import json
import os

import torch

import torchtitan_omni  # noqa: F401  (device selection first)

from torchtitan_omni.train import OmniTrainer, run_cli


class LossRecordingTrainer(OmniTrainer):
    def on_line_logged(self, step: int, losses: dict[str, float], metrics: dict) -> None:
        path = os.environ.get("OMNI_LOSS_FILE")
        if path and torch.distributed.get_rank() == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, **losses}) + "\n")


def run(trainer_cls: type[OmniTrainer]) -> None:
    """Train with ``trainer_cls`` on the launcher's arguments, as ``torchtitan_omni.train``."""
    run_cli(trainer_cls)


def main() -> None:
    run(LossRecordingTrainer)


if __name__ == "__main__":
    main()
