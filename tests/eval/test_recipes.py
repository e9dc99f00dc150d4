"""The convergence recipes: one per model and size, each a valid config for its layout (the
start-up check, with the model built on the meta device for SP/EP plans) with validation on."""

import pytest

from tests.harness import load_script
from torchtitan_omni.config.manager import parse_job_config

script = load_script("reproduce_convergence")


@pytest.mark.parametrize("model", script.MODELS)
@pytest.mark.parametrize("size,world", [("debug", 2), ("small", 2), ("full", 8)])
def test_recipe_is_valid_with_validation(model, size, world, monkeypatch):
    path = script.recipe_path(model, size)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = parse_job_config(["--job.config_file", path])
    assert cfg.model.name == model and cfg.job.dump_folder.endswith(f"{model}_{size}")
    v = cfg.validation
    assert v.enable and v.split == "val" and cfg.training.steps % v.freq == 0
    assert v.seq_len == cfg.training.seq_len and cfg.metrics.enable_tensorboard
    assert (cfg.model.flavor == "debugmodel") == (size == "debug")
    text = open(path).read()
    assert "Data mix:" in text and f"--model {model} --size {size}" in text
    assert all(len(line) <= 100 for line in text.splitlines())
