"""``TRAIN_FILE=tests.distributed.noncolocated_entry run_train.sh ...``: the omni trainer, with
every step's named losses and gradient norm appended at full precision to
``$OMNI_STEP_FILE`` by global rank 0 (an encoder rank under non-colocated encoders: it logs the
LLM ranks' line, ``torchtitan_omni.encoder_ranks``, and adds the order its ``EncoderServer``
ran the step's micro-batches in, ``events``), and every validation's metrics to
``$OMNI_VALIDATION_FILE`` (with the forwards an encoder rank served, ``served``)."""

from __future__ import annotations

import json
import os

import torch

import torchtitan_omni  # noqa: F401  (device selection first)
from tests.checkpoint.train_entry import run
from torchtitan_omni.train import OmniTrainer


def _append(variable: str, record: dict) -> None:
    path = os.environ.get(variable)
    if path and torch.distributed.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class RecordingValidator:
    """The trainer's validator, recording each validation's metrics (rank 0)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def should_validate(self, step: int) -> bool:
        return self.inner.should_validate(step)

    def validate(self, model_parts, step: int) -> dict[str, float]:
        metrics = self.inner.validate(model_parts, step)
        served = getattr(self.inner, "last_served", None)
        _append("OMNI_VALIDATION_FILE", {"step": step, "served": served, **{
            k: v for k, v in metrics.items() if not k.endswith("time(s)")}})
        return metrics


class StepRecordingTrainer(OmniTrainer):
    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        if job_config.validation.enable:
            self.validator = RecordingValidator(self.validator)

    def on_line_logged(self, step: int, losses: dict[str, float], metrics: dict) -> None:
        # the balanced encoders' imbalance before and after (their last pass of the step)
        balance = {k: v for k, v in metrics.items()
                   if k.startswith("encoders/") and "/cost_max_over_mean_" in k}
        record = {"step": step, "grad_norm": metrics["grad_norm"], **losses,
                  **({"balance": balance} if balance else {})}
        if self.encoder_server is not None:  # its lines come at once: the events are this step's
            record["events"] = list(self.encoder_server.events)
        _append("OMNI_STEP_FILE", record)


def main() -> None:
    run(StepRecordingTrainer)


if __name__ == "__main__":
    main()
