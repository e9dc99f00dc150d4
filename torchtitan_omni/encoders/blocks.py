"""Pieces shared by the encoders: the pre-LN transformer block, a fused-qkv attention, the
quick-GELU MLP, the 2-D rotary's application, and the attention metadata of a packed sequence
of items.

Every encoder packs its items (images, frames, clips) into one sequence ``[T, dim]`` and
attends within each item through ``torchtitan_omni.modules.attention.varlen_attention``, so an
item never sees another one and padding never takes part. The sequence has no batch dimension:
each linear is then one ``addmm`` without the two reshapes around it, in the forward and in the
backward (eager encoders are launch-bound, ``docs/performance.md``). Ulysses' runners, which
split ``[B, S, ...]`` along S, serve the LLM's attention only: the encoders split their items
between ranks instead (``parallelism.encoder_sequence_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.modules import init
from torchtitan_omni.modules.host import to_device
from torchtitan_omni.modules.lora import is_lora
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.mlp import GeluMLP
from torchtitan_omni.protocols.modules import AttentionMeta


def packed_meta(
    lengths: Sequence[int], device: torch.device, position_ids: torch.Tensor | None = None,
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AttentionMeta:
    """Bidirectional attention metadata for items of these lengths packed back to back into a
    sequence ``[T, dim]`` (``position_ids`` ``[T, ...]``; ``rope_tables``: see
    ``AttentionMeta``)."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    cu = to_device(bounds, device, torch.int32)
    if position_ids is None:
        # No rotary embedding reads them; kept for the AttentionMeta contract.
        position_ids = torch.zeros(bounds[-1], dtype=torch.long, device=device)
    return AttentionMeta(
        cu_seqlens=cu, max_seqlen=max((int(n) for n in lengths), default=0),
        position_ids=position_ids, causal=False, rope_tables=rope_tables,
    )


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` ``[..., S, H, D]`` ("rotate half" pairing) by ``tables = (cos, sin)``
    ``[..., S, 1, D]``, where ``sin`` carries the sign of the first half (``-sin``, ``sin``).

    ``rotate_half(x) * sin`` equals ``roll(x, D / 2) * signed_sin`` bit for bit (a sign is
    exact), and the roll is one op against four (two slices, a negation, a cat), also in the
    backward. The maths runs in float32 (float64 for a float64 ``x``), as Hugging Face's
    vision towers do; the result has ``x``'s dtype.
    """
    cos, sin = tables
    xf = x if x.dtype == torch.float64 else x.float()  # no op for float32 (not even dispatched)
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


class RotaryTables(Protocol):
    """A rotary embedding that gives ``apply_rotary``'s tables of positions (``VisionRotary2D``)."""

    def tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class QuickGeluMLP(GeluMLP):
    """``fc2(quick_gelu(fc1 x))`` with ``quick_gelu(x) = x * sigmoid(1.702 x)`` (CLIP, Qwen2-VL)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class FusedQKVAttention(SelfAttention):
    """Bidirectional multi-head attention whose q, k and v projections are one ``qkv`` linear.

    Hugging Face vision towers (Qwen2-VL) store one fused ``qkv`` tensor; keeping it fused lets
    a checkpoint map one-to-one. ``project`` reads the q, k or v rows of the fused weight, so
    the runner contract of ``SelfAttention`` (project / core / wo) is unchanged.

    ``rope`` (optional, a :class:`RotaryTables`): the tables come from ``meta.rope_tables``
    when the encoder computed them once for all its blocks.
    """

    def __init__(self, dim: int, n_heads: int, rope: nn.Module | None = None) -> None:
        super().__init__(dim, n_heads, qkv_bias=True, out_bias=True, causal=False, rope=rope)
        del self.wq, self.wk, self.wv
        self.qkv = nn.Linear(dim, 3 * n_heads * self.head_dim, bias=True)

    def rope_tables(self, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of ``meta``: the encoder's, or computed here from its positions."""
        if meta.rope_tables is not None:
            return meta.rope_tables
        return cast(RotaryTables, self.rope).tables(meta.position_ids)

    def project(self, x: torch.Tensor, which: str, meta: AttentionMeta) -> torch.Tensor:
        i = "qkv".index(which)
        width = self.n_heads * self.head_dim
        rows = slice(i * width, (i + 1) * width)
        if is_lora(self.qkv):  # an adapted projection computes through its own forward
            out = self.qkv(x)[..., rows]
        else:
            out = F.linear(x, self.qkv.weight[rows], self.qkv.bias[rows])
        out = out.unflatten(-1, (-1, self.head_dim))
        if which != "v" and self.rope is not None:
            out = apply_rotary(out, self.rope_tables(meta))
        return out

    def project_qkv(self, x: torch.Tensor, meta: AttentionMeta) -> tuple[torch.Tensor, ...]:
        """One GEMM for q, k and v, then one rotation of q and k together."""
        qkv = self.qkv(x).unflatten(-1, (-1, self.head_dim))  # [..., S, 3H, D]
        if self.rope is None:
            return qkv.chunk(3, dim=-2)
        qk, v = qkv.split((2 * self.n_heads, self.n_heads), dim=-2)
        q, k = apply_rotary(qk, self.rope_tables(meta)).chunk(2, dim=-2)
        return q, k, v

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Truncated-normal ``qkv`` and ``wo`` (``out_std`` for ``wo``), zero biases."""
        init.trunc_normal_(self.qkv.weight, std=std)
        init.zeros_(self.qkv.bias)
        init.trunc_normal_(self.wo.weight, std=std if out_std is None else out_std)
        init.zeros_(self.wo.bias)


class EncoderBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, attn: SelfAttention, mlp: GeluMLP, norm_eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), meta)
        return x + self.mlp(self.norm2(x))

    def init_weights(self, std: float = 0.02) -> None:
        """Unit LayerNorms, truncated-normal projections, zero biases."""
        for norm in (self.norm1, self.norm2):
            init_layer_norm(norm)
        self.attn.init_weights(std)
        self.mlp.init_weights(std)


def init_layer_norm(norm: nn.LayerNorm) -> None:
    """Weight one, bias zero."""
    init.ones_(norm.weight)
    if norm.bias is not None:
        init.zeros_(norm.bias)


class EncoderStack(nn.ModuleList):
    """An encoder's blocks, applied in order to a packed sequence ``[T, dim]`` (each block
    stays its own FSDP, activation-checkpoint and compile unit)."""

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        for block in self:
            x = block(x, meta)
        return x
