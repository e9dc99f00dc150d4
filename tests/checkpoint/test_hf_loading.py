"""Layout-invariant init and sharded loading of Hugging Face checkpoints.

The session's 4-rank and 2-rank runs (``workers.py``) build the test model under FSDP, HSDP,
FSDP x Ulysses SP and expert-parallel layouts as the trainer does, record the full weights
after the random init, load a tiny transformers checkpoint and record the full weights, the
logits and the bytes each rank read. References: one unsharded process (init), transformers
itself (the tensors as written on disk, the logits of its own forward). Error cases run in this
process on the unsharded model: the checks do not depend on the layout.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.common import (
    expected_state, full_state, plain_model, saved_hf_state, text_logits, tiny_hf_llama,
)
from tests.checkpoint.workers import HF_LAYOUTS, SEQ, TOKENS, available


def _layouts(four_ranks, two_ranks, flavor) -> dict[str, list[dict]]:
    """Layout name -> per-rank results, for every layout of ``flavor`` that ran."""
    out = {}
    for results in (two_ranks, four_ranks):
        for name in results[0]["hf"]:
            if HF_LAYOUTS[name][1] == flavor:
                out[name] = [r["hf"][name] for r in results]
    expected = [n for n, (_, f, o, _) in HF_LAYOUTS.items() if f == flavor and available(o)]
    assert sorted(out) == sorted(expected)
    return out


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
@pytest.mark.parametrize("flavor", ["llama", "moe"])
def test_init_is_layout_invariant(flavor, four_ranks, two_ranks):
    """Same seed, same full weights on 1 rank and under every layout."""
    reference = full_state(plain_model(flavor))
    for name, results in _layouts(four_ranks, two_ranks, flavor).items():
        state = results[0]["init"]
        assert state.keys() == reference.keys(), name
        for key, value in reference.items():
            assert torch.equal(state[key], value), f"{name}: {key} differs from the 1-rank init"


def _check_loaded(name, results, hf, flavor, replicas=1):
    expected = hf["expected"][flavor]
    state = results[0]["loaded"]
    assert state.keys() == expected.keys(), name
    for key, value in expected.items():
        assert torch.equal(state[key], value), f"{name}: {key} is not the checkpoint's tensor"
    # Each rank read only its share: the shares add up to the checkpoint (times the replicas).
    assert sum(r["read"] for r in results) == results[0]["total"] * replicas, name
    sp = results[0]["sp"]
    slices = {r["sp_rank"]: r["logits"] for r in results[:sp]}
    logits = torch.cat([slices[k] for k in range(sp)], dim=1)
    torch.testing.assert_close(logits, hf["logits"][flavor], rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{name}: logits differ from transformers: {m}")


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
@pytest.mark.parametrize("flavor", ["llama", "moe"])
def test_hf_checkpoint_loads_under_every_layout(flavor, hf, four_ranks, two_ranks):
    """1 rank (this process) and every 2- and 4-rank layout: the checkpoint's exact tensors,
    each rank reading only its share, and transformers' logits."""
    from torchtitan_omni.checkpoint.weights import load_initial_weights

    model = plain_model(flavor)
    (report,) = load_initial_weights(model, [f"llm={hf['folders'][flavor]}"])
    single = {"loaded": full_state(model), "logits": text_logits(model, None, TOKENS, SEQ),
              "read": report.bytes_read, "total": report.checkpoint_bytes, "sp": 1, "sp_rank": 0}
    _check_loaded("single", [single], hf, flavor)
    for name, results in _layouts(four_ranks, two_ranks, flavor).items():
        _check_loaded(name, results, hf, flavor, HF_LAYOUTS[name][3])


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
def test_experts_skip_fsdp_only_on_a_one_rank_expert_mesh_with_every_block_checkpointed(
        four_ranks, two_ranks):
    """EP over every rank with full AC leaves the experts out of FSDP (the layout the checks
    above load into); EP2 on 2 ranks without AC (the test config's) and EP2 beside efsdp 2
    keep their FSDP unit."""
    layouts = _layouts(four_ranks, two_ranks, "moe")
    flags = {name: results[0]["experts_in_fsdp"] for name, results in layouts.items()}
    assert flags == {"ep2": True, "ep2_full_ac": False, "fsdp4_ep2": True, "sp2_ep2": True}


