"""Parameter and training-FLOP counts of an omni model, for TorchTitan's MFU figure.

Convention (TorchTitan's, so MFU figures compare with stock runs): a token costs
``6 x active non-embedding LLM parameters`` plus attention ``12 x layers x heads x head_dim x
context`` (forward + backward of QK^T and AV without the causal halving). MoE experts count
by ``top_k / num_experts``. :func:`batch_flops` refines this for a real batch: attention by the
actual document lengths.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _llm(model: nn.Module) -> nn.Module:
    return getattr(model, "llm", model)


def active_llm_params(model: nn.Module) -> float:
    """Non-embedding LLM parameters one token passes through (MoE experts by top_k/E)."""
    llm = _llm(model)
    total = 0.0
    seen: set[int] = set()
    for name, module in llm.named_modules():
        fraction = getattr(module, "active_fraction", None)
        if fraction is None:
            continue
        for p in module.parameters():
            seen.add(id(p))
            total += p.numel() * float(fraction)
    embedding = getattr(llm, "tok_embeddings", None)
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    for p in llm.parameters():
        if id(p) not in seen and id(p) not in skip:
            total += p.numel()
    return total


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, query heads, head_dim) of the LLM's attention."""
    llm = _llm(model)
    layers = list(llm.layers.values())
    attn = layers[0].attention
    return len(layers), attn.n_heads, attn.head_dim


def nparams_and_flops_per_token(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    """Total parameters of the whole omni model and LLM training FLOPs per token."""
    del args
    nparams = sum(p.numel() for p in model.parameters())
    layers, heads, head_dim = attention_shape(model)
    flops = 6 * active_llm_params(model) + 12 * layers * heads * head_dim * seq_len
    return nparams, int(flops)


class FlopCounter:
    """Training FLOPs of the LLM for real packed micro-batches (shapes cached once)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers, self.heads, self.head_dim = attention_shape(model)
        self.active_params = active_llm_params(model)

    def batch(self, cu_seqlens: torch.Tensor, sp_degree: int = 1) -> float:
        """FLOPs of one micro-batch per sequence-parallel rank.

        Attention is counted by the documents' real lengths (causal: each query sees its
        prefix, ``sum_d len_d (len_d + 1) / 2`` query-key pairs, 4 flops x head_dim x heads x
        layers each, times 3 for forward + backward).
        """
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
        tokens = float(lengths.sum())
        pairs = float((lengths * (lengths + 1) / 2).sum())
        attention = 3 * 4 * self.layers * self.heads * self.head_dim * pairs
        dense = 6 * self.active_params * tokens
        return (dense + attention) / sp_degree
