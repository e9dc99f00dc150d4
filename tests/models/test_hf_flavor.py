"""``model.flavor = "hf"``: a foundation built from a Hugging Face folder's config.json.

Folders are tiny random ``transformers`` models saved with ``save_pretrained`` (odd sizes,
tied heads, 6 experts top-2; ``tests/models/hf_folders.py``). In process: the args read from
config.json, logits against ``transformers`` (1e-5 relative), the tokenizer's omni tokens added
with the vocabulary grown, the one-line errors, the encoders' configs. Through
``run_train.sh`` on 2 CPU ranks (slow): training, a tied model's DCP resume, and the export
that ``transformers`` loads bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.harness import REPO, load_script, run_train  # noqa: E402
from tests.models.hf_folders import ARCHS, make_folder  # noqa: E402
from torchtitan_omni.job_model import job_model_args, model_on_meta  # noqa: E402
from torchtitan_omni.checkpoint.weights import load_initial_weights  # noqa: E402
from torchtitan_omni.config.manager import ConfigError, parse_job_config  # noqa: E402
from torchtitan_omni.protocols.modules import AttentionMeta  # noqa: E402

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")


def _config(spec: str, folder, *overrides: str, more_sources: str = ""):
    sources = f"llm={folder}" + (f",{more_sources}" if more_sources else "")
    return parse_job_config([
        "--job.config_file", str(REPO / "train_configs" / f"{spec}_debug.toml"),
        "--model.flavor", "hf", "--weights.sources", sources, *overrides])


def _loaded(cfg):
    model = model_on_meta(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_initial_weights(model, list(cfg.weights.sources))
    return model.eval()


def _packed_logits(llm, docs: list[torch.Tensor]) -> torch.Tensor:
    """Our logits of documents packed into one row (each attends only to itself)."""
    tokens = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    bounds = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    meta = AttentionMeta(cu_seqlens=bounds, max_seqlen=max(len(d) for d in docs),
                         position_ids=positions)
    return llm.output(llm(llm.tok_embeddings(tokens), meta))[0]


def _assert_close(ours, ref, what):
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max abs diff {err:.3e} vs max |ref| {scale:.3e}"
    return err / scale


# ----------------------------------------------------------------- in process
@pytest.mark.parametrize("arch", list(ARCHS))
def test_args_come_from_config_json_and_logits_match_transformers(arch, tmp_path):
    spec = ARCHS[arch][0]
    hf = make_folder(arch, tmp_path / arch)
    cfg = _config(spec, tmp_path / arch)
    llm = job_model_args(cfg).llm
    c = hf.config
    assert (llm.dim, llm.n_layers, llm.n_heads, llm.n_kv_heads, llm.resolved_head_dim) == (
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, 20)
    assert llm.vocab_size == c.vocab_size and llm.tie_word_embeddings == c.tie_word_embeddings
    if arch == "llama":
        scaling = llm.rope_scaling
        assert scaling.factor == 8.0 and scaling.original_max_position_embeddings == 32
    if arch == "qwen3_moe":
        assert (llm.num_experts, llm.top_k, llm.norm_topk_prob) == (6, 2, True)
    model = _loaded(cfg)
    if c.tie_word_embeddings:  # one parameter: the safetensors file has no head
        assert model.llm.output.weight is model.llm.tok_embeddings.weight
        with open(tmp_path / arch / "model.safetensors", "rb") as f:
            assert b"lm_head.weight" not in f.read(1 << 16)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, c.vocab_size, (n,), generator=g) for n in (23, 17)]
    with torch.no_grad():
        got = _packed_logits(model.llm, docs)
        start = 0
        for i, doc in enumerate(docs):
            ref = hf(input_ids=doc[None]).logits[0]
            _assert_close(got[start:start + len(doc)], ref, f"{arch} document {i}")
            start += len(doc)


def test_added_tokens_grow_the_embedding_and_head(tmp_path, caplog):
    """A tokenizer without the omni tokens and without reserved ones (Llama-2 style, vocabulary
    = the checkpoint's rows): the tokens are added after its last id, the embedding and the
    untied head grow by their number, the new rows are the mean of the old ones, and the old
    tokens' logits are still transformers'."""
    from torchtitan_omni.data import special_tokens as st
    from torchtitan_omni.data.tokenizer import build_omni_tokenizer

    folder = tmp_path / "llama"
    make_folder("llama", folder, tokenizer="plain")
    config = json.load(open(folder / "config.json"))
    config["tie_word_embeddings"] = False  # the head must grow too
    json.dump(config, open(folder / "config.json", "w"))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).float().eval()
    hf.save_pretrained(folder)  # with its own lm_head now
    v, n = hf.config.vocab_size, len(st.ORDER)
    with caplog.at_level(logging.INFO):
        cfg = _config("llama_omni", folder)
        tok = build_omni_tokenizer(cfg)
        model = _loaded(cfg)
    assert f"added {n} tokens, embedding and head resized {v} -> {v + n}" in caplog.text
    assert tok.special.bos == v and max(tok.special.media["gen_image"]) == v + n - 1
    assert tok.tokenizer.get_vocab_size() == v + n
    llm = model.llm
    assert llm.args.vocab_size == v + n and llm.output.weight.shape[0] == v + n
    for ours, theirs in ((llm.tok_embeddings.weight, hf.model.embed_tokens.weight),
                         (llm.output.weight, hf.lm_head.weight)):
        assert torch.equal(ours[:v], theirs)
        mean = theirs.double().mean(0).float()
        assert torch.equal(ours[v:], mean.expand(n, -1))
    doc = torch.randint(0, v, (19,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = _packed_logits(llm, [doc])
        _assert_close(got[:, :v], hf(input_ids=doc[None]).logits[0], "old tokens")


def test_tokenizer_comes_from_the_llm_folder_unless_overridden(tmp_path):
    """Flavor hf reads the LLM folder's tokenizer; the bundled tokenizer's folder (every shipped
    TOML's model.hf_assets_path) is no override, any other folder is."""
    from torchtitan_omni.data.tokenizer import tokenizer_folder

    make_folder("qwen3", tmp_path / "qwen3")
    assert tokenizer_folder(_config("qwen3_omni", tmp_path / "qwen3")) == str(tmp_path / "qwen3")
    other = str(REPO / "tests" / "assets" / "tokenizer")
    cfg = _config("qwen3_omni", tmp_path / "qwen3", "--model.hf_assets_path", other)
    assert tokenizer_folder(cfg) == other


def test_parts_flavor_is_undone_for_the_next_job(tmp_path):
    """The trainer updates the registered args in place: one job's debugmodel parts do not
    stay for a later job in the same process that asks for the flavor's own."""
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    import torchtitan_omni.models  # noqa: F401  (registers the specs)

    make_folder("qwen3", tmp_path / "qwen3")
    args = copy.deepcopy(get_train_spec("qwen3_omni").model_args["hf"])
    full = args.vision.dim
    args.update_from_config(_config("qwen3_omni", tmp_path / "qwen3"))  # debug TOML: tiny parts
    assert args.vision.dim == 64 != full
    args.update_from_config(_config("qwen3_omni", tmp_path / "qwen3", "--model.parts_flavor", ""))
    assert args.vision.dim == full


def _one_line_error(*args) -> str:
    with pytest.raises(ConfigError) as e:
        parse_job_config(list(args))
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_bad_folders_are_refused_on_one_line(tmp_path):
    llama_toml = str(REPO / "train_configs" / "llama_omni_debug.toml")
    moe_toml = str(REPO / "train_configs" / "qwen3_moe_omni_debug.toml")
    base = ["--job.config_file", llama_toml, "--model.flavor", "hf"]
    assert "weights.sources entry for 'llm', and there is none" in _one_line_error(*base)

    empty = tmp_path / "empty"
    empty.mkdir()
    msg = _one_line_error(*base, "--weights.sources", f"llm={empty}")
    assert "has no config.json" in msg and str(empty) in msg

    no_tokenizer = tmp_path / "no_tokenizer"
    make_folder("llama", no_tokenizer)
    os.remove(no_tokenizer / "tokenizer.json")
    msg = _one_line_error(*base, "--weights.sources", f"llm={no_tokenizer}")
    assert f"no tokenizer.json in {no_tokenizer}" in msg

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
              open(qwen / "config.json", "w"))
    msg = _one_line_error(*base, "--weights.sources", f"llm={qwen}")
    assert "['Qwen3ForCausalLM'] (model_type 'qwen3')" in msg
    assert "supported: LlamaForCausalLM (model_type 'llama')" in msg

    moe = tmp_path / "moe"
    make_folder("qwen3_moe", moe)
    config = json.load(open(moe / "config.json"))
    json.dump({**config, "shared_expert_intermediate_size": 64}, open(moe / "config.json", "w"))
    msg = _one_line_error("--job.config_file", moe_toml, "--model.flavor", "hf",
                          "--weights.sources", f"llm={moe}")
    assert "shared_expert_intermediate_size = 64" in msg and "has none" in msg

    json.dump({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
              open(moe / "config.json", "w"))
    assert "rope_type 'yarn'" in _one_line_error(
        "--job.config_file", moe_toml, "--model.flavor", "hf", "--weights.sources", f"llm={moe}")

    json.dump(config, open(moe / "config.json", "w"))
    vision = tmp_path / "qwen25vl"
    vision.mkdir()
    json.dump(transformers.Qwen2_5_VLConfig().to_dict(), open(vision / "config.json", "w"))
    msg = _one_line_error("--job.config_file", moe_toml, "--model.flavor", "hf",
                          "--weights.sources", f"llm={moe},encoders.vision={vision}")
    assert "model_type 'qwen2_5_vl' cannot build VisionEncoder" in msg and "qwen2_vl" in msg

    assert "is not a flavor of llama_omni" in _one_line_error(
        "--job.config_file", llama_toml, "--model.parts_flavor", "tiny")


def test_encoder_args_come_from_their_folders(tmp_path):
    """Qwen2-VL's vision tower, a SigLIP tower and Whisper's encoder are shaped by their
    config.json; the Qwen2-VL tower saved by transformers then loads through our adapter."""
    from safetensors.torch import save_file

    from torchtitan_omni.encoders.hf_config import audio_args, siglip_args
    from torchtitan_omni.encoders.audio import AudioArgs
    from torchtitan_omni.encoders.siglip import SiglipArgs

    llm = tmp_path / "llm"
    make_folder("qwen3", llm)
    vl = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=48, num_heads=4, hidden_size=60, patch_size=8,
                           mlp_ratio=2),
        text_config=dict(hidden_size=60, num_hidden_layers=1, num_attention_heads=6,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=64))
    folder = tmp_path / "qwen2vl"
    folder.mkdir()
    vl.save_pretrained(folder)
    torch.manual_seed(0)
    tower = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
        vl.vision_config)
    save_file({f"visual.{k}": v.contiguous() for k, v in tower.state_dict().items()},
              str(folder / "model.safetensors"))
    cfg = _config("qwen3_omni", llm, more_sources=f"encoders.vision={folder}")
    vision = job_model_args(cfg).vision
    assert (vision.dim, vision.depth, vision.n_heads, vision.mlp_ratio, vision.patch_size,
            vision.hf_llm_dim) == (48, 2, 4, 2.0, 8, 60)
    model = _loaded(cfg)
    ours, theirs = model.encoders.vision.state_dict(), tower.state_dict()
    assert torch.equal(ours["blocks.1.attn.qkv.weight"], theirs["blocks.1.attn.qkv.weight"])
    assert torch.equal(ours["merger.mlp.layers.1.weight"], theirs["merger.mlp.2.weight"])

    siglip = siglip_args(transformers.SiglipConfig(vision_config=dict(
        hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
        image_size=64, patch_size=16)).to_dict(), SiglipArgs.debug(), "siglip/config.json")
    assert (siglip.dim, siglip.mlp_dim, siglip.n_layers, siglip.image_size, siglip.hf_format,
            siglip.gelu_approximate) == (48, 100, 3, 64, "siglip", "tanh")
    whisper = audio_args(transformers.WhisperConfig(
        d_model=48, encoder_layers=3, encoder_attention_heads=4, encoder_ffn_dim=96,
        num_mel_bins=80).to_dict(), AudioArgs.debug(), "whisper/config.json")
    assert (whisper.dim, whisper.n_layers, whisper.n_heads, whisper.mlp_dim, whisper.n_mels,
            whisper.chunk_seconds, whisper.hf_format) == (48, 3, 4, 96, 80, 30.0, "whisper")


