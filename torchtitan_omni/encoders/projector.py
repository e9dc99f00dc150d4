"""Projectors between an encoder (or a codebook) and the LLM width.

- ``MLPProjector``: linear layers with GELU between them. Depth 1 is Qwen2-Audio's projector,
  depth 2 Janus' understanding aligner, generation aligner and generation head, and the MLP of
  Qwen2-VL's patch merger.
- ``PatchMerger``: Qwen2-VL's 2x2 merger, a LayerNorm on each patch then an MLP over each
  ``merge x merge`` window of consecutive rows.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.modules import init
from torchtitan_omni.modules.lora import is_lora
from torchtitan_omni.modules.linear_cross_entropy import linear_cross_entropy


class MLPProjector(nn.Module):
    """``in_dim -> hidden_dim -> ... -> out_dim``: ``depth`` linears, GELU between them."""

    def __init__(
        self, in_dim: int, out_dim: int, hidden_dim: int | None = None, depth: int = 2,
        approximate: str = "none",
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"projector depth must be at least 1, got {depth}")
        hidden = hidden_dim or out_dim
        dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.approximate = approximate

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The output, or with ``targets`` the summed cross-entropy of the output taken as
        logits, computed chunk by chunk without keeping them (a prediction head)."""
        *hidden, last = self.layers
        for i, layer in enumerate(hidden):
            x = layer(x if i == 0 else F.gelu(x, approximate=self.approximate))
        if hidden:
            x = F.gelu(x, approximate=self.approximate)
        if targets is None:
            return last(x)
        if is_lora(last):
            # an adapted layer computes through its own forward, so the loss takes its logits
            # (float32, summed like linear_cross_entropy)
            return F.cross_entropy(last(x).float(), targets, reduction="sum")
        return linear_cross_entropy(x, last.weight, targets, last.bias)

    def init_weights(self, std: float = 0.02) -> None:
        """Truncated-normal weights, zero biases."""
        for layer in self.layers:
            init.trunc_normal_(layer.weight, std=std)
            init.zeros_(layer.bias)


class PatchMerger(nn.Module):
    """LayerNorm per patch, then an MLP over each window of ``merge**2`` consecutive rows."""

    def __init__(self, dim: int, out_dim: int, merge_size: int = 2, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.window = merge_size**2
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = MLPProjector(dim * self.window, out_dim, hidden_dim=dim * self.window, depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, dim]`` patches in merge-window order -> ``[N / merge**2, out_dim]``."""
        x = self.norm(x)
        return self.mlp(x.reshape(-1, x.shape[-1] * self.window))

    def init_weights(self, std: float = 0.02) -> None:
        """Unit LayerNorm, truncated-normal MLP."""
        init.ones_(self.norm.weight)
        init.zeros_(self.norm.bias)
        self.mlp.init_weights(std)
