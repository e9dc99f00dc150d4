"""``TRAIN_FILE=tests.distributed.compile_count_entry run_train.sh ...``: the omni trainer, where
rank 1 alone compiles five extra graphs in its first step, and each rank appends to
``$OMNI_STEP_FILE`` each line's compiled-graph count next to its own."""

from __future__ import annotations

import json
import os

import torch

import torchtitan_omni  # noqa: F401  (device selection first)
from tests.checkpoint.train_entry import run
from torchtitan_omni.compat import compiled_graph_count
from torchtitan_omni.train import OmniTrainer

EXTRA_GRAPHS = 5


class Rank1CompilesMore(OmniTrainer):
    def train_step(self, data_iterator) -> None:
        if self.step == 1 and torch.distributed.get_rank() == 1:
            double = torch.compile(lambda x: x * 2, backend="eager")
            for rank in range(1, EXTRA_GRAPHS + 1):  # a new tensor rank: a new graph each
                double(torch.ones((1,) * rank))
        super().train_step(data_iterator)

    def on_line_logged(self, step: int, losses: dict[str, float], metrics: dict) -> None:
        path = os.environ.get("OMNI_STEP_FILE")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "rank": torch.distributed.get_rank(),
                                    "line": metrics.get("compile/graphs"),
                                    "own": compiled_graph_count()}) + "\n")


if __name__ == "__main__":
    run(Rank1CompilesMore)