def _tied_fsdp_worker(rank: int, world_size: int) -> tuple[float, int, bool]:
    """qwen3_omni's debug model with a tied head: FSDP2 on two ranks (embedding and head one
    unit) against one process that sees both ranks' batches."""
    import copy

    from tests.models.batches import mixed_batch
    from tests.models.test_debug_flavors import _forward
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan_omni.config.manager import OmniConfigManager
    from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
    from torchtitan_omni.distributed.parallelize import parallelize_omni

    cfg = OmniConfigManager().parse_args([
        "--model.name", "qwen3_omni", "--model.flavor", "debugmodel", "--training.dataset",
        "omni_default", "--model.hf_assets_path", "/nonexistent"])
    dims = OmniParallelDims.from_config(cfg.parallelism, world_size)
    dims.build_mesh()
    spec = get_train_spec("qwen3_omni")
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.llm.tie_word_embeddings = True
    reference = spec.model_cls(args)
    reference.init_weights()
    with torch.device("meta"):
        model = spec.model_cls(args)
    parallelize_omni(model, dims, cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    tied = model.llm.output.weight is model.llm.tok_embeddings.weight
    _forward(model, *mixed_batch(reference, args.llm.vocab_size, seed=rank))[0].backward()
    sum(_forward(reference, *mixed_batch(reference, args.llm.vocab_size, seed=r))[0]
        for r in range(world_size)).backward()
    ref = dict(reference.named_parameters())
    worst, compared = 0.0, 0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()
        assert torch.equal(p.full_tensor(), ref[name].detach()), name
        worst = max(worst, float((grad - ref[name].grad).abs().max() / ref[name].grad.abs().max()))
        compared += 1
    return worst, compared, tied


def test_tied_head_under_fsdp_matches_one_process():
    from tests.harness import run_distributed

    worst, compared, tied = run_distributed(_tied_fsdp_worker, 2)[0]
    assert tied and compared > 20 and worst < 1e-5, (worst, compared, tied)


# ----------------------------------------------------------------- run_train.sh
def _train(spec, folder, dump, *overrides):
    run = run_train(str(REPO / "train_configs" / f"{spec}_debug.toml"), 2,
                    "--model.flavor", "hf", "--weights.sources", f"llm={folder}",
                    "--lr_scheduler.warmup_steps", "1", "--job.dump_folder", str(dump),
                    "--checkpoint.enable", "--checkpoint.folder", "checkpoint", *overrides)
    assert run.returncode == 0, run.output[-4000:]
    assert all(math.isfinite(v) for v in run.loss_list()), run.loss_list()
    return run


def _export_matches(spec, folder, checkpoint, out, tied: bool) -> str:
    """Export the checkpoint's LLM: transformers loads it (saved back by transformers, every
    tensor equals the checkpoint's bit for bit; a tied head is written once, as the
    embedding) and gives our model's logits."""
    from safetensors.torch import load_file

    from tests.checkpoint.common import dcp_tensors
    from torchtitan_omni.checkpoint.hf_export import split_to_hf

    convert = load_script("convert_checkpoint")
    config_file = str(REPO / "train_configs" / f"{spec}_debug.toml")
    overrides = ["--model.flavor", "hf", "--weights.sources", f"llm={folder}"]
    exported = convert.dcp_to_hf(config_file, overrides, str(checkpoint), str(out),
                                 parts=["llm"])["llm"]
    config = json.load(open(os.path.join(exported, "config.json")))
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(os.path.join(exported, "model.safetensors"))) is not tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert hf.dtype == torch.float32
    hf.save_pretrained(out / "resaved")
    resaved = load_file(str(out / "resaved" / "model.safetensors"))
    saved = dcp_tensors(str(checkpoint))
    ours = _loaded(parse_job_config(["--job.config_file", config_file, *overrides]))
    expected = {}
    for name, source in ours.llm.hf_adapter().sources().items():
        expected.update(split_to_hf(saved[f"llm.{name}"], source))
    assert expected.keys() == resaved.keys()
    for key, value in expected.items():
        assert torch.equal(resaved[key], value), key
    load_initial_weights(ours, [f"llm={checkpoint}"])
    doc = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _assert_close(_packed_logits(ours.llm, [doc]), hf(input_ids=doc[None]).logits[0],
                      f"{spec} export")
    if tied:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    return exported