def test_bf16_checkpoint_converts_to_the_parameter_dtype(tmp_path):
    """A single-file bf16 checkpoint loads into float32 parameters value for value."""
    from torchtitan_omni.checkpoint.weights import load_initial_weights
    from torchtitan_omni.foundations.hf_adapters import Llama3HFAdapter
    from tests.checkpoint.spec import tiny_llama

    tiny_hf_llama(str(tmp_path), dtype=torch.bfloat16, max_shard_size=None)
    assert os.listdir(tmp_path).count("model.safetensors") == 1
    model = plain_model("llama")
    load_initial_weights(model, [f"llm={tmp_path}"])
    state = full_state(model)
    for key, value in expected_state(str(tmp_path), Llama3HFAdapter(tiny_llama())).items():
        assert state[key].dtype == torch.float32
        assert torch.equal(state[key], value), key


# ----------------------------------------------------------------- errors name the tensor/file
def _load_error(folder: str) -> str:
    from torchtitan_omni.checkpoint.weights import load_initial_weights

    with pytest.raises(ValueError) as info:
        load_initial_weights(plain_model("llama"), [f"llm={folder}"])
    return str(info.value)


def _rewrite(folder, out, edit):
    """Copy an HF folder with ``edit(state) -> state`` applied, as one safetensors file."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    save_file(edit(saved_hf_state(folder)), os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    return out


def test_missing_unexpected_and_mismatched_keys_are_named(hf, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"

    def breaks(state):
        del state[key]
        state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
        state["model.norm.weight"] = torch.ones(31)
        return state

    bad = _rewrite(hf["folders"]["llama"], str(tmp_path / "bad"), breaks)
    msg = _load_error(bad)
    assert "3 problem(s)" in msg, msg
    assert (
        f"missing Hugging Face tensor {key} (source of llm.layers.1.feed_forward.w3.weight)" in msg
    )
    assert "unexpected Hugging Face tensor model.layers.0.self_attn.q_proj.bias" in msg
    assert "shape mismatch: llm.norm.weight (32,) needs model.norm.weight of shape (32,)" in msg
    assert f"{os.path.join(bad, 'model.safetensors')} has (31,)" in msg


def test_truncated_safetensors_file_is_named(hf, tmp_path):
    bad = _rewrite(hf["folders"]["llama"], str(tmp_path / "trunc"), lambda s: s)
    path = os.path.join(bad, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    msg = _load_error(bad)
    assert path in msg and "truncated" in msg, msg


def test_bad_sources_fail_clearly(hf, tmp_path):
    from torchtitan_omni.checkpoint.weights import load_initial_weights, parse_sources

    with pytest.raises(ValueError, match="not 'part=path'"):
        parse_sources(["llm"])
    with pytest.raises(
        ValueError, match="overlapping parts 'encoders.vision' and 'encoders.vision.merger'"
    ):
        parse_sources(["encoders.vision=/a", "encoders.vision.merger=/b"])
    with pytest.raises(ValueError, match=r"part 'vision', which is not a module .*parts: llm"):
        load_initial_weights(plain_model("llama"), [f"vision={hf['folders']['llama']}"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "neither a Hugging Face safetensors folder nor a DCP checkpoint" in _load_error(
        str(empty)
    )
    assert "no such folder" in _load_error(str(tmp_path / "nowhere"))
    # The MoE checkpoint into the Llama model: every problem listed, capped, tensors named.
    msg = _load_error(hf["folders"]["moe"])
    assert "problem(s)" in msg and "... and" in msg and "llm.layers.0.feed_forward.w1.weight" in msg
