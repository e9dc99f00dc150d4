"""Llama-3 foundation (also the LLM of Janus, whose DeepSeek-LLM is Llama-shaped).

Written for packed sequences (per-document positions and attention) and for Ulysses: its
attention is ``torchtitan_omni.modules.attention.SelfAttention``. Weight names map one-to-one
onto Hugging Face ``LlamaForCausalLM`` (see ``torchtitan_omni.foundations.hf_adapters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from torchtitan_omni.modules import init
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.mlp import SwiGLU
from torchtitan_omni.modules.rope import RopeScaling, RotaryEmbedding
from torchtitan_omni.protocols.modules import AttentionMeta, Foundation


@dataclass
class Llama3Args:
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


class Llama3Block(nn.Module):
    """Pre-norm attention + SwiGLU block."""

    def __init__(self, layer_id: int, args: Llama3Args, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = SelfAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.resolved_head_dim,
            qkv_bias=args.attention_bias, out_bias=args.attention_bias, rope=rope,
        )
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)
        n = (layer_id + 1) if args.depth_init else args.n_layers
        self.out_std = 0.02 / (2 * n) ** 0.5

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), meta)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self) -> None:
        init.ones_(self.attention_norm.weight)
        init.ones_(self.ffn_norm.weight)
        self.attention.init_weights(0.02, self.out_std)
        self.feed_forward.init_weights(0.02, self.out_std)


class Llama3(Foundation):
    """Token embedding, Llama-3 blocks, final RMSNorm and the text head."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.dim = args.dim
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(
            args.resolved_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
        )
        self.layers = nn.ModuleDict(
            {str(i): Llama3Block(i, args, self.rope) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, h: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, meta)
        return self.norm(h)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.rope.init_weights(buffer_device)
        init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        init.ones_(self.norm.weight)
        cutoff = 3 * self.args.dim**-0.5
        init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)

    def hf_adapter(self):
        from torchtitan_omni.foundations.hf_adapters import Llama3HFAdapter

        return Llama3HFAdapter(self.args)
