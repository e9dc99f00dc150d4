"""Real-size flavors build on the meta device with exact parameter counts.

References: the architecture arithmetic (written out here from the published configs), the
published Llama-3-8B count, and Hugging Face transformers' own modules built on meta from the
same configs (Llama, Qwen3-MoE, Qwen2-VL's vision tower, Whisper's encoder, Janus' SigLIP,
aligners, VQ and generation head).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torchtitan_omni.models  # noqa: E402,F401  (registers the specs)
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

REAL = {"janus": "1.3B", "llama_omni": "8B", "qwen3_omni": "8B", "qwen3_moe_omni": "30B-A3B"}


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _build(spec_name: str, flavor: str):
    spec = get_train_spec(spec_name)
    args = spec.model_args[flavor]
    with torch.device("meta"):
        return spec.model_cls(args), args


def _hf(cls_name: str, config):
    with torch.device("meta"):
        return getattr(transformers, cls_name)(config)


# ----------------------------------------------------------------- arithmetic of the LLMs
def _attention(dim, n_heads, n_kv_heads, head_dim) -> int:
    return dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim + n_heads * head_dim * dim


def llama_count(dim, layers, heads, kv_heads, ffn, vocab) -> int:
    """Untied embedding + head, per layer attention + SwiGLU + 2 RMSNorms, final RMSNorm."""
    per_layer = _attention(dim, heads, kv_heads, dim // heads) + 3 * dim * ffn + 2 * dim
    return 2 * vocab * dim + layers * per_layer + dim


def qwen3_count(dim, layers, heads, kv_heads, head_dim, ffn, vocab) -> int:
    """As Llama, with an explicit head_dim and per-head q/k norms."""
    per_layer = (_attention(dim, heads, kv_heads, head_dim) + 2 * head_dim + 3 * dim * ffn
                 + 2 * dim)
    return 2 * vocab * dim + layers * per_layer + dim


def qwen3_moe_count(dim, layers, heads, kv_heads, head_dim, experts, expert_ffn, vocab) -> int:
    """As Llama, with q/k norms and, in every layer, a router and ``experts`` SwiGLU experts."""
    per_layer = (_attention(dim, heads, kv_heads, head_dim) + 2 * head_dim
                 + dim * experts + experts * 3 * dim * expert_ffn + 2 * dim)
    return 2 * vocab * dim + layers * per_layer + dim


def test_llama3_8b_llm_is_the_published_count():
    model, _ = _build("llama_omni", "8B")
    expected = llama_count(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    assert expected == 8_030_261_248  # Meta's published Llama-3-8B size
    assert _count(model.llm) == expected


def test_deepseek_llm_1_3b_of_janus():
    model, _ = _build("janus", "1.3B")
    expected = llama_count(dim=2048, layers=24, heads=16, kv_heads=16, ffn=5632, vocab=102400)
    assert _count(model.llm) == expected


def test_qwen3_8b_llm_matches_hf_built_from_its_config():
    model, args = _build("qwen3_omni", "8B")
    # Qwen3-8B's config.json, written out here rather than exported by our adapter.
    config = transformers.Qwen3Config(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False,
    )
    hf = _hf("Qwen3ForCausalLM", config)
    expected = qwen3_count(dim=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288,
                           vocab=151936)
    assert _count(model.llm) == _count(hf) == expected
    assert expected == 8_190_735_360  # Qwen3-8B's size with its untied head
    assert args.llm.rope_theta == config.rope_parameters["rope_theta"]
    assert args.llm.norm_eps == config.rms_norm_eps
    # every HF parameter has one tensor of ours of the same shape
    shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    for name, src in model.llm.hf_adapter().sources().items():
        assert shapes[src.keys[0]] == tuple(model.llm.get_parameter(name).shape), name


def test_qwen3_30b_a3b_llm_matches_config_arithmetic():
    model, args = _build("qwen3_moe_omni", "30B-A3B")
    # Qwen3-30B-A3B's config.json: hidden 2048, 48 layers, 32/4 heads of 128, 128 experts
    # of 768, vocabulary 151936, untied head.
    expected = qwen3_moe_count(dim=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                               experts=128, expert_ffn=768, vocab=151936)
    assert _count(model.llm) == expected
    assert 30.4e9 < expected < 30.6e9
    # Active parameters per token: experts count top_k / E (8 / 128).
    from torchtitan_omni.flops import active_llm_params

    experts = 48 * 128 * 3 * 2048 * 768
    assert active_llm_params(model) == pytest.approx(
        expected - 151936 * 2048 - experts + experts * 8 / 128)


@pytest.mark.parametrize("spec_name", list(REAL))
def test_llm_matches_hf_model_built_from_the_exported_config(spec_name):
    model, _ = _build(spec_name, REAL[spec_name])
    adapter = model.llm.hf_adapter()
    config = adapter.hf_config()
    cls = config["architectures"][0]
    hf = _hf(cls, getattr(transformers, cls.replace("ForCausalLM", "Config")).from_dict(config))
    assert _count(model.llm) == _count(hf)
    assert len(adapter.sources()) == len(model.llm.state_dict())


# ----------------------------------------------------------------- encoders and decoders
def _whisper_encoder_with_projector(llm_dim: int) -> int:
    """Whisper-large-v3's encoder (HF) without its position table (a fixed sinusoid buffer in
    ours) plus a one-linear projector to the LLM width (Qwen2-Audio's)."""
    cfg = transformers.WhisperConfig(
        d_model=1280,
        encoder_layers=32,
        encoder_attention_heads=20,
        encoder_ffn_dim=5120,
        num_mel_bins=128,
        max_source_positions=1500,
    )
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    with torch.device("meta"):
        encoder = WhisperEncoder(cfg)
    return _count(encoder) - encoder.embed_positions.weight.numel() + 1280 * llm_dim + llm_dim


def _qwen2vl_vision(llm_dim: int) -> int:
    """Qwen2-VL-7B's vision tower with its merger projecting to ``llm_dim``."""
    cfg = transformers.Qwen2VLConfig().vision_config
    cfg.hidden_size = llm_dim
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    with torch.device("meta"):
        return _count(Qwen2VisionTransformerPretrainedModel._from_config(cfg))


def _janus_parts(llm_dim: int) -> tuple[int, int]:
    """(SigLIP tower + understanding aligner, VQ + generation embedding/aligner/head) of HF's
    Janus with projections of ``llm_dim``."""
    vision = transformers.JanusVisionConfig(projection_dim=llm_dim)
    vq = transformers.JanusVQVAEConfig(projection_dim=llm_dim, image_token_embed_dim=llm_dim)
    text = transformers.LlamaConfig(hidden_size=llm_dim, num_hidden_layers=1, vocab_size=8,
                                    intermediate_size=8, num_attention_heads=8)
    cfg = transformers.JanusConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                   vq_config=vq.to_dict())
    m = _hf("JanusModel", cfg)
    understanding = _count(m.vision_model) + _count(m.aligner)
    generation = sum(_count(getattr(m, n)) for n in (
        "vqmodel", "generation_embeddings", "generation_aligner", "generation_head"))
    return understanding, generation


