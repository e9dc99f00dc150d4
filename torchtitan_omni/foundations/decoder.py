"""The decoder-only LM skeleton shared by the foundations.

``PreNormBlock``: ``x + attention(norm(x))`` then ``x + ffn(norm(x))``, with TorchTitan's
depth-scaled init of the output projections. ``DecoderLM``: token embedding, blocks, final
RMSNorm and the text head (a ``LinearHead``: logits, or the summed loss computed chunk by
chunk), RoPE tables shared by every block. The head is its own weight, or, with
``tie_word_embeddings``, the embedding's (one parameter, as Llama-3.2-1B/3B and Qwen3-0.6B-4B
ship it). A foundation supplies its args (a ``DecoderLMArgs``) and a block factory (Llama-3:
SwiGLU blocks; Qwen3-MoE: q/k-normed attention + MoE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from torchtitan_omni.modules import init
from torchtitan_omni.modules.linear_cross_entropy import LinearHead
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.protocols.modules import AttentionMeta, Foundation


@dataclass
class DecoderLMArgs:
    """What every foundation's args share besides their shape: the head's tie to the embedding
    and how the vocabulary relates to the Hugging Face checkpoint it loads."""

    #: the text head is the token embedding's weight (one parameter; no ``lm_head.weight``)
    tie_word_embeddings: bool = False
    #: rows of the embedding (and head) in the Hugging Face checkpoint when fewer than
    #: ``vocab_size`` (tokens were added); None: ``vocab_size``
    hf_vocab_size: int | None = None
    #: ``[start, stop)``: rows of the tokens added to the tokenizer (the omni special tokens it
    #: lacked); loading a Hugging Face checkpoint sets them to the mean of rows ``[0, start)``
    added_token_rows: tuple[int, int] | None = None
    #: the block count the flavor declares, remembered when ``omni.llm_layers`` keeps fewer
    #: (TorchTitan updates the registered args in place); None: ``n_layers``
    flavor_n_layers: int | None = field(default=None, compare=False, repr=False)


class PreNormBlock(nn.Module):
    """Pre-norm attention + feed-forward block; the feed-forward sits at ``ffn_attr``."""

    #: attribute name of the feed-forward (kept per foundation for checkpoint names)
    ffn_attr = "feed_forward"

    def __init__(self, layer_id: int, args, attention: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        setattr(self, self.ffn_attr, ffn)
        n = (layer_id + 1) if args.depth_init else args.n_layers
        self.out_std = 0.02 / (2 * n) ** 0.5

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_attr)

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), meta)
        return x + self.ffn(self.ffn_norm(x))

    def init_weights(self) -> None:
        init.ones_(self.attention_norm.weight)
        init.ones_(self.ffn_norm.weight)
        self.attention.init_weights(0.02, self.out_std)
        self.ffn.init_weights(0.02, self.out_std)


class DecoderLM(Foundation):
    """Token embedding, ``args.n_layers`` blocks, final RMSNorm and the text head (tied to the
    embedding when ``args.tie_word_embeddings``)."""

    output: LinearHead

    def __init__(self, args, make_block: Callable[[int, RotaryEmbedding], nn.Module],
                 rope_scaling=None) -> None:
        super().__init__()
        self.args = args
        self.dim = args.dim
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(
            args.resolved_head_dim, args.max_seq_len, args.rope_theta, rope_scaling
        )
        self.layers = nn.ModuleDict(
            {str(i): make_block(i, self.rope) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # head(hidden, targets) gives the summed loss without keeping every logit
        self.output = LinearHead(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def tied(self) -> bool:
        """Whether the text head is the token embedding's weight."""
        return bool(getattr(self.args, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        """Make the head use the embedding's weight (tied models). ``to_empty`` without FSDP
        gives each module its own tensor, so ``OmniModel.init_weights`` ties again."""
        if self.tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, h: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        for layer in self.layers.values():
            h = layer(h, meta)
        return self.norm(h)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.rope.init_weights(buffer_device)
        if not self.tied:
            init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        init.ones_(self.norm.weight)
        # A tied weight takes the head's init: unit-variance rows would make the first logits
        # sqrt(dim) large, while the blocks' RMSNorm rescales a small embedding anyway.
        cutoff = 3 * self.args.dim**-0.5
        init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5, a=-cutoff, b=cutoff)
