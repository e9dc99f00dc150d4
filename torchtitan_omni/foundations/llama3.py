"""Llama-3 foundation (also the LLM of Janus, whose DeepSeek-LLM is Llama-shaped).

Written for packed sequences (per-document positions and attention) and for Ulysses: its
attention is ``torchtitan_omni.modules.attention.SelfAttention``. Weight names map one-to-one
onto Hugging Face ``LlamaForCausalLM`` (see ``torchtitan_omni.foundations.hf_adapters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


from torchtitan_omni.foundations.hf_adapters import Llama3HFAdapter
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.mlp import SwiGLU
from torchtitan_omni.modules.rope import RopeScaling, RotaryEmbedding
from torchtitan_omni.foundations.decoder import DecoderLM, DecoderLMArgs, PreNormBlock


@dataclass
class Llama3Args(DecoderLMArgs):
    """Llama-3 hyper-parameters (defaults: Llama-3.1-8B)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int | None = None
    vocab_size: int = 128256
    ffn_hidden_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_seq_len: int = 8192
    attention_bias: bool = False
    #: depth-scaled init of output projections (TorchTitan's default)
    depth_init: bool = True

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads


class Llama3Block(PreNormBlock):
    """Pre-norm attention + SwiGLU block."""

    def __init__(self, layer_id: int, args: Llama3Args, rope: RotaryEmbedding) -> None:
        attention = SelfAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.resolved_head_dim,
            qkv_bias=args.attention_bias, out_bias=args.attention_bias, rope=rope,
        )
        super().__init__(layer_id, args, attention, SwiGLU(args.dim, args.ffn_hidden_dim))


class Llama3(DecoderLM):
    """Token embedding, Llama-3 blocks, final RMSNorm and the text head."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args, lambda i, rope: Llama3Block(i, args, rope), args.rope_scaling)

    def hf_adapter(self):
        return Llama3HFAdapter(self.args)
