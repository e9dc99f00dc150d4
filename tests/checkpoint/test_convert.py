"""``scripts/convert_checkpoint.py``: DCP -> HF -> DCP gives the saved tensors back bit for bit;
the exported LLM loads in transformers (Llama, and Qwen3-MoE with experts split per expert) and
gives our model's logits; the command line writes sharded, cast folders; bad input gets one
line.

The DCP checkpoints are the session's 4-rank training saves; the 2-rank run exports them
(rank 0) and imports the exports on 2 ranks (``workers.run_two``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.common import (
    CONFIG, dcp_tensors, load_convert_script, plain_model, resolve, text_logits,
)
from tests.checkpoint.workers import HAS_EP
from tests.harness import REPO

FLAVORS = ("llama", "moe") if HAS_EP else ("llama",)
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_dcp_hf_dcp_round_trip_is_exact(two_ranks, checkpoint_folders, flavor):
    before = {k: v for k, v in dcp_tensors(resolve(checkpoint_folders[flavor])).items()
              if k.startswith("llm.")}
    imported = two_ranks[0]["imported"][flavor]
    after = dcp_tensors(imported)
    assert before.keys() == after.keys() and len(before) > 10
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    manifest = json.load(open(os.path.join(imported, "omni_manifest.json")))
    assert (
        manifest["model_only"] and manifest["step"] == 0 and manifest["layout"]["world_size"] == 2
    )


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_exported_llm_loads_in_transformers_with_our_logits(two_ranks, checkpoint_folders, flavor):
    from transformers import AutoModelForCausalLM

    from torchtitan_omni.checkpoint.weights import load_initial_weights

    ours = plain_model(flavor)
    load_initial_weights(ours, [f"llm={checkpoint_folders[flavor]}"])  # a DCP source
    expected = text_logits(ours, None, TOKENS, TOKENS.shape[1])
    hf = AutoModelForCausalLM.from_pretrained(two_ranks[0]["exported"][flavor]).eval()
    with torch.no_grad():
        logits = hf(TOKENS).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
def test_command_line_writes_sharded_cast_folders(two_ranks, checkpoint_folders, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    proc = subprocess.run(
        [sys.executable, "scripts/convert_checkpoint.py", "dcp-to-hf", "--config", CONFIG,
         "--checkpoint", checkpoint_folders["llama"], "--out", str(out), "--parts", "llm",
         "--dtype", "bfloat16", "--max-shard-size", "20KB"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    llm = out / "llm"
    index = json.load(open(llm / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    assert json.load(open(llm / "config.json"))["torch_dtype"] == "bfloat16"
    exported = {}
    for name in set(index["weight_map"].values()):
        exported.update(load_file(llm / name))
    reference = load_file(os.path.join(two_ranks[0]["exported"]["llama"], "model.safetensors"))
    assert reference.keys() == exported.keys()
    for key, value in reference.items():
        assert exported[key].dtype == torch.bfloat16
        assert torch.equal(exported[key], value.to(torch.bfloat16)), key


def test_bad_input_is_one_message(capsys, tmp_path):
    convert = load_convert_script()
    with pytest.raises(SystemExit) as info:
        convert.main(["dcp-to-hf", "--config", CONFIG, "--checkpoint", str(tmp_path / "nothing"),
                      "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "no complete DCP checkpoint" in err and "nothing" in err, err


@pytest.mark.parametrize("spec", ["llama_omni", "janus", "qwen3_omni"])
def test_every_part_of_a_zoo_model_round_trips(spec, tmp_path):
    """Every part of a zoo model (LLM, vision, audio, image generation) through its adapter:
    DCP -> one HF folder per part -> ``weights.sources`` into a differently seeded model gives
    back every tensor (tensors without an HF name travel in the extra file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from torchtitan_omni.config.manager import parse_config

    from torchtitan_omni.job_model import model_on_meta
    from torchtitan_omni.checkpoint.parts import state_tensors
    from torchtitan_omni.checkpoint.weights import load_initial_weights

    config = str(REPO / "train_configs" / f"{spec}_debug.toml")
    overrides = ["--model.hf_assets_path", str(REPO / "tests/assets/tokenizer")]
    cfg = parse_config(config, overrides)

    def model(seed):
        m = model_on_meta(cfg)
        m.to_empty(device="cpu")
        m.init_seed = seed
        with torch.no_grad():
            m.init_weights()
        return m

    original = model(1)
    dcp.save(get_model_state_dict(original), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    parts = load_convert_script().dcp_to_hf(
        config, overrides, str(tmp_path / "dcp"), str(tmp_path / "hf")
    )
    assert "llm" in parts and any(p.startswith("encoders.") for p in parts)
    other = model(2)
    load_initial_weights(other, [f"{p}={folder}" for p, folder in parts.items()])
    expected, loaded = state_tensors(original), state_tensors(other)
    covered = [n for n in expected if any(n.startswith(p + ".") for p in parts)]
    assert len(covered) == len(expected), sorted(set(expected) - set(covered))[:5]
    for name in covered:
        assert torch.equal(expected[name], loaded[name]), name
    # Without the extra file (a genuine HF folder), init_only tensors keep their init, named.
    from torchtitan_omni.checkpoint.safetensors_folder import EXTRA_FILE

    extras = [p for p, folder in parts.items() if os.path.exists(os.path.join(folder, EXTRA_FILE))]
    if spec in ("llama_omni", "qwen3_omni"):
        assert extras == ["encoders.audio"]  # the Whisper-format projector
    for part in extras:
        os.remove(os.path.join(parts[part], EXTRA_FILE))
        third = model(3)
        before = {k: v.clone() for k, v in state_tensors(third).items()}
        (report,) = load_initial_weights(third, [f"{part}={parts[part]}"])
        assert report.kept_init, part
        after = state_tensors(third)
        for name in report.kept_init:
            assert torch.equal(after[f"{part}.{name}"], before[f"{part}.{name}"]), name
        loaded_names = [n for n in after if n.startswith(part + ".")
                        and n[len(part) + 1:] not in report.kept_init]
        assert loaded_names and all(torch.equal(after[n], expected[n]) for n in loaded_names)
