"""Foundation args from a Hugging Face ``config.json`` (``model.flavor = "hf"``).

A model spec lists the architectures its foundation accepts (``HFArchitecture``: the
``architectures`` name, the ``model_type`` and the parser that builds our args);
:func:`foundation_args` picks one by the config's ``architectures`` (or ``model_type``) and
builds the args. Both generations of config files are read: the hub's (``rope_theta``,
``rope_scaling``, ``num_experts``) and transformers 5's (``rope_parameters``,
``num_local_experts``). What our foundations cannot reproduce (another RoPE scaling, MLP
biases, sliding windows, dense layers or shared experts in an MoE, another activation) is
refused with one line naming the key, so a checkpoint never loads into a model that computes
something else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_omni.errors import HFConfigError
from torchtitan_omni.foundations.llama3 import Llama3Args
from torchtitan_omni.foundations.qwen3 import Qwen3Args
from torchtitan_omni.foundations.qwen3_moe import Qwen3MoeArgs
from torchtitan_omni.modules.rope import RopeScaling

CONFIG_FILE = "config.json"

_MISSING = object()


def read_hf_config(folder: str, part: str = "llm") -> dict:
    """The parsed ``config.json`` of a Hugging Face folder (one-line errors)."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise HFConfigError(
            f"weights.sources {part}={folder} has no {CONFIG_FILE}: model.flavor = 'hf' reads "
            "the model's shape from it (give the Hugging Face folder the model was saved to)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{path} is not a readable JSON file: {e}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


class ConfigReader:
    """Typed look-ups in one config dict; errors name the key and the file."""

    def __init__(self, config: dict, where: str) -> None:
        self.config, self.where = config, where

    def get(self, key: str, default: Any = _MISSING, kind: type | tuple = (int, float, str, bool)):
        """``config[key]`` (or ``default`` when absent or null), checked against ``kind``."""
        value = self.config.get(key)
        if value is None:
            if default is _MISSING:
                raise HFConfigError(f"{self.where} has no '{key}'")
            return default
        if isinstance(value, bool) and kind in (int, float):
            raise HFConfigError(f"{self.where}: '{key}' must be a number, got {value!r}")
        if not isinstance(value, kind):
            name = kind.__name__ if isinstance(kind, type) else "a value"
            raise HFConfigError(f"{self.where}: '{key}' must be {name}, got {value!r}")
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        return self.get(key, default, int)

    def float(self, key: str, default: Any = _MISSING) -> float:
        return float(self.get(key, default, (int, float)))

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        return self.get(key, default, bool)

    def refuse(self, key: str, why: str) -> HFConfigError:
        """The error for a value our model cannot reproduce."""
        return HFConfigError(f"{self.where}: {key} = {self.config.get(key)!r}: {why}")


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture a spec's foundation can be built from."""

    name: str  # the ``architectures`` entry, e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    parse: Callable[[ConfigReader], Any]


def foundation_args(config: dict, accepted: tuple[HFArchitecture, ...], where: str, spec: str):
    """Our foundation args for ``config`` if its architecture is one of ``accepted``."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    chosen = next((a for a in accepted if a.name in archs), None)
    if chosen is None and not archs:
        chosen = next((a for a in accepted if a.model_type == model_type), None)
    if chosen is None:
        supported = ", ".join(f"{a.name} (model_type '{a.model_type}')" for a in accepted)
        raise HFConfigError(
            f"{where}: architectures {archs} (model_type {model_type!r}) cannot be the "
            f"foundation of {spec}; supported: {supported}")
    return chosen.parse(ConfigReader(config, where))


# ----------------------------------------------------------------- shared keys
def _rope(c: ConfigReader, default_theta: float) -> tuple[float, str, dict]:
    """(theta, rope_type, parameters) from ``rope_theta``/``rope_scaling`` or transformers 5's
    ``rope_parameters``."""
    params = dict(c.get("rope_parameters", {}, dict))
    params.update(c.get("rope_scaling", {}, dict))
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = c.config.get("rope_theta") or params.get("rope_theta") or default_theta
    return float(theta), kind, params


def _common(c: ConfigReader, family: str) -> dict:
    """The decoder shape every family shares, with transformers' defaults where optional."""
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise c.refuse("hidden_act", f"{family}'s SwiGLU uses silu")
    dim, heads = c.int("hidden_size"), c.int("num_attention_heads")
    head_dim = c.int("head_dim", None)
    if head_dim is None:
        if dim % heads:
            raise c.refuse("num_attention_heads", f"does not divide hidden_size {dim} and "
                           "there is no head_dim")
        head_dim = dim // heads
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise c.refuse("num_key_value_heads", f"must divide num_attention_heads {heads}")
    return dict(
        dim=dim, n_layers=c.int("num_hidden_layers"), n_heads=heads, n_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=c.int("vocab_size"), norm_eps=c.float("rms_norm_eps", 1e-6),
        attention_bias=c.bool("attention_bias", False),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
    )


