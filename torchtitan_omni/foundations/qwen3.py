"""Qwen3 dense foundation (defaults: Qwen3-8B).

Every layer: pre-norm GQA attention with per-head q/k RMSNorm (before RoPE), an explicit
``head_dim`` (q/k/v widths need not equal the model width), no q/k/v bias and RoPE theta 1e6
without scaling; then a SwiGLU feed-forward, as in Llama. Untied text head in Qwen3-8B, 14B
and 32B; 0.6B-4B tie it to the embedding (``tie_word_embeddings``). Weight names map onto
Hugging Face ``Qwen3ForCausalLM`` through ``torchtitan_omni.foundations.hf_adapters``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_omni.foundations.decoder import DecoderLM, DecoderLMArgs, PreNormBlock
from torchtitan_omni.foundations.hf_adapters import Qwen3HFAdapter
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.mlp import SwiGLU
from torchtitan_omni.modules.rope import RotaryEmbedding


@dataclass
class Qwen3FamilyArgs(DecoderLMArgs):
    """What Qwen3 dense and Qwen3-MoE arguments share: the attention's shape (GQA with an
    explicit ``head_dim`` and per-head q/k RMSNorm), RoPE and the vocabulary. The defaults are
    Qwen3-8B's; a subclass overrides those its checkpoint differs in."""

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    #: RoPE table length (HF max_position_embeddings); raised to training.seq_len if shorter
    max_seq_len: int = 40960
    attention_bias: bool = False
    #: depth-scaled init of output projections (TorchTitan's default)
    depth_init: bool = True

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim


@dataclass
class Qwen3Args(Qwen3FamilyArgs):
    """Qwen3 dense hyper-parameters (defaults: Qwen3-8B's config.json)."""

    ffn_hidden_dim: int = 12288


def qwen3_attention(args: Qwen3FamilyArgs, rope: RotaryEmbedding) -> SelfAttention:
    """Qwen3's attention (dense and MoE alike): GQA with per-head q/k RMSNorm."""
    return SelfAttention(
        args.dim, args.n_heads, args.n_kv_heads, args.head_dim, qkv_bias=args.attention_bias,
        out_bias=args.attention_bias, qk_norm=True, norm_eps=args.norm_eps, rope=rope,
    )


class Qwen3Block(PreNormBlock):
    """Pre-norm attention (q/k norm) + SwiGLU block."""

    def __init__(self, layer_id: int, args: Qwen3Args, rope: RotaryEmbedding) -> None:
        super().__init__(layer_id, args, qwen3_attention(args, rope),
                         SwiGLU(args.dim, args.ffn_hidden_dim))


class Qwen3(DecoderLM):
    """Token embedding, Qwen3 blocks, final RMSNorm and the text head."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, lambda i, rope: Qwen3Block(i, args, rope))

    def hf_adapter(self):
        return Qwen3HFAdapter(self.args)
