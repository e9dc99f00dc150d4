"""``scripts/convert_checkpoint.py`` on LoRA checkpoints: the merged Hugging Face export has no
LoRA tensors, loads in transformers and gives the LoRA model's logits (dense and MoE, experts'
adapters merged per expert); ``--adapter-only`` writes exactly what trained; a LoRA
checkpoint under a config without ``[lora]`` is refused instead of exported unmerged."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.checkpoint.common import CONFIG, job_config, load_convert_script, text_logits
from tests.lora.common import perturb_adapters

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
LORA = ("--lora.enable", "--lora.rank", "4", "--lora.alpha", "12")


def _overrides(flavor: str, *extra: str) -> list[str]:
    return ["--model.flavor", flavor, *LORA, *extra]


def _lora_checkpoint(folder: str, overrides: list[str]):
    """A LoRA model (adapters drawn non-zero) saved as a DCP checkpoint with every tensor."""
    import copy

    import tests.checkpoint.spec as spec
    from torchtitan_omni.checkpoint.hf_export import save_model_checkpoint
    from torchtitan_omni.lora import apply_lora_config

    cfg = job_config(*overrides)
    model = spec.CkptModel(copy.deepcopy(spec.FLAVORS[cfg.model.flavor]))
    apply_lora_config(model, cfg.lora)
    with torch.no_grad():
        model.init_weights()
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms make the comparison sharper
                p.uniform_(0.5, 1.5)
    assert perturb_adapters(model) > 0
    return model, save_model_checkpoint(model, folder)


@pytest.mark.parametrize("flavor", ["llama", "moe"])
def test_merged_export_loads_in_transformers_with_the_lora_logits(tmp_path, flavor):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    convert = load_convert_script()
    overrides = _overrides(flavor)
    model, ckpt = _lora_checkpoint(str(tmp_path / "ckpt"), overrides)
    out = convert.dcp_to_hf(CONFIG, overrides, ckpt, str(tmp_path / "hf"), ["llm"])
    files = [f for f in os.listdir(out["llm"]) if f.endswith(".safetensors")]
    keys = [k for f in files for k in safe_open(os.path.join(out["llm"], f), "pt").keys()]
    assert keys and not [k for k in keys if "lora" in k]
    expected = text_logits(model, None, TOKENS, TOKENS.shape[1])
    hf = AutoModelForCausalLM.from_pretrained(out["llm"]).eval()
    with torch.no_grad():
        logits = hf(TOKENS).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # the adapters matter: without them the logits are elsewhere
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.zero_()
    assert not torch.allclose(text_logits(model, None, TOKENS, TOKENS.shape[1]), expected,
                              rtol=1e-3, atol=1e-3)


def test_adapter_export_holds_exactly_what_trained(tmp_path):
    from safetensors.torch import load_file

    from torchtitan_omni.modules.lora import adapter_names

    convert = load_convert_script()
    overrides = _overrides("moe", "--lora.train_modules", "llm.norm")
    model, ckpt = _lora_checkpoint(str(tmp_path / "ckpt"), overrides)
    path = convert.export_lora_adapter(CONFIG, overrides, ckpt, str(tmp_path / "adapter"))
    tensors = load_file(path)
    expected = adapter_names(model) | {"llm.norm.weight"}
    assert set(tensors) == expected and any("experts.w2_lora_b" in n for n in expected)
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        assert torch.equal(value, params[name].detach()), name
    config = json.load(open(os.path.join(tmp_path, "adapter", "adapter_config.json")))
    assert (config["rank"], config["alpha"], config["trained_in_full"]) == (4, 12.0,
                                                                            ["llm.norm.weight"])
    assert len(config["adapted_modules"]) == 10  # 2 layers x (4 attention + experts)
    base = sum(p.numel() for n, p in params.items() if n not in expected)
    assert sum(t.numel() for t in tensors.values()) < base / 2


def test_lora_checkpoint_under_a_config_without_lora_is_refused(tmp_path):
    convert = load_convert_script()
    _, ckpt = _lora_checkpoint(str(tmp_path / "ckpt"), _overrides("llama"))
    with pytest.raises(ValueError, match="holds LoRA adapters but the config's lora.enable is off"):
        convert.dcp_to_hf(CONFIG, ["--model.flavor", "llama"], ckpt, str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"the LoRA adapter tensors of this config \(llm.layers"):
        convert.dcp_to_hf(CONFIG, _overrides("llama", "--lora.rank", "2"), ckpt,
                          str(tmp_path / "hf2"))


def test_dcp_weights_sources_with_and_without_adapters(tmp_path):
    import copy

    import tests.checkpoint.spec as spec
    from torchtitan_omni.checkpoint.hf_export import save_model_checkpoint
    from torchtitan_omni.checkpoint.weights import load_part_from_dcp
    from torchtitan_omni.errors import CheckpointFormatError
    from torchtitan_omni.lora import apply_lora_config
    from torchtitan_omni.modules.lora import adapter_names

    lora_model, lora_ckpt = _lora_checkpoint(str(tmp_path / "lora"), _overrides("llama"))
    args = spec.FLAVORS["llama"]
    # a LoRA run's checkpoint into a model without LoRA: refused, not loaded unmerged
    plain = spec.CkptModel(copy.deepcopy(args))
    with pytest.raises(CheckpointFormatError, match="holds LoRA adapters, which this model"):
        load_part_from_dcp(plain, "llm", lora_ckpt)
    # ... and into a LoRA model: base and adapters
    other = spec.CkptModel(copy.deepcopy(args))
    apply_lora_config(other, job_config(*_overrides("llama")).lora)
    with torch.no_grad():
        other.init_weights()
    report = load_part_from_dcp(other, "llm", lora_ckpt)
    assert report.kept_init == []
    for (name, p), q in zip(lora_model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    # a base checkpoint into a LoRA model: the base loads, the adapters are left as they are
    with torch.no_grad():
        plain.init_weights()
        for p in plain.parameters():
            p.mul_(1.5)
    base_ckpt = save_model_checkpoint(plain, str(tmp_path / "base"))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    report = load_part_from_dcp(other, "llm", base_ckpt)
    adapters = adapter_names(other)
    assert sorted(f"llm.{n}" for n in report.kept_init) == sorted(adapters)
    base = dict(plain.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, before[name] if name in adapters else base[name]), name
