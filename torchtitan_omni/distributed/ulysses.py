"""Ulysses sequence parallel: attention runners that swap a split sequence for split heads.

Each SP rank holds a contiguous slice ``[B, S/P, dim]`` of every row. The runner projects its
slice to q/k/v (per-head norm and RoPE use the slice's own ``position_ids``), all-to-all turns
``[B, S/P, H, D]`` into ``[B, S, H/P, D]`` (the full sequence for ``H/P`` heads), the module's
``core`` attends over the full packed sequence (``meta.cu_seqlens`` describes it), and the
reverse all-to-all returns ``[B, S/P, H, D]`` for the output projection.

GQA with fewer kv heads than the degree (or a count it does not divide): kv heads are repeated
(``repeat_interleave``, as attention itself pairs them with q heads) until each rank receives
whole kv heads for its q heads; the repeat's backward sums the copies' gradients.

:class:`AsyncUlyssesRunner` gives the same numbers and overlaps communication with compute.
With the heads in one group: q's all-to-all runs during the k projection, k's during the v
projection, v's while q and k are unpacked; in backward the output projection's input
gradient travels while its weight gradient is computed, and v's, k's and q's gradient
all-to-alls overlap the v, k and q projection gradients. Those projections are short next to
the exchanges, so little is hidden. With the heads in ``C`` groups
(``parallelism.ulysses_async_head_chunks``) the runner pipelines them: group ``c + 1``'s q/k/v
exchange runs while group ``c`` attends, and group ``c``'s output returns while group ``c + 1``
attends; in backward each group's gradient exchanges run during another group's attention
backward. Attention is the long part of a long-context layer, so all but about ``1 / C`` of the
exchanges can hide behind it. Each group gives every rank whole q heads and their kv heads, so
``C x degree`` must divide the q heads and the (repeated) kv heads.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn

from torchtitan_omni.compat import has_forward_hooks
from torchtitan_omni.distributed.comm import (
    PendingAllToAll,
    ProcessGroup,
    all_to_all,
    all_to_all_linear,
    all_to_all_start,
    all_to_all_wait,
)
from torchtitan_omni.protocols.modules import AttentionMeta

if TYPE_CHECKING:
    from torchtitan_omni.modules.attention import SelfAttention

SEQ_DIM, HEAD_DIM = 1, 2  # of [B, S, H, D]


def kv_replication(n_heads: int, n_kv_heads: int, degree: int) -> int:
    """How many times to repeat each kv head so that ``degree`` ranks get whole kv heads.

    Requires ``degree | n_heads``; then the factor ``degree / gcd(n_kv_heads, degree)`` always
    divides ``n_heads / n_kv_heads``, so q heads still pair with their own kv heads.
    """
    if n_heads % degree:
        raise ValueError(
            f"Ulysses degree {degree} does not divide the {n_heads} attention heads"
        )
    return degree // math.gcd(n_kv_heads, degree)


#: read by ``ProcessGroupNCCL`` when it makes its streams: "1" puts collectives on
#: high-priority streams
NCCL_HIGH_PRIORITY_ENV = "TORCH_NCCL_HIGH_PRIORITY"


def prefer_high_priority_exchanges() -> str:
    """Ask NCCL for high-priority streams, unless the launch's environment already says
    (``TORCH_NCCL_HIGH_PRIORITY=0`` keeps the default streams); returns the value in force.
    Call it before any process group is made. Why: attention kernels fill every SM, and the
    blocks of an exchange queued on a normal-priority stream wait for SMs to free up, so the
    exchange runs after the attention it should hide behind; on a high-priority stream its
    blocks go first (2x H200, NCCL through host memory: head groups 1.04x sync on default
    streams, 1.12x on high-priority ones)."""
    return os.environ.setdefault(NCCL_HIGH_PRIORITY_ENV, "1")


#: the group counts tried, most first, when ``ulysses_async_head_chunks`` is 0 (automatic)
AUTO_HEAD_CHUNKS = (4, 2)


def head_chunks(n_heads: int, n_kv_heads: int, degree: int, want: int) -> int:
    """How many head groups the async runner pipelines: ``want``, or with ``want`` 0 the
    most of :data:`AUTO_HEAD_CHUNKS` that fits, else 1. A count fits when every group gives
    each of the ``degree`` ranks whole q heads and whole (repeated) kv heads; a ``want`` that
    does not fit is refused (``ValueError``)."""
    kv = n_kv_heads * kv_replication(n_heads, n_kv_heads, degree)

    def fits(c: int) -> bool:
        return n_heads % (c * degree) == 0 and kv % (c * degree) == 0

    if want < 0:
        raise ValueError(f"parallelism.ulysses_async_head_chunks must be >= 0, got {want}")
    if want == 0:
        return next((c for c in AUTO_HEAD_CHUNKS if fits(c)), 1)
    if not fits(want):
        raise ValueError(
            f"parallelism.ulysses_async_head_chunks ({want}) x ulysses_degree ({degree}) must "
            f"divide the {n_heads} q heads and the {kv} kv heads (after the GQA repeat); "
            "0 picks the most that fits")
    return want


def _repeat_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=HEAD_DIM)


class UlyssesRunner:
    """Synchronous Ulysses attention over the ranks of ``group`` (the ``sp`` mesh)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.degree = group.size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(degree={self.degree})"

    def _check(self, attn: SelfAttention, meta: AttentionMeta, local_len: int) -> int:
        # a host tensor is read (no device sync); inside a compiled graph it is not read at all
        on_host = meta.cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling()
        full = int(meta.cu_seqlens[-1]) if on_host else None
        batch = meta.position_ids.shape[0]
        if full is not None and full != batch * local_len * self.degree:
            raise ValueError(
                f"Ulysses: cu_seqlens covers {full} tokens but {self.degree} ranks x "
                f"{batch} rows x {local_len} local tokens = {batch * local_len * self.degree}; "
                "cu_seqlens must describe the full (unsliced) packed batch"
            )
        return kv_replication(attn.n_heads, attn.n_kv_heads, self.degree)

    def __call__(self, attn: SelfAttention, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        rep = self._check(attn, meta, x.shape[1])
        q, k, v = attn.project_qkv(x, meta)
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
        q, k, v = (all_to_all(t, HEAD_DIM, SEQ_DIM, self.group) for t in (q, k, v))
        o = attn.core(q, k, v, meta)
        o = all_to_all(o, SEQ_DIM, HEAD_DIM, self.group)
        return attn.wo(o.flatten(2))


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` whose forward we may replace by ``F.linear``."""
    return type(module) is nn.Linear and not has_forward_hooks(module)


class AsyncUlyssesRunner(UlyssesRunner):
    """Ulysses attention with the all-to-alls overlapped (see the module docstring); the heads
    pipelined in ``head_chunks`` groups (a count :func:`head_chunks` resolved for the
    attention module it serves; 1: no groups)."""

    def __init__(self, group: ProcessGroup, head_chunks: int = 1) -> None:
        super().__init__(group)
        if head_chunks < 1:
            raise ValueError(f"AsyncUlyssesRunner needs a resolved head-group count (>= 1), got "
                             f"{head_chunks}: see head_chunks()")
        self.head_chunks = head_chunks

    def __repr__(self) -> str:
        return f"{type(self).__name__}(degree={self.degree}, head_chunks={self.head_chunks})"

    def __call__(self, attn: SelfAttention, x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        rep = self._check(attn, meta, x.shape[1])
        if self.head_chunks > 1:
            return self._pipelined(attn, x, meta, rep, self.head_chunks)
        g = self.group
        q_buf, q_pending = all_to_all_start(attn.project(x, "q", meta), HEAD_DIM, SEQ_DIM, g)
        k = _repeat_kv(attn.project(x, "k", meta), rep)
        k_buf, k_pending = all_to_all_start(k, HEAD_DIM, SEQ_DIM, g)
        v = _repeat_kv(attn.project(x, "v", meta), rep)
        v_buf, v_pending = all_to_all_start(v, HEAD_DIM, SEQ_DIM, g)
        q = all_to_all_wait(q_buf, q_pending, SEQ_DIM, g)
        k = all_to_all_wait(k_buf, k_pending, SEQ_DIM, g)
        v = all_to_all_wait(v_buf, v_pending, SEQ_DIM, g)
        o = attn.core(q, k, v, meta)
        if _plain_linear(attn.wo):
            return all_to_all_linear(o, attn.wo.weight, attn.wo.bias, SEQ_DIM, HEAD_DIM, g)
        return attn.wo(all_to_all(o, SEQ_DIM, HEAD_DIM, g).flatten(2))


    def _pipelined(self, attn: SelfAttention, x: torch.Tensor, meta: AttentionMeta, rep: int,
                   chunks: int) -> torch.Tensor:
        """The heads in ``chunks`` groups, each group's exchanges behind another's attention.
        The collectives queue in the order they are needed (group 0's q, k, v, each during
        the next projection, then group 1's, ...), so the first group attends as soon as its
        own rows have arrived."""
        g = self.group
        groups: dict[str, tuple[torch.Tensor, ...]] = {}
        sent: list[list[tuple[torch.Tensor, PendingAllToAll]]] = [[] for _ in range(chunks)]
        for which in ("q", "k", "v"):
            t = attn.project(x, which, meta)
            groups[which] = (t if which == "q" else _repeat_kv(t, rep)).chunk(chunks, HEAD_DIM)
            sent[0].append(all_to_all_start(groups[which][0], HEAD_DIM, SEQ_DIM, g))
        for c in range(1, chunks):
            sent[c] = [all_to_all_start(groups[w][c], HEAD_DIM, SEQ_DIM, g) for w in "qkv"]
        returning = []
        for group_sent in sent:
            q, k, v = (all_to_all_wait(buf, pending, SEQ_DIM, g) for buf, pending in group_sent)
            returning.append(all_to_all_start(attn.core(q, k, v, meta), SEQ_DIM, HEAD_DIM, g))
        o = torch.cat([all_to_all_wait(buf, pending, HEAD_DIM, g) for buf, pending in returning],
                      dim=HEAD_DIM)
        return attn.wo(o.flatten(2))


def make_runner(attn: nn.Module, group: ProcessGroup, async_op: bool,
                groups: int = 0) -> UlyssesRunner:
    """The Ulysses runner of ``attn`` over ``group``: synchronous, or asynchronous (overlapped)
    with its heads pipelined in ``groups`` head groups (``ulysses_async_head_chunks``: 0 as
    many as fit; a count that does not fit ``attn``'s heads is refused, :func:`head_chunks`),
    resolved here once."""
    if not async_op:
        return UlyssesRunner(group)
    sa = cast("SelfAttention", attn)
    return AsyncUlyssesRunner(group, head_chunks(sa.n_heads, sa.n_kv_heads, group.size(), groups))
