"""``TRAIN_FILE=tests.distributed.noncolocated_entry run_train.sh ...``: the omni trainer, with
every step's named losses and gradient norm appended at full precision to
``$OMNI_STEP_FILE`` by global rank 0 (an encoder rank under non-colocated encoders: it logs the
LLM ranks' line, ``torchtitan_omni.encoder_ranks``)."""

from __future__ import annotations

import json
import os

import torch

import torchtitan_omni  # noqa: F401  (device selection first)
from torchtitan.tools.logging import init_logger

from torchtitan_omni.config.manager import OmniConfigManager
from torchtitan_omni.train import OmniTrainer


class StepRecordingTrainer(OmniTrainer):
    def train_step(self, data_iterator) -> None:
        super().train_step(data_iterator)
        path = os.environ.get("OMNI_STEP_FILE")
        if path and torch.distributed.get_rank() == 0 and self.last_losses:
            grad_norm = self.metrics_processor.last_metrics["grad_norm"]
            with open(path, "a") as f:
                f.write(json.dumps({"step": self.step, "grad_norm": grad_norm,
                                    **self.last_losses}) + "\n")


def main() -> None:
    init_logger()
    trainer = StepRecordingTrainer(OmniConfigManager().parse_args())
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
