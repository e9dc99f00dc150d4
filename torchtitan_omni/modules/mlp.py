"""Feed-forward blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.modules import init


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` (Llama/Qwen MLP; HF names gate_proj=w1, up_proj=w3,
    down_proj=w2)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Truncated-normal weights (``out_std`` for the output projection), zero biases."""
        init.trunc_normal_(self.w1.weight, std=std)
        init.trunc_normal_(self.w3.weight, std=std)
        init.trunc_normal_(self.w2.weight, std=std if out_std is None else out_std)
        for lin in (self.w1, self.w2, self.w3):
            if lin.bias is not None:
                init.zeros_(lin.bias)


class GeluMLP(nn.Module):
    """``fc2(gelu(fc1 x))`` (ViT/Whisper/SigLIP MLP)."""

    def __init__(self, dim: int, hidden_dim: int, out_dim: int | None = None,
                 approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))

    def init_weights(self, std: float = 0.02) -> None:
        """Truncated-normal weights, zero biases."""
        for lin in (self.fc1, self.fc2):
            init.trunc_normal_(lin.weight, std=std)
            init.zeros_(lin.bias)
