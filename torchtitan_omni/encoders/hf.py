"""Hugging Face checkpoint naming of the encoders (``HFAdapter``s).

Tensor names on our side are relative to the encoder (``blocks.0.attn.qkv.weight``); on the
HF side they carry the checkpoint's prefix, which each adapter takes as an argument:

- ``Qwen2VLVisionAdapter``: Qwen2-VL's vision tower, ``visual.*`` (``model.visual.*`` in
  checkpoints converted by transformers >= 4.52). Every tensor maps, the merger included.
- ``SiglipVisionAdapter``: ``SiglipVisionModel`` / ``SiglipModel``, ``vision_model.*``. The
  aligner has no SigLIP counterpart and keeps its initialization.
- ``JanusVisionAdapter``: Janus / Janus-Pro in transformers format, ``model.vision_model.*`` and
  the understanding aligner ``model.aligner.*``.
- ``WhisperEncoderAdapter``: Whisper's encoder, ``model.encoder.*`` (``WhisperForConditional
  Generation``) or ``encoder.*`` (``WhisperModel``). The projector keeps its initialization.
- ``Qwen2AudioAdapter``: Qwen2-Audio's ``audio_tower.*`` and ``multi_modal_projector.linear``.

Our tensors a checkpoint lacks are listed by ``init_only()`` and keep their initialization
(the SigLIP aligner, the Whisper projector, Qwen2-VL's last merger linear when the LLM width
differs from the checkpoint's). Each adapter ignores the other components of its checkpoint
(the LLM, the other towers), so a whole multi-part checkpoint folder loads part by part.
Whisper's position table is not loaded: ours is the same fixed sinusoid, computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_omni.protocols.hf import HFAdapter, HFSource

if TYPE_CHECKING:  # annotations only: the encoder modules import this one
    from torchtitan_omni.encoders.audio import AudioArgs
    from torchtitan_omni.encoders.siglip import SiglipArgs
    from torchtitan_omni.encoders.vision import VisionArgs


def one(key: str) -> HFSource:
    """Our tensor is exactly the HF tensor ``key``."""
    return HFSource(keys=(key,))


def add_affine(out: dict[str, HFSource], ours: str, theirs: str, bias: bool = True) -> None:
    """Map ``<ours>.weight`` (and ``.bias``) onto ``<theirs>.weight`` (and ``.bias``)."""
    out[f"{ours}.weight"] = one(f"{theirs}.weight")
    if bias:
        out[f"{ours}.bias"] = one(f"{theirs}.bias")


def add_mlp_projector(out: dict[str, HFSource], ours: str, theirs: list[str]) -> None:
    """Map ``<ours>.layers.i`` onto the HF linears ``theirs[i]``."""
    for i, name in enumerate(theirs):
        add_affine(out, f"{ours}.layers.{i}", name)


def aligner_names(prefix: str, depth: int) -> list[str]:
    """Janus' MLP naming: ``fc1`` then ``hidden_layers.0 ..``."""
    return [f"{prefix}fc1"] + [f"{prefix}hidden_layers.{i}" for i in range(depth - 1)]


#: the language model of a Qwen2-VL checkpoint (both naming generations)
QWEN2_VL_LLM_KEYS = ("model.language_model.*", "model.embed_tokens.*", "model.layers.*",
                     "model.norm.*", "lm_head.*")
#: the parts of a Janus checkpoint (transformers format) besides its vision tower and aligner
JANUS_LLM_KEYS = ("model.language_model.*", "lm_head.*")


