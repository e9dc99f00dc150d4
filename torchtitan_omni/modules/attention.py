"""Packed (document-masked) attention and the self-attention module shared by encoders and LLMs.

``varlen_attention`` computes attention within each document of a packed sequence:

- on CUDA through FlashAttention-2's varlen kernels, one launch for every document, called
  through aten's op by one operator, :func:`flash_varlen` (``torch.nn.attention.varlen``'s
  ``varlen_attn`` calls it inside two custom ops: ``scripts/bench_attention.py`` measured a
  third to two thirds less host time for aten's op called from an autograd function, this
  module's form until the forty-third session; one operator's host cost is not yet measured.
  Per-op activation checkpointing saves its output, while it recomputed ``varlen_attn``'s);
- when each row is a single document followed by padding (``AttentionMeta.whole_rows``:
  long-context rows), causal attention over the whole rows is exact for every real token and
  runs on ``scaled_dot_product_attention`` with the backends of :data:`ROW_BACKENDS` (cuDNN's
  Hopper kernels first: ``scripts/bench_attention.py`` measured them about twice as fast as the
  varlen kernel, ``docs/performance.md``);
- on CPU with ``scaled_dot_product_attention`` per document (exact, no block mask), or, inside
  ``torch.compile``, with a block-diagonal mask built on the device (traceable).

flash-attn is never required.

``SelfAttention`` splits its work into ``project`` (q/k/v projections, per-head norm and
RoPE), ``core`` (the attention itself) and ``wo``, and delegates their ordering to a runner.
The default runner is local; ``torchtitan_omni.distributed.ulysses`` installs runners that
insert the sequence-parallel all-to-alls (and overlap them with the projections).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan_omni.compat import flash_varlen_backward, flash_varlen_forward
from torchtitan_omni.modules import init
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.protocols.modules import AttentionMeta


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[T, Hkv, D]`` -> ``[T, Hkv * n_rep, D]`` (each kv head serves ``n_rep`` q heads)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


#: SDPA backends for whole-row attention, in order of preference (see the module docstring)
ROW_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    causal: bool, scale: float | None,
) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    bounds = cu_seqlens.tolist()
    if bounds[-1] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens covers {bounds[-1]} tokens but the sequence has {q.shape[0]}; under "
            "sequence parallel, attention must run on the gathered full sequence"
        )
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _attention_block_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    causal: bool, scale: float | None,
) -> torch.Tensor:
    """Attention under a block-diagonal (document) mask built from ``cu_seqlens`` on the
    device: no host reads, so ``torch.compile`` traces it. Memory grows as T^2: CPU only."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    pos = torch.arange(q.shape[0], device=q.device)
    doc = torch.searchsorted(cu_seqlens.to(q.device, torch.long)[1:], pos, right=True)
    mask = doc.unsqueeze(1) == doc.unsqueeze(0)
    if causal:
        mask = mask & (pos.unsqueeze(1) >= pos.unsqueeze(0))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


# An operator with its own backward, not a ``torch.autograd.Function``: inside a compiled block
# checkpointed as a whole, an autograd.Function's inputs and saved outputs were kept for the
# backward instead of recomputed (q and the attention's outputs of every layer; forty-third
# session), where an operator's are recomputed. Per-op checkpointing keeps its output.
@torch.library.custom_op(
    "torchtitan_omni::flash_varlen", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu, SymInt max_seqlen, bool causal, "
           "float? scale) -> (Tensor, Tensor, Tensor, Tensor)")
def flash_varlen(q, k, v, cu, max_seqlen, causal, scale):
    """Packed attention on FlashAttention-2's varlen kernels (CUDA, bf16/fp16) as
    :func:`varlen_attention` takes it, with ``cu`` int32 on the device: ``(out, logsumexp,
    rng_state, unused)`` (:func:`~torchtitan_omni.compat.flash_varlen_forward`). k/v keep their
    heads (the kernels serve grouped queries); the backward returns their gradients with
    those heads."""
    return flash_varlen_forward(q, k, v, cu, max_seqlen, causal, scale)


def _flash_grad(grad, q, k, v, out, lse, rng, unused, cu, max_seqlen, causal, scale):
    """``(dq, dk, dv)`` of :func:`flash_varlen` for the gradient ``grad`` of its output."""
    return flash_varlen_backward(grad.contiguous(), q, k, v, out, lse, rng, unused, cu,
                                 max_seqlen, causal, scale)


flash_varlen_grad = torch.library.custom_op(
    "torchtitan_omni::flash_varlen_backward", _flash_grad, mutates_args=(),
    schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor rng, "
           "Tensor unused, Tensor cu, SymInt max_seqlen, bool causal, float? scale) "
           "-> (Tensor, Tensor, Tensor)")
# the shapes come from aten's own fake kernels of the two flash ops, run by the same bodies
flash_varlen.register_fake(flash_varlen_forward)
flash_varlen_grad.register_fake(_flash_grad)


def _flash_setup(ctx, inputs, output) -> None:
    q, k, v, cu, max_seqlen, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu)
    ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale


