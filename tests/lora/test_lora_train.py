"""LoRA through ``run_train.sh`` (CPU, one process each):

- run A trains the checkpoint tests' tiny Llama with LoRA on top of a transformers Llama
  (``weights.sources``), saving adapter-only checkpoints at steps 3 and 6; a resume from step
  3 loads the base from ``weights.sources`` again and the adapters and optimizer from the
  checkpoint, and reproduces A's losses of steps 4-6 and its step-6 checkpoint exactly;
- A's adapter-only checkpoint exports merged (base from ``weights.sources``) to a folder that
  transformers loads with the logits of the LoRA model as generation loads it
  (``load_job_weights``: the base from ``weights.sources``, the adapters from the checkpoint);
- a debug model trains with ``--lora.enable`` from its TOML and its loss goes down.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.checkpoint.common import (
    CONFIG, dcp_tensors, job_config, load_convert_script, text_logits, tiny_hf_llama,
)
from tests.harness import REPO, run_train

pytestmark = pytest.mark.slow
DETERMINISTIC = ("--debug.deterministic", "--debug.seed", "42")
LORA = ("--lora.enable", "--lora.rank", "4", "--lora.save_adapter_only")


def _train(folder: str, *overrides: str) -> tuple[dict[int, float], str]:
    losses = os.path.join(folder, "losses.jsonl")
    run = run_train(CONFIG, 1, "--job.dump_folder", folder, *DETERMINISTIC, *overrides,
                    env={"TRAIN_FILE": "tests.checkpoint.train_entry", "OMNI_LOSS_FILE": losses})
    assert run.returncode == 0, run.output[-4000:]
    with open(losses) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["text"] for r in records}, run.output


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lora_a"))
    hf = str(tmp_path_factory.mktemp("lora_base"))
    tiny_hf_llama(hf)
    overrides = (*LORA, "--weights.sources", f"llm={hf}")
    losses, output = _train(folder, *overrides)
    assert "LoRA on 14 modules" in output and f"Loaded llm from Hugging Face {hf}" in output
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return folder, losses, overrides


def test_adapter_only_checkpoints_resume_exactly(run_a, tmp_path):
    import tests.checkpoint.spec as spec
    from torchtitan_omni.lora import apply_lora_config
    from torchtitan_omni.modules.lora import adapter_names

    src, losses_a, overrides = run_a
    step3, step6 = (os.path.join(src, "checkpoint", f"step-{s}") for s in (3, 6))
    saved = dcp_tensors(step6)
    manifest = json.load(open(os.path.join(step6, "omni_manifest.json")))
    assert manifest["adapter_only"] and manifest["lora"]["rank"] == 4
    model = spec.CkptModel(spec.FLAVORS["llama"])
    apply_lora_config(model, job_config(*overrides).lora)
    adapters = adapter_names(model)
    model_keys = {k for k in saved if k.startswith("llm.")}
    assert model_keys == adapters, sorted(model_keys ^ adapters)[:5]
    assert {k.split(".", 2)[2].rsplit(".", 1)[0] for k in saved if k.startswith("optimizer.state.")
            } == adapters
    os.makedirs(os.path.join(tmp_path, "checkpoint"))
    shutil.copytree(step3, os.path.join(tmp_path, "checkpoint", "step-3"))
    losses_b, output = _train(str(tmp_path), *overrides)
    assert "holds only what LoRA trains: the base weights come from weights.sources" in output
    assert "Loaded llm from Hugging Face" in output
    assert sorted(losses_b) == [4, 5, 6]
    assert [losses_b[s] for s in (4, 5, 6)] == [losses_a[s] for s in (4, 5, 6)]
    resumed = dcp_tensors(os.path.join(tmp_path, "checkpoint", "step-6"))
    assert resumed.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(value, resumed[key]), key


def test_adapter_only_checkpoint_exports_merged_with_the_lora_logits(run_a, tmp_path):
    from transformers import AutoModelForCausalLM

    import tests.checkpoint.spec as spec
    from torchtitan_omni.checkpoint.weights import load_job_weights
    from torchtitan_omni.lora import apply_lora_config
    from torchtitan_omni.modules.lora import adapter_names

    src, _, overrides = run_a
    step6 = os.path.join(src, "checkpoint", "step-6")
    convert = load_convert_script()
    out = convert.dcp_to_hf(CONFIG, list(overrides), step6, str(tmp_path / "hf"), ["llm"])
    # the LoRA model as generation loads it: base from weights.sources, adapters from step 6
    cfg = job_config(*overrides)
    model = spec.CkptModel(spec.FLAVORS["llama"])
    apply_lora_config(model, cfg.lora)
    with torch.no_grad():
        model.init_weights()
    load_job_weights(model, step6, list(cfg.weights.sources))
    saved = dcp_tensors(step6)
    for name, p in model.named_parameters():
        if name in adapter_names(model):
            assert torch.equal(p.detach(), saved[name]), name
    assert any(float(saved[n].abs().sum()) > 0 for n in adapter_names(model) if "lora_b" in n)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    expected = text_logits(model, None, tokens, tokens.shape[1])
    hf = AutoModelForCausalLM.from_pretrained(out["llm"]).eval()
    with torch.no_grad():
        logits = hf(tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_debug_model_trains_with_lora_from_its_toml(tmp_path):
    config = REPO / "train_configs" / "qwen3_moe_omni_debug.toml"
    run = run_train(config, 1, "--job.dump_folder", str(tmp_path), "--lora.enable",
                    "--training.steps", "10", "--optimizer.lr", "2e-2",
                    "--lr_scheduler.warmup_steps", "2", *DETERMINISTIC)
    assert run.returncode == 0, run.output[-4000:]
    assert "LoRA on 10 modules" in run.output, run.output[-3000:]
    losses = run.loss_list()
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