@pytest.mark.slow
def test_tied_llama_trains_resumes_and_exports(tmp_path):
    """Llama with a tied head on 2 ranks (one FSDP unit for the embedding and the head):
    4 steps saving at 2, then a second run resumes from step 2 and repeats steps 3-4 with the
    same losses; its final checkpoint exports to a folder transformers loads bit for bit."""
    folder, dump = tmp_path / "llama", tmp_path / "run"
    make_folder("llama", folder)
    first = _train("llama_omni", folder, dump, "--training.steps", "4",
                   "--checkpoint.interval", "2")
    assert "Loaded llm from Hugging Face" in first.output
    shutil.rmtree(dump / "checkpoint" / "step-4")  # model-only: resume takes step 2
    second = _train("llama_omni", folder, dump, "--training.steps", "5",
                    "--checkpoint.interval", "2")
    assert "step-2" in second.output and "weights.sources not loaded" in second.output
    for step in (3, 4):
        assert second.losses[step] == pytest.approx(first.losses[step], rel=1e-5), (first, second)
    _export_matches("llama_omni", folder, dump / "checkpoint" / "step-5", tmp_path / "export",
                    tied=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_qwen3_folders_train_and_export(arch, tmp_path):
    """Qwen3 dense (tied head; a tokenizer without the omni tokens: the embedding grows) and
    Qwen3-MoE (6 experts top-2, untied) train 2 steps on 2 ranks and export."""
    spec = ARCHS[arch][0]
    folder, dump = tmp_path / arch, tmp_path / "run"
    make_folder(arch, folder, tokenizer="plain" if arch == "qwen3" else "bundled")
    run = _train(spec, folder, dump, "--training.steps", "2")
    if arch == "qwen3":
        assert "added 19 tokens, embedding resized" in run.output
        assert "start as the mean of rows" in run.output
    exported = _export_matches(spec, folder, dump / "checkpoint" / "step-2",
                               tmp_path / "export", tied=arch == "qwen3")
    if arch == "qwen3":  # the exported tokenizer has the added tokens its embedding holds
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(exported, "tokenizer.json"))
        config = json.load(open(os.path.join(exported, "config.json")))
        assert tok.get_vocab_size() == config["vocab_size"]