def test_janus_media_parts_match_hf_janus():
    model, args = _build("janus", "1.3B")
    understanding, generation = _janus_parts(args.llm.dim)
    assert _count(model.encoders["vision"]) == understanding
    assert _count(model.decoders["gen_image"]) == generation
    # Janus-1.3B: SigLIP-L/16 at 384 px (576 tokens), VQ with 16384 codes (576 image tokens).
    p = args.processing()
    assert p["image"].num_tokens(384, 384) == 576
    assert p["gen_image"].num_tokens() == 576 and args.gen_image.vq.codebook_size == 16384


@pytest.mark.parametrize("spec_name", ["llama_omni", "qwen3_omni", "qwen3_moe_omni"])
def test_vision_and_audio_encoders_match_hf(spec_name):
    model, args = _build(spec_name, REAL[spec_name])
    dim = args.llm.dim
    assert _count(model.encoders["vision"]) == _qwen2vl_vision(dim)
    assert _count(model.encoders["audio"]) == _whisper_encoder_with_projector(dim)


def test_llama_omni_image_decoder_matches_hf_janus_generation():
    model, args = _build("llama_omni", "8B")
    assert _count(model.decoders["gen_image"]) == _janus_parts(args.llm.dim)[1]


@pytest.mark.parametrize("spec_name", list(REAL))
def test_whole_model_count_is_what_torchtitan_reports(spec_name):
    model, args = _build(spec_name, REAL[spec_name])
    parts = _count(model.llm) + sum(_count(m) for m in model.encoders.values()) + sum(
        _count(m) for m in model.decoders.values())
    nparams, flops_per_token = args.get_nparams_and_flops(model, 8192)
    assert nparams == parts == _count(model)
    assert flops_per_token > 6 * 1e9  # every real flavor has more than 1B active parameters


def test_llm_layers_cuts_the_foundation_and_restores_it():
    """``omni.llm_layers`` keeps the first N blocks of the real layer shape; a later job
    without it gets the flavor's full depth back (the registered args are shared)."""
    from types import SimpleNamespace

    spec = get_train_spec("qwen3_moe_omni")
    args = spec.model_args["30B-A3B"]

    def job(layers):
        return SimpleNamespace(
            training=SimpleNamespace(seq_len=8192), omni=SimpleNamespace(llm_layers=layers),
            model=SimpleNamespace(hf_assets_path=""),
        )

    try:
        args.update_from_config(job(12))
        with torch.device("meta"):
            cut = spec.model_cls(args)
        assert _count(cut.llm) == qwen3_moe_count(dim=2048, layers=12, heads=32, kv_heads=4,
                                                  head_dim=128, experts=128, expert_ffn=768,
                                                  vocab=151936)
        with pytest.raises(ValueError, match="omni.llm_layers"):
            args.update_from_config(job(49))
    finally:
        args.update_from_config(job(0))
    assert args.llm_args.n_layers == 48
