"""Qwen3-MoE foundation (defaults: Qwen3-30B-A3B).

Every layer: pre-norm GQA attention with per-head q/k RMSNorm and RoPE (theta 1e6, no
scaling), then a token-choice MoE (``torchtitan_omni.modules.moe``: softmax router, top-k
renormalized, grouped SwiGLU experts). Untied text head in the released checkpoints (a tied
one is supported). Weight names map onto Hugging Face
``Qwen3MoeForCausalLM`` checkpoints through ``torchtitan_omni.foundations.hf_adapters``.

Each block returns ``(hidden, RoutingStats)``; the foundation's (eager) forward keeps the
statistics of its last forward, outside the blocks, so a compiled block stays one pure graph.
``aux_losses()`` returns ``{"moe_aux": ...}``: the load-balancing loss of the last forward over
all layers, unweighted (``omni.moe_aux_loss_weight`` weighs it); ``moe_counts()`` the routed
and dropped copies per layer and expert, which the trainer logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from torchtitan_omni.foundations.hf_adapters import Qwen3MoeHFAdapter
from torchtitan_omni.foundations.qwen3 import Qwen3FamilyArgs, qwen3_attention
from torchtitan_omni.modules.moe import GroupedExperts, MoE, RoutingStats, load_balancing_loss
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.foundations.decoder import DecoderLM, PreNormBlock
from torchtitan_omni.protocols.modules import AttentionMeta

AUX_LOSS = "moe_aux"


@dataclass
class Qwen3MoeArgs(Qwen3FamilyArgs):
    """Qwen3-MoE hyper-parameters (defaults: Qwen3-30B-A3B)."""

    dim: int = 2048
    n_layers: int = 48
    n_kv_heads: int = 4
    num_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    norm_topk_prob: bool = True


class Qwen3MoeBlock(PreNormBlock):
    """Pre-norm attention (q/k norm) + MoE block."""

    ffn_attr = "moe"

    def __init__(self, layer_id: int, args: Qwen3MoeArgs, rope: RotaryEmbedding) -> None:
        moe = MoE(args.dim, args.moe_hidden_dim, args.num_experts, args.top_k, args.norm_topk_prob)
        super().__init__(layer_id, args, qwen3_attention(args, rope), moe)

    @property
    def compile_fullgraph(self) -> bool:
        """One graph, unless the dispatcher reads split sizes on the host (the exact
        expert-parallel all-to-all) or the experts are an FSDP unit of their own (sharded over
        ``ep`` and not left out of FSDP), whose hooks dynamo never traces: ``torch.compile``
        then breaks the graph there."""
        experts = cast(GroupedExperts, self.moe.experts)
        own_fsdp_unit = isinstance(experts.w1, DTensor) and not experts.outside_fsdp
        return not self.moe.dispatcher.host_sync and not own_fsdp_unit

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> tuple[torch.Tensor, RoutingStats]:
        x = x + self.attention(self.attention_norm(x), meta)
        out, stats = self.moe(self.ffn_norm(x))
        return x + out, stats


class Qwen3Moe(DecoderLM):
    """Token embedding, Qwen3-MoE blocks, final RMSNorm and the text head."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, lambda i, rope: Qwen3MoeBlock(i, args, rope))
        #: every layer's routing statistics of the last forward
        self.routing: list[RoutingStats] = []

    def forward(self, h: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        stats = []
        for layer in self.layers.values():
            h, layer_stats = layer(h, meta)
            stats.append(layer_stats)
        self.routing = stats
        return self.norm(h)

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The load-balancing loss of the last forward, pooled over all layers (HF's)."""
        if not self.routing:
            return {}
        return {AUX_LOSS: load_balancing_loss(self.routing, self.args.num_experts, self.args.top_k)}

    def moe_counts(self) -> torch.Tensor | None:
        """``[2, layers, experts]`` int64 of the last forward: routed (0) and dropped (1)."""
        if not self.routing:
            return None
        return torch.stack([torch.stack([s.routed, s.dropped]) for s in self.routing], dim=1)

    def hf_adapter(self):
        return Qwen3MoeHFAdapter(self.args)