class Qwen2VLVisionAdapter(HFAdapter):
    """Our ``VisionEncoder`` <-> Qwen2-VL's ``visual.*``
    (``Qwen2VisionTransformerPretrainedModel``)."""

    def __init__(self, args: VisionArgs, llm_dim: int, prefix: str = "visual.") -> None:
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix
        # The merger's last linear projects to the checkpoint's LLM width.
        self.load_projection = args.hf_llm_dim in (None, llm_dim)

    def sources(self) -> dict[str, HFSource]:
        p = self.prefix
        out = {"patch_embed.weight": one(f"{p}patch_embed.proj.weight")}
        for i in range(self.args.depth):
            b = f"{p}blocks.{i}."
            add_affine(out, f"blocks.{i}.norm1", f"{b}norm1")
            add_affine(out, f"blocks.{i}.attn.qkv", f"{b}attn.qkv")
            add_affine(out, f"blocks.{i}.attn.wo", f"{b}attn.proj")
            add_affine(out, f"blocks.{i}.norm2", f"{b}norm2")
            add_affine(out, f"blocks.{i}.mlp.fc1", f"{b}mlp.fc1")
            add_affine(out, f"blocks.{i}.mlp.fc2", f"{b}mlp.fc2")
        add_affine(out, "merger.norm", f"{p}merger.ln_q")
        linears = [f"{p}merger.mlp.0", f"{p}merger.mlp.2"]
        add_mlp_projector(out, "merger.mlp", linears if self.load_projection else linears[:1])
        return out

    def init_only(self) -> tuple[str, ...]:
        return () if self.load_projection else ("merger.mlp.layers.1.*",)

    def ignored_hf_keys(self) -> tuple[str, ...]:
        projection = () if self.load_projection else (f"{self.prefix}merger.mlp.2.*",)
        return projection + QWEN2_VL_LLM_KEYS

    def hf_config(self) -> dict:
        a = self.args
        return {
            "model_type": "qwen2_vl", "depth": a.depth, "embed_dim": a.dim,
            "hidden_size": self.llm_dim, "hidden_act": a.hidden_act, "mlp_ratio": a.mlp_ratio,
            "num_heads": a.n_heads, "in_channels": a.in_channels, "patch_size": a.patch_size,
            "spatial_merge_size": a.merge_size, "temporal_patch_size": a.temporal_patch_size,
        }


def _vision_tower_sources(args: SiglipArgs, p: str, out_proj: str) -> dict[str, HFSource]:
    """SigLIP-shaped tower under prefix ``p`` (SigLIP and Janus differ in the output projection)."""
    out: dict[str, HFSource] = {}
    add_affine(out, "patch_embed", f"{p}embeddings.patch_embedding")
    out["pos_embed"] = one(f"{p}embeddings.position_embedding.weight")
    for i in range(args.n_layers):
        b = f"{p}encoder.layers.{i}."
        add_affine(out, f"blocks.{i}.norm1", f"{b}layer_norm1")
        for ours, theirs in (
            ("wq", "q_proj"),
            ("wk", "k_proj"),
            ("wv", "v_proj"),
            ("wo", out_proj),
        ):
            add_affine(out, f"blocks.{i}.attn.{ours}", f"{b}self_attn.{theirs}")
        add_affine(out, f"blocks.{i}.norm2", f"{b}layer_norm2")
        add_affine(out, f"blocks.{i}.mlp.fc1", f"{b}mlp.fc1")
        add_affine(out, f"blocks.{i}.mlp.fc2", f"{b}mlp.fc2")
    add_affine(out, "post_norm", f"{p}post_layernorm")
    return out


def _siglip_config(args: SiglipArgs, act: str) -> dict:
    return {
        "hidden_size": args.dim, "intermediate_size": args.mlp_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_channels": args.in_channels, "image_size": args.image_size,
        "patch_size": args.patch_size, "hidden_act": act, "layer_norm_eps": args.norm_eps,
    }


class SiglipVisionAdapter(HFAdapter):
    """Our ``SiglipEncoder`` tower <-> ``vision_model.*`` of SigLIP (the aligner is not in it)."""

    def __init__(self, args: SiglipArgs, llm_dim: int, prefix: str = "vision_model.") -> None:
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix

    def sources(self) -> dict[str, HFSource]:
        return _vision_tower_sources(self.args, self.prefix, "out_proj")

    def init_only(self) -> tuple[str, ...]:
        return ("aligner.*",)  # Janus' aligner has no SigLIP counterpart

    def ignored_hf_keys(self) -> tuple[str, ...]:
        # The attention-pooling head and the text tower of a SiglipModel checkpoint.
        return (f"{self.prefix}head.*", "text_model.*", "logit_scale", "logit_bias")

    def hf_config(self) -> dict:
        act = "gelu_pytorch_tanh" if self.args.gelu_approximate == "tanh" else "gelu"
        return {"model_type": "siglip_vision_model", **_siglip_config(self.args, act)}