def _flash_backward(ctx, grad, *_):
    q, k, v, out, lse, rng, unused, cu = ctx.saved_tensors
    dq, dk, dv = flash_varlen_grad(grad, q, k, v, out, lse, rng, unused, cu, ctx.max_seqlen,
                                   ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


flash_varlen.register_autograd(_flash_backward, setup_context=_flash_setup)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    max_seqlen: int, causal: bool = True, scale: float | None = None,
) -> torch.Tensor:
    """Attention within documents of a packed sequence.

    ``q`` is ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA),
    ``cu_seqlens`` int32 ``[N + 1]`` document boundaries over ``T``. Returns ``[T, Hq, D]``.
    """
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return flash_varlen(q, k, v, cu, max_seqlen, causal, scale)[0]
    if torch.compiler.is_compiling():
        return _attention_block_masked(q, k, v, cu_seqlens, causal, scale)
    return _attention_per_document(q, k, v, cu_seqlens, causal, scale)


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None = None) -> torch.Tensor:
    """Attention over whole rows: ``[B, S, Hq, D]`` q and ``[B, S, Hkv, D]`` k/v in, ``[B, S,
    Hq, D]`` out, on the first usable backend of :data:`ROW_BACKENDS`."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1:  # cuDNN has no kernel for grouped k/v heads (torch 2.11: "No available
        # kernel", scripts/bench_attention.py): each kv head is repeated for its q heads
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    with sdpa_kernel(ROW_BACKENDS, set_priority=True):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=causal, scale=scale)
    return o.transpose(1, 2)


class AttentionRunner(Protocol):
    """Orders a ``SelfAttention``'s projections, core attention and communication."""

    def __call__(
        self, attn: "SelfAttention", x: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor: ...


class KVCache:
    """Keys and values of every attention layer for incremental decoding.

    One entry per ``SelfAttention`` module, ``[B, T, Hkv, D]``, grown along T by each call.
    Rows are independent sequences of equal length (generation pads prompts to one length).
    """

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        """Cached positions (0 before the first call)."""
        return next(iter(self._kv.values()))[0].shape[1] if self._kv else 0

    def append(
        self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values for ``layer``; return all of them."""
        key = id(layer)
        if key in self._kv:
            pk, pv = self._kv[key]
            k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
        self._kv[key] = (k, v)
        return k, v

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (e.g. after a branch finishes)."""
        self._kv = {key: (k[rows], v[rows]) for key, (k, v) in self._kv.items()}


def _cached_attention(q, k, v, causal: bool) -> torch.Tensor:
    """``q`` ``[B, Sq, H, D]`` over the cache ``[B, T, Hkv, D]``; queries are the last Sq
    positions."""
    n_rep = q.shape[2] // k.shape[2]
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    sq, t = q.shape[1], k.shape[1]
    mask = None
    if causal and sq > 1:
        # query i (absolute position t - sq + i) sees keys 0 .. t - sq + i
        mask = torch.ones(sq, t, dtype=torch.bool, device=q.device).tril(diagonal=t - sq)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return o.transpose(1, 2)


def run_local(attn: "SelfAttention", x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """Single-rank attention: project, attend within documents (or over the KV cache), project
    out."""
    q, k, v = attn.project_qkv(x, meta)
    if meta.kv_cache is not None:
        k, v = meta.kv_cache.append(attn, k, v)
        o = _cached_attention(q, k, v, attn.causal and meta.causal)
    else:
        o = attn.core(q, k, v, meta)
    return attn.wo(o.flatten(-2))


class SelfAttention(nn.Module):
    """Multi-head self-attention with GQA, optional per-head q/k RMSNorm and RoPE.

    Parameters follow Hugging Face naming at this level (``wq/wk/wv/wo`` map to
    ``q_proj/k_proj/v_proj/o_proj`` in the state-dict adapters).
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
        *, qkv_bias: bool = False, out_bias: bool = False, qk_norm: bool = False,
        norm_eps: float = 1e-6, causal: bool = True, rope: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        self.head_dim = head_dim or dim // n_heads
        self.causal = causal
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=out_bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        # Shared with the model (not a submodule of this one: its tables are not weights).
        self._rope = [rope]
        self.runner: AttentionRunner = run_local

    @property
    def rope(self) -> RotaryEmbedding | None:
        return self._rope[0]

    def project(self, x: torch.Tensor, which: str, meta: AttentionMeta) -> torch.Tensor:
        """``[B, S, dim]`` -> q, k or v ``[B, S, heads, head_dim]``, normed and rotated."""
        linear = {"q": self.wq, "k": self.wk, "v": self.wv}[which]
        out = linear(x).unflatten(-1, (-1, self.head_dim))
        if which == "v":
            return out
        norm = self.q_norm if which == "q" else self.k_norm
        if norm is not None:
            out = norm(out)
        if self.rope is not None:
            out = self.rope(out, meta.position_ids)
        return out

    def project_qkv(self, x: torch.Tensor, meta: AttentionMeta) -> tuple[torch.Tensor, ...]:
        """q, k and v at once (modules with one fused projection override it: one GEMM)."""
        return self.project(x, "q", meta), self.project(x, "k", meta), self.project(x, "v", meta)

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor:
        """Attention over the full packed sequence: ``[B, S, H, D]`` in and out (or ``[T, H,
        D]``: one packed sequence without a batch dimension, as the encoders run)."""
        causal = self.causal and meta.causal
        if q.dim() == 3:
            return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=causal)
        if meta.whole_rows and causal and q.is_cuda:
            return row_attention(q, k, v, causal)
        b, s = q.shape[:2]
        o = varlen_attention(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), meta.cu_seqlens,
            meta.max_seqlen, causal=causal,
        )
        return o.unflatten(0, (b, s))

    def forward(self, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        return self.runner(self, x, meta)

    def init_weights(self, std: float, out_std: float | None = None) -> None:
        """Truncated-normal projections (``out_std`` for ``wo``), zero biases, unit norms."""
        for lin in (self.wq, self.wk, self.wv):
            init.trunc_normal_(lin.weight, std=std)
        init.trunc_normal_(self.wo.weight, std=std if out_std is None else out_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            if lin.bias is not None:
                init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                init.ones_(norm.weight)
