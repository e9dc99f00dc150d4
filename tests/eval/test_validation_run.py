"""Validation through ``run_train.sh``: llama_omni debug on 2 CPU processes with Ulysses SP2,
4 steps, ``validation.freq = 2``, ``validation.steps = 2``, TensorBoard on, checkpoints at
steps 2 and 4 (one such run, ``run_a``, is what every test checks or continues).

- validation runs at steps 2 and 4 only and logs the total, every named loss and every
  document mix, on the console and in TensorBoard;
- (slow) a run resumed from the step-2 checkpoint validates at step 4 exactly as the
  uninterrupted run did, and trains the same losses;
- (slow) the same run without validation trains exactly the same losses: validation neither
  moves the training data nor changes the model;
- (slow) ``scripts/eval_metrics.py`` scores the saved checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import REPO, run_train
from torchtitan_omni.eval.curves import read_scalars

CONFIG = "train_configs/llama_omni_debug.toml"
COMMON = ("--training.steps", "4", "--parallelism.ulysses_degree", "2",
          "--debug.deterministic", "--debug.seed", "42", "--metrics.enable_tensorboard",
          "--lr_scheduler.warmup_steps", "2")
VALIDATION = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
              "--validation.seq_len", "256", "--validation.local_batch_size", "2")
# 4 rows: every modality occurs before the step-2 checkpoint (a part without any gradient yet
# has no optimizer state to save, and resuming would refuse that)
CHECKPOINT = ("--checkpoint.enable", "--checkpoint.interval", "2",
              "--training.local_batch_size", "4")


def _run(folder, *extra):
    run = run_train(CONFIG, 2, "--job.dump_folder", str(folder), *COMMON, *extra, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Validation on, checkpoints at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("validation_a")
    run = _run(folder, *VALIDATION, *CHECKPOINT)
    return folder, run, read_scalars(str(folder))


@pytest.mark.slow
def test_validation_at_freq_with_every_loss(run_a):
    _, run, scalars = run_a
    lines = [line for line in run.output.splitlines() if "validate step:" in line]
    assert [line.split("validate step:")[1].split()[0] for line in lines] == ["2", "4"]
    assert all("text:" in line and "gen_image:" in line and "by mix:" in line for line in lines)
    for tag in ("validation/loss", "validation/loss/text", "validation/loss/gen_image",
                "validation/mix/text_only", "validation/batches"):
        assert sorted(scalars[tag]) == [2, 4], (tag, scalars.get(tag))
    assert scalars["validation/batches"] == {2: 2.0, 4: 2.0}
    total = scalars["validation/loss"][4]
    parts = scalars["validation/loss/text"][4] + scalars["validation/loss/gen_image"][4]
    assert abs(total - parts) <= 1e-5 * total
    assert any(t.startswith("validation/mix/") and t != "validation/mix/text_only" for t in scalars)


@pytest.mark.slow
def test_resume_validates_as_the_uninterrupted_run(run_a, tmp_path):
    folder_a, _, scalars_a = run_a
    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(folder_a / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    run = _run(tmp_path, *VALIDATION, *CHECKPOINT)
    assert "step-2" in run.output
    scalars_b = read_scalars(str(tmp_path))
    assert sorted(scalars_b["validation/loss"]) == [4]
    for tag in ("validation/loss", "validation/loss/text", "validation/loss/gen_image"):
        assert scalars_b[tag][4] == pytest.approx(scalars_a[tag][4], rel=1e-6), tag
    for step in (3, 4):
        assert scalars_b["loss_metrics/global_avg_loss"][step] == pytest.approx(
            scalars_a["loss_metrics/global_avg_loss"][step], rel=1e-6)


@pytest.mark.slow
def test_validation_does_not_change_training(run_a, tmp_path):
    _, _, scalars_a = run_a
    _run(tmp_path, *CHECKPOINT)  # run_a without validation
    scalars_c = read_scalars(str(tmp_path))
    assert not any(t.startswith("validation/") for t in scalars_c)
    assert scalars_c["loss_metrics/global_avg_loss"] == scalars_a["loss_metrics/global_avg_loss"]


@pytest.mark.slow
def test_eval_metrics_script_on_the_checkpoint(run_a, tmp_path):
    folder_a, _, _ = run_a
    proc = subprocess.run(
        [sys.executable, "scripts/eval_metrics.py", "--job.config_file", CONFIG,
         "--job.dump_folder", str(folder_a), "--limit", "1", "--max-new-tokens", "4",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TORCHTITAN_OMNI_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("image_answer_accuracy", "video_answer_accuracy", "audio_answer_accuracy",
                "speech_token_accuracy", "gen_image_code_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["text_perplexity"] > 1.0
    assert (tmp_path / "samples.png").stat().st_size > 0
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 5