class JanusVisionAdapter(HFAdapter):
    """Our ``SiglipEncoder`` <-> Janus' ``model.vision_model.*`` and ``model.aligner.*``."""

    def __init__(self, args: SiglipArgs, llm_dim: int, prefix: str = "model.") -> None:
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix

    def sources(self) -> dict[str, HFSource]:
        out = _vision_tower_sources(self.args, f"{self.prefix}vision_model.", "projection_layer")
        add_mlp_projector(
            out, "aligner", aligner_names(f"{self.prefix}aligner.", self.args.aligner_depth)
        )
        return out

    def ignored_hf_keys(self) -> tuple[str, ...]:
        p = self.prefix  # the generation side belongs to the decoder's adapter
        return JANUS_LLM_KEYS + (f"{p}vqmodel.*", f"{p}generation_*")

    def hf_config(self) -> dict:
        act = "gelu_pytorch_tanh" if self.args.gelu_approximate == "tanh" else "gelu"
        return {
            "model_type": "janus_vision_model",
            **_siglip_config(self.args, act),
            "mlp_ratio": self.args.mlp_dim / self.args.dim,
            "attention_bias": True,
            "projection_dim": self.args.aligner_hidden or self.llm_dim,
            "depth": self.args.aligner_depth,
            "num_image_tokens": self.args.num_patches,
        }


def _whisper_tower_sources(args: AudioArgs, p: str) -> dict[str, HFSource]:
    out: dict[str, HFSource] = {}
    add_affine(out, "conv1", f"{p}conv1")
    add_affine(out, "conv2", f"{p}conv2")
    for i in range(args.n_layers):
        b = f"{p}layers.{i}."
        add_affine(out, f"blocks.{i}.norm1", f"{b}self_attn_layer_norm")
        add_affine(out, f"blocks.{i}.attn.wq", f"{b}self_attn.q_proj")
        add_affine(out, f"blocks.{i}.attn.wk", f"{b}self_attn.k_proj", bias=False)
        add_affine(out, f"blocks.{i}.attn.wv", f"{b}self_attn.v_proj")
        add_affine(out, f"blocks.{i}.attn.wo", f"{b}self_attn.out_proj")
        add_affine(out, f"blocks.{i}.norm2", f"{b}final_layer_norm")
        add_affine(out, f"blocks.{i}.mlp.fc1", f"{b}fc1")
        add_affine(out, f"blocks.{i}.mlp.fc2", f"{b}fc2")
    add_affine(out, "norm", f"{p}layer_norm")
    return out


def _whisper_config(args: AudioArgs) -> dict:
    return {
        "num_mel_bins": args.n_mels, "d_model": args.dim, "encoder_layers": args.n_layers,
        "encoder_attention_heads": args.n_heads, "encoder_ffn_dim": args.mlp_dim,
        "max_source_positions": args.max_positions, "activation_function": "gelu",
    }


class WhisperEncoderAdapter(HFAdapter):
    """Our ``AudioEncoder`` tower <-> Whisper's encoder (the projector is not in Whisper)."""

    def __init__(self, args: AudioArgs, llm_dim: int, prefix: str = "model.encoder.") -> None:
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix

    def sources(self) -> dict[str, HFSource]:
        return _whisper_tower_sources(self.args, self.prefix)

    def init_only(self) -> tuple[str, ...]:
        return ("projector.*",)  # the projector to the LLM has no Whisper counterpart

    def ignored_hf_keys(self) -> tuple[str, ...]:
        # The fixed sinusoid table (computed here) and Whisper's text decoder.
        return (
            f"{self.prefix}embed_positions.weight",
            "model.decoder.*",
            "decoder.*",
            "proj_out.*",
        )

    def hf_config(self) -> dict:
        return {"model_type": "whisper", **_whisper_config(self.args)}


class Qwen2AudioAdapter(HFAdapter):
    """Our ``AudioEncoder`` <-> Qwen2-Audio's ``audio_tower.*`` + ``multi_modal_projector``."""

    def __init__(self, args: AudioArgs, llm_dim: int, prefix: str = "") -> None:
        if args.projector_depth != 1:
            raise ValueError("Qwen2-Audio's projector is one linear: set projector_depth = 1")
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix

    def sources(self) -> dict[str, HFSource]:
        out = _whisper_tower_sources(self.args, f"{self.prefix}audio_tower.")
        add_mlp_projector(out, "projector", [f"{self.prefix}multi_modal_projector.linear"])
        return out

    def ignored_hf_keys(self) -> tuple[str, ...]:
        return (
            f"{self.prefix}audio_tower.embed_positions.weight",
            f"{self.prefix}language_model.*",
        )

    def hf_config(self) -> dict:
        return {"model_type": "qwen2_audio_encoder", **_whisper_config(self.args)}