def _no_sliding_window(c: ConfigReader, family: str) -> None:
    if c.bool("use_sliding_window", False):
        raise c.refuse("use_sliding_window", f"our {family} attends over whole documents")
    layer_types = c.get("layer_types", [], list)
    if any(t != "full_attention" for t in layer_types):
        raise c.refuse("layer_types", f"our {family} has full attention in every layer")


def _plain_rope(c: ConfigReader, family: str, default_theta: float) -> float:
    theta, kind, _ = _rope(c, default_theta)
    if kind != "default":
        raise HFConfigError(f"{c.where}: rope_type {kind!r} is not supported by {family} "
                            "(ours has no RoPE scaling); supported: default")
    return theta


# ----------------------------------------------------------------- families
def llama3_args(c: ConfigReader) -> Llama3Args:
    """``LlamaForCausalLM``: Llama 2, 3, 3.1, 3.2 (``rope_type`` llama3), DeepSeek-LLM."""
    if c.bool("mlp_bias", False):
        raise c.refuse("mlp_bias", "our Llama's MLP has no biases")
    theta, kind, p = _rope(c, 10000.0)
    if kind == "default":
        scaling = None
    elif kind == "llama3":
        try:
            scaling = RopeScaling(
                factor=float(p["factor"]), low_freq_factor=float(p["low_freq_factor"]),
                high_freq_factor=float(p["high_freq_factor"]),
                original_max_position_embeddings=int(p["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as e:
            raise HFConfigError(f"{c.where}: the llama3 RoPE scaling lacks {e}") from None
    else:
        raise HFConfigError(f"{c.where}: rope_type {kind!r} is not supported by Llama; "
                            "supported: default, llama3")
    return Llama3Args(
        **_common(c, "Llama"), ffn_hidden_dim=c.int("intermediate_size"), rope_theta=theta,
        rope_scaling=scaling, max_seq_len=c.int("max_position_embeddings", 2048),
    )


def qwen3_args(c: ConfigReader) -> Qwen3Args:
    """``Qwen3ForCausalLM`` (Qwen3 dense)."""
    _no_sliding_window(c, "Qwen3")
    return Qwen3Args(
        **_common(c, "Qwen3"), ffn_hidden_dim=c.int("intermediate_size"),
        rope_theta=_plain_rope(c, "Qwen3", 1_000_000.0),
        max_seq_len=c.int("max_position_embeddings", 32768),
    )


#: config keys of shared experts in the MoE families transformers knows
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts",
                       "num_shared_experts", "moe_shared_expert_intermediate_size")


def qwen3_moe_args(c: ConfigReader) -> Qwen3MoeArgs:
    """``Qwen3MoeForCausalLM``: every layer sparse, no shared experts."""
    _no_sliding_window(c, "Qwen3-MoE")
    for key in _SHARED_EXPERT_KEYS:
        if c.config.get(key):
            raise c.refuse(key, "shared experts; the Qwen3-MoE foundation has none")
    if c.int("decoder_sparse_step", 1) != 1:
        raise c.refuse("decoder_sparse_step", "our Qwen3-MoE has an MoE in every layer")
    if c.get("mlp_only_layers", [], list):
        raise c.refuse("mlp_only_layers", "our Qwen3-MoE has an MoE in every layer")
    experts = c.config.get("num_experts") or c.int("num_local_experts")
    top_k = c.int("num_experts_per_tok")
    if not 0 < top_k <= experts:
        raise c.refuse("num_experts_per_tok", f"must be in 1..{experts} (the experts)")
    return Qwen3MoeArgs(
        **_common(c, "Qwen3-MoE"), num_experts=int(experts), top_k=top_k,
        moe_hidden_dim=c.int("moe_intermediate_size"),
        norm_topk_prob=c.bool("norm_topk_prob", False),
        rope_theta=_plain_rope(c, "Qwen3-MoE", 1_000_000.0),
        max_seq_len=c.int("max_position_embeddings", 32768),
    )


LLAMA = HFArchitecture("LlamaForCausalLM", "llama", llama3_args)
QWEN3 = HFArchitecture("Qwen3ForCausalLM", "qwen3", qwen3_args)
QWEN3_MOE = HFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe_args)
