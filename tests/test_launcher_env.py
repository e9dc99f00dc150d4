"""``run_train.sh`` gives the ranks its environment defaults (the CUDA driver's launch-queue
size, the allocator's expandable segments) and keeps a user's own values."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import run_train

CONFIG = "train_configs/llama_omni_debug.toml"


def _rank_environment(tmp_path, **env: str) -> dict:
    out = tmp_path / "env.json"
    run = run_train(CONFIG, 1, env={"TRAIN_FILE": "tests.launcher_env_entry",
                                     "OMNI_ENV_FILE": str(out), **env})
    assert run.returncode == 0, run.output[-3000:]
    return json.loads(out.read_text())


@pytest.fixture
def without_launcher_defaults(monkeypatch):
    for name in ("CUDA_SCALE_LAUNCH_QUEUES", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_launcher_defaults_reach_the_ranks(tmp_path, without_launcher_defaults):
    assert "CUDA_SCALE_LAUNCH_QUEUES" not in os.environ
    env = _rank_environment(tmp_path)
    assert env == {"CUDA_SCALE_LAUNCH_QUEUES": "4x",
                   "PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def test_user_values_are_kept(tmp_path, without_launcher_defaults):
    env = _rank_environment(tmp_path, CUDA_SCALE_LAUNCH_QUEUES="2x",
                            PYTORCH_ALLOC_CONF="expandable_segments:False")
    assert env == {"CUDA_SCALE_LAUNCH_QUEUES": "2x",
                   "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
