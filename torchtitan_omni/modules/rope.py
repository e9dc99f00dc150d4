"""Rotary position embeddings indexed by per-document position ids (Llama-3 scaling optional)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class RopeScaling:
    """Llama-3.1 frequency scaling (``rope_type = "llama3"`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float64-accurate float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_positions)``; rotates with the "half" layout.

    The half layout (first half of each head paired with the second) is Hugging Face's
    ``rotate_half`` convention, so HF checkpoints load without permuting q/k weights.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float = 10000.0,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)compute the tables on ``buffer_device`` (or where the buffers live)."""
        device = buffer_device or self.cos.device
        if device.type == "meta":
            return
        inv = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, S, H, D]`` by positions ``[B, S]`` (< ``max_positions``; the
        data pipeline guarantees it, and no check here keeps the GPU free of host syncs)."""
        cos = self.cos[position_ids].unsqueeze(2).to(x.dtype)
        sin = self.sin[position_ids].unsqueeze(2).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
