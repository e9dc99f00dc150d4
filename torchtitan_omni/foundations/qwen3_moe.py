"""Qwen3-MoE foundation (defaults: Qwen3-30B-A3B).

Every layer: pre-norm GQA attention with per-head q/k RMSNorm and RoPE (theta 1e6, no
scaling), then a token-choice MoE (``torchtitan_omni.modules.moe``: softmax router, top-k
renormalized, grouped SwiGLU experts). Untied text head in the released checkpoints (a tied
one is supported). Weight names map onto Hugging Face
``Qwen3MoeForCausalLM`` checkpoints through ``torchtitan_omni.foundations.hf_adapters``.

``aux_losses()`` returns ``{"moe_aux": ...}``: the load-balancing loss of the last forward over
all layers, unweighted (``omni.moe_aux_loss_weight`` weighs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.moe import MoE, load_balancing_loss
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.foundations.decoder import DecoderLM, DecoderLMArgs, PreNormBlock
from torchtitan_omni.protocols.modules import AttentionMeta

AUX_LOSS = "moe_aux"


@dataclass
class Qwen3MoeArgs(DecoderLMArgs):
    """Qwen3-MoE hyper-parameters (defaults: Qwen3-30B-A3B)."""

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 151936
    num_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    norm_topk_prob: bool = True
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


class Qwen3MoeBlock(PreNormBlock):
    """Pre-norm attention (q/k norm) + MoE block."""

    ffn_attr = "moe"
    #: the MoE layer keeps routing statistics on the module and, under expert parallel, reads
    #: split sizes on the host: torch.compile takes it in pieces (graph breaks)
    compile_fullgraph = False

    def __init__(self, layer_id: int, args: Qwen3MoeArgs, rope: RotaryEmbedding) -> None:
        attention = SelfAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, qkv_bias=args.attention_bias,
            out_bias=args.attention_bias, qk_norm=True, norm_eps=args.norm_eps, rope=rope,
        )
        moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, args.norm_topk_prob)
        super().__init__(layer_id, args, attention, moe)


class Qwen3Moe(DecoderLM):
    """Token embedding, Qwen3-MoE blocks, final RMSNorm and the text head."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, lambda i, rope: Qwen3MoeBlock(i, args, rope))

    def forward(self, h: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        for layer in self.layers.values():
            layer.moe.balance = None
        return super().forward(h, meta)

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The load-balancing loss of the last forward, pooled over all layers (HF's)."""
        records = [layer.moe.balance for layer in self.layers.values()]
        if any(r is None for r in records):
            return {}
        return {AUX_LOSS: load_balancing_loss(records, self.args.num_experts)}

    def hf_adapter(self):
        from torchtitan_omni.foundations.hf_adapters import Qwen3MoeHFAdapter

        return Qwen3MoeHFAdapter(self.args)
