"""Hugging Face checkpoint naming of the foundations (``HFAdapter`` declarations).

- ``Llama3HFAdapter``: ``LlamaForCausalLM`` (Llama-3, and the DeepSeek-LLM inside Janus).
- ``Qwen3HFAdapter``: ``Qwen3ForCausalLM`` (Qwen3 dense): Llama's names plus the per-head
  ``self_attn.{q,k}_norm``.
- ``Qwen3MoeHFAdapter``: ``Qwen3MoeForCausalLM`` checkpoints, whose experts are stored one
  tensor per expert (``model.layers.N.mlp.experts.E.gate_proj.weight``; transformers 5.x fuses
  them in memory, but ``save_pretrained`` and the hub keep per-expert keys). They stack on dim 0
  into our grouped ``w1`` (gate), ``w3`` (up) and ``w2`` (down), with no transpose: an HF
  ``Linear`` weight is ``[out, in]``, as is each expert slice of ours.

Our RoPE uses HF's ``rotate_half`` layout, so q/k projections load without permutation.
Tensor names are relative to the foundation (e.g. ``layers.0.attention.wq.weight``). A tied
head (``tie_word_embeddings``) has no source of its own: it is the embedding, and checkpoints
of tied models have no ``lm_head.weight`` (one that has it anyway is ignored). When the
tokenizer gained tokens, the embedding and head sources say how many rows the checkpoint has
and which rows start as the mean (``HFSource.hf_rows``, ``mean_rows``).
"""

from __future__ import annotations

from torchtitan_omni.protocols.hf import HFAdapter, HFSource


def _one(key: str) -> HFSource:
    return HFSource(keys=(key,))


def _attention_sources(ours: str, hf: str, bias: bool, qk_norm: bool) -> dict[str, HFSource]:
    """``SelfAttention`` at ``ours`` <- HF ``self_attn`` at ``hf`` (both prefixes end in '.')."""
    out = {}
    for mine, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        out[f"{ours}{mine}.weight"] = _one(f"{hf}{theirs}.weight")
        if bias:
            out[f"{ours}{mine}.bias"] = _one(f"{hf}{theirs}.bias")
    if qk_norm:
        out[f"{ours}q_norm.weight"] = _one(f"{hf}q_norm.weight")
        out[f"{ours}k_norm.weight"] = _one(f"{hf}k_norm.weight")
    return out


class _DecoderLMHFAdapter(HFAdapter):
    """``DecoderLM`` <-> a Hugging Face ``*ForCausalLM``: embedding, final norm, head, and per
    layer the two norms and the attention; subclasses add each layer's feed-forward."""

    #: whether the attention has per-head q/k norms
    qk_norm = False

    def __init__(self, args) -> None:
        self.args = args

    def layer_ffn_sources(self, ours: str, hf: str) -> dict[str, HFSource]:
        """The feed-forward of the layer at ``ours`` <- HF ``mlp`` under ``hf`` (prefixes end
        in '.')."""
        raise NotImplementedError

    def _vocab_source(self, key: str) -> HFSource:
        """An embedding-shaped tensor: the checkpoint may have fewer rows than ours."""
        a = self.args
        rows = a.hf_vocab_size if a.hf_vocab_size not in (None, a.vocab_size) else None
        return HFSource(keys=(key,), hf_rows=rows, mean_rows=a.added_token_rows)

    def sources(self) -> dict[str, HFSource]:
        a = self.args
        out = {
            "tok_embeddings.weight": self._vocab_source("model.embed_tokens.weight"),
            "norm.weight": _one("model.norm.weight"),
        }
        if not a.tie_word_embeddings:
            out["output.weight"] = self._vocab_source("lm_head.weight")
        for i in range(a.n_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            out[f"{ours}attention_norm.weight"] = _one(f"{hf}input_layernorm.weight")
            out[f"{ours}ffn_norm.weight"] = _one(f"{hf}post_attention_layernorm.weight")
            out.update(_attention_sources(f"{ours}attention.", f"{hf}self_attn.", a.attention_bias,
                                          self.qk_norm))
            out.update(self.layer_ffn_sources(ours, hf))
        return out

    def ignored_hf_keys(self) -> tuple[str, ...]:
        # a tied checkpoint saved with its head anyway holds a copy of the embedding
        tied = ("lm_head.weight",) if self.args.tie_word_embeddings else ()
        return ("model.layers.*.self_attn.rotary_emb.inv_freq",) + tied


def _swiglu_sources(ours: str, hf: str) -> dict[str, HFSource]:
    """``SwiGLU`` at ``ours``feed_forward <- HF ``mlp`` under ``hf`` (gate, up, down)."""
    return {f"{ours}feed_forward.{mine}.weight": _one(f"{hf}mlp.{theirs}.weight")
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}


class Llama3HFAdapter(_DecoderLMHFAdapter):
    """``Llama3`` <-> ``LlamaForCausalLM``."""

    def layer_ffn_sources(self, ours: str, hf: str) -> dict[str, HFSource]:
        return _swiglu_sources(ours, hf)

    def hf_config(self) -> dict:
        a = self.args
        if a.rope_scaling is not None:
            s = a.rope_scaling
            rope = {
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        else:
            rope = None
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.resolved_head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": rope,
            # metadata only (the RoPE tables follow rope_scaling): the length we were built for
            "max_position_embeddings": a.max_seq_len,
            "attention_bias": a.attention_bias,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": a.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }


class Qwen3HFAdapter(_DecoderLMHFAdapter):
    """``Qwen3`` <-> ``Qwen3ForCausalLM``."""

    qk_norm = True

    def layer_ffn_sources(self, ours: str, hf: str) -> dict[str, HFSource]:
        return _swiglu_sources(ours, hf)

    def hf_config(self) -> dict:
        a = self.args
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": a.max_seq_len,
            "attention_bias": a.attention_bias,
            # every layer attends over whole documents (ours has no sliding window; neither do
            # the released Qwen3 dense configs)
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "hidden_act": "silu",
            "tie_word_embeddings": a.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }


class Qwen3MoeHFAdapter(_DecoderLMHFAdapter):
    """``Qwen3Moe`` <-> ``Qwen3MoeForCausalLM`` (per-expert checkpoint keys)."""

    qk_norm = True

    def layer_ffn_sources(self, ours: str, hf: str) -> dict[str, HFSource]:
        out = {f"{ours}moe.gate.weight": _one(f"{hf}mlp.gate.weight")}
        for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            keys = tuple(
                f"{hf}mlp.experts.{e}.{theirs}.weight" for e in range(self.args.num_experts)
            )
            out[f"{ours}moe.experts.{mine}"] = HFSource(keys=keys, stack_dim=0)
        return out

    def hf_config(self) -> dict:
        a = self.args
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "num_experts": a.num_experts,
            "num_experts_per_tok": a.top_k,
            "moe_intermediate_size": a.moe_hidden_dim,
            # Unused (every layer is sparse); HF's config needs a value for dense layers.
            "intermediate_size": a.moe_hidden_dim * a.top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": a.norm_topk_prob,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": a.max_seq_len,
            "attention_bias": a.attention_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": a.tie_word_embeddings,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "torch_dtype": "bfloat16",
        }
