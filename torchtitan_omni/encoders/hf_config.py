"""Encoder args from a Hugging Face ``config.json`` (``model.flavor = "hf"``).

:func:`encoder_args` takes the encoder's current args (which say what kind of encoder the spec
has: ``VisionArgs``, ``SiglipArgs`` or ``AudioArgs``) and a checkpoint's config, and returns the
args with the tower's shape read from the config (processing bounds and our own choices kept):

- ``VisionArgs`` <- Qwen2-VL (``qwen2_vl`` with its ``vision_config``, or a vision config);
  Qwen2.5-VL is refused: its tower (RMSNorm, SwiGLU MLP, window attention) is not Qwen2-VL's;
- ``SiglipArgs`` <- SigLIP (``siglip``, ``siglip_vision_model``) or Janus (``janus``);
- ``AudioArgs`` <- Whisper (``whisper``) or Qwen2-Audio (``qwen2_audio``, its encoder).

What the adapters of ``torchtitan_omni.encoders.hf`` need is read; anything else is refused
with one line naming the ``model_type`` and the supported ones.
"""

from __future__ import annotations

import dataclasses

from torchtitan_omni.encoders.audio import AudioArgs
from torchtitan_omni.encoders.siglip import SiglipArgs
from torchtitan_omni.encoders.vision import VisionArgs
from torchtitan_omni.errors import HFConfigError
from torchtitan_omni.foundations.hf_config import ConfigReader

_VISION = ("qwen2_vl", "qwen2_vl_vision")
_SIGLIP = ("siglip", "siglip_vision_model", "janus", "janus_vision_model")
_AUDIO = ("whisper", "qwen2_audio", "qwen2_audio_encoder")
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


def _unsupported(where: str, model_type, encoder: str, supported: tuple[str, ...]) -> HFConfigError:
    if model_type in ("qwen2_5_vl", "qwen2_5_vl_vision", "qwen2_5_omni"):
        why = (" (Qwen2.5-VL's tower has RMSNorm, a SwiGLU MLP and window attention; "
               "VisionEncoder is Qwen2-VL's)")
    else:
        why = ""
    return HFConfigError(f"{where}: model_type {model_type!r} cannot build {encoder}{why}; "
                         f"supported: {', '.join(supported)}")


def _sub(config: dict, key: str, where: str) -> tuple[dict, str]:
    """A nested config (``vision_config``) when the file is a whole multi-part model's."""
    sub = config.get(key)
    if not isinstance(sub, dict):
        raise HFConfigError(f"{where} has no '{key}'")
    return sub, f"{where} [{key}]"


def _build(cls_name: str, current, where: str, **changes):
    try:
        return dataclasses.replace(current, **changes)
    except ValueError as e:
        raise HFConfigError(f"{where}: {cls_name} {e}") from None


def vision_args(config: dict, current: VisionArgs, where: str) -> VisionArgs:
    """Qwen2-VL's vision tower (``embed_dim``, ``depth``, ``num_heads``, merger width)."""
    model_type = config.get("model_type")
    if model_type not in _VISION:
        raise _unsupported(where, model_type, "VisionEncoder", _VISION)
    if model_type == "qwen2_vl":
        config, where = _sub(config, "vision_config", where)
    c = ConfigReader(config, where)
    act = c.get("hidden_act", "quick_gelu")
    if act not in ("quick_gelu", "gelu"):
        raise c.refuse("hidden_act", "VisionEncoder has quick_gelu or gelu")
    rope = c.get("rope_parameters", {}, dict)
    return _build(
        "VisionArgs", current, where, dim=c.int("embed_dim"), depth=c.int("depth"),
        n_heads=c.int("num_heads"), mlp_ratio=c.float("mlp_ratio", 4.0),
        in_channels=c.config.get("in_channels") or c.int("in_chans", 3),
        patch_size=c.int("patch_size"), merge_size=c.int("spatial_merge_size", 2),
        temporal_patch_size=c.int("temporal_patch_size", 2), hidden_act=act,
        rope_theta=float(rope.get("rope_theta", current.rope_theta)),
        hf_llm_dim=c.int("hidden_size", None),
    )


def siglip_args(config: dict, current: SiglipArgs, where: str) -> SiglipArgs:
    """A SigLIP tower (SigLIP naming) or Janus' (its naming, aligner included)."""
    model_type = config.get("model_type")
    if model_type not in _SIGLIP:
        raise _unsupported(where, model_type, "SiglipEncoder", _SIGLIP)
    if model_type in ("siglip", "janus"):
        config, where = _sub(config, "vision_config", where)
    janus = model_type.startswith("janus")
    c = ConfigReader(config, where)
    act = c.get("hidden_act", "gelu" if janus else "gelu_pytorch_tanh")
    if act not in _GELU:
        raise c.refuse("hidden_act", f"SiglipEncoder has {', '.join(_GELU)}")
    dim = c.int("hidden_size")
    mlp = c.config.get("intermediate_size") or round(c.float("mlp_ratio", 4.0) * dim)
    changes = dict(
        image_size=c.int("image_size"), patch_size=c.int("patch_size"),
        in_channels=c.int("num_channels", 3), dim=dim, n_layers=c.int("num_hidden_layers"),
        n_heads=c.int("num_attention_heads"), mlp_dim=int(mlp),
        norm_eps=c.float("layer_norm_eps", 1e-6), gelu_approximate=_GELU[act],
        hf_format="janus" if janus else "siglip",
    )
    if janus:
        changes.update(aligner_depth=c.int("depth", current.aligner_depth),
                       aligner_hidden=c.int("projection_dim", current.aligner_hidden))
    return _build("SiglipArgs", current, where, **changes)


def audio_args(config: dict, current: AudioArgs, where: str) -> AudioArgs:
    """Whisper's encoder, or Qwen2-Audio's (whose projector is one linear)."""
    model_type = config.get("model_type")
    if model_type not in _AUDIO:
        raise _unsupported(where, model_type, "AudioEncoder", _AUDIO)
    if model_type == "qwen2_audio":
        config, where = _sub(config, "audio_config", where)
    c = ConfigReader(config, where)
    if c.get("activation_function", "gelu") != "gelu":
        raise c.refuse("activation_function", "AudioEncoder's MLP uses gelu")
    # positions after the stride-2 convolution: the clip length the encoder was trained on
    positions = c.int("max_source_positions", 1500)
    changes = dict(
        n_mels=c.int("num_mel_bins"), dim=c.int("d_model"), n_layers=c.int("encoder_layers"),
        n_heads=c.int("encoder_attention_heads"), mlp_dim=c.int("encoder_ffn_dim"),
        chunk_seconds=positions * 2 * current.hop_length / current.sample_rate,
        hf_format="whisper" if model_type == "whisper" else "qwen2_audio",
    )
    if changes["hf_format"] == "qwen2_audio":
        changes["projector_depth"] = 1
    return _build("AudioArgs", current, where, **changes)


_PARSERS = ((VisionArgs, vision_args), (SiglipArgs, siglip_args), (AudioArgs, audio_args))


def encoder_args(current, config: dict, where: str):
    """``current`` (an encoder's args) with the tower's shape from ``config``."""
    for cls, parse in _PARSERS:
        if isinstance(current, cls):
            return parse(config, current, where)
    raise HFConfigError(f"{where}: {type(current).__name__} has no Hugging Face config reader "
                        "(supported: Qwen2-VL vision, SigLIP/Janus, Whisper/Qwen2-Audio)")
