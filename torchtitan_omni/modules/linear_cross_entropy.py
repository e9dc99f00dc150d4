"""Summed cross-entropy of a linear head without materializing the logits of every position.

A text head of a 128K vocabulary turns 8K labelled positions into 1 G logits: 2 GiB in bf16,
4 GiB more once upcast for the softmax, and as much again for their gradient.
:func:`linear_cross_entropy` instead walks the rows in chunks: each chunk's logits are
computed, reduced to the chunk's loss, and turned into the gradients of the hidden states and
of the head's weight right away (the softmax minus the one-hot targets, times the weight or
the hidden states), so only one chunk of logits ever exists and backward has nothing left to
recompute. The matrix products are the three an unfused head does (logits, input gradient,
weight gradient). The weight gradient is one product per group of chunks (their logit
gradients kept in one buffer, ``GROUP_BYTES``), added into a float32 sum: each such add of a
152K x 2048 head took 0.85 ms on an H200 (profiled), so one add per 882-row chunk was 4% of a
MoE step at 8K.

``loss_and_logit_grad`` is the elementwise part of one chunk (log-sum-exp, target pick,
softmax gradient). A job that compiles its loss (``[compile] components = ["loss"]``) runs
``fusable_loss_and_logit_grad`` compiled instead: the same values, written so that inductor
makes one kernel of it, which reads the logits and writes the gradient in bf16 straight into
the group's buffer. The eager form's ``scatter_add`` made inductor write a float32 gradient,
cast it in a second kernel and copy it into the buffer: on an H200, an 883-row chunk of a 152K
vocabulary took 0.754 ms that way and takes 0.375 ms now (``scripts/bench_loss_chunk.py``; the
same values), 1.017x on the MoE proxy's 8K step. Eager, the fusable form would build a
``[rows, vocab]`` mask instead.

The three passes over the whole float32 sum (:class:`WeightGradSum`: the first product
widened, later ones added, the backward's scale by the upstream gradient) are compiled then
too: torch's kernels for them mix dtypes or broadcast a device scalar and run at 2.0-2.7 TB/s
on an H200 (profiled on the MoE proxy's 152K x 2048 head: 0.94, 1.19 and 0.92 ms), where a
compiled elementwise kernel moves about 3.9 TB/s. The first and the last pass come once a
step whatever its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

#: bytes of float32 logits one chunk may hold (the chunk's row count follows from the vocabulary)
CHUNK_BYTES = 1 << 29
#: bytes of logit gradients (in the head's dtype) kept for one weight-gradient product
GROUP_BYTES = 1 << 30

ChunkKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                       tuple[torch.Tensor, torch.Tensor]]


def start_sum(product: torch.Tensor) -> torch.Tensor:
    """The weight gradient's float32 sum from its first product."""
    return product.float()


def add_to_sum(total: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """``total += product`` (``product`` read in its own dtype: no float32 copy of it)."""
    return total.add_(product)


def scaled_sum(total: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``total * scale`` (a device scalar) straight into ``dtype``: one pass over the sum."""
    return torch.mul(total, scale, out=torch.empty_like(total, dtype=dtype))


class WeightGradSum(NamedTuple):
    """The passes over the head's float32 weight-gradient sum (see the module docstring):
    :func:`start_sum`, :func:`add_to_sum` and :func:`scaled_sum`, or their compiled twins."""

    start: Callable[[torch.Tensor], torch.Tensor]
    add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


#: the passes run by torch's kernels (``distributed.compile.compile_loss_heads`` compiles them)
EAGER_SUM = WeightGradSum(start_sum, add_to_sum, scaled_sum)


def _loss_and_lse(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # the chunk's summed loss and each row's log-sum-exp, from float32 logits
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, targets.unsqueeze(1)).squeeze(1)
    return (lse - picked).sum(), lse


def _into(grad: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    # the float32 gradient in ``dtype``, or ``out`` holding it (copy_ casts as it writes)
    return grad.to(dtype) if out is None else out.copy_(grad)


def loss_and_logit_grad(
    logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``logits`` ``[C, V]`` for ``targets`` ``[C]``, and its gradient
    with respect to the logits (``softmax - one_hot``), in the logits' dtype; written into
    ``out`` (``[C, V]``, that dtype) and returned as ``out`` when given."""
    x = logits.float()
    loss, lse = _loss_and_lse(x, targets)
    grad = torch.exp(x - lse.unsqueeze(1))
    grad.scatter_add_(1, targets.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
    return loss, _into(grad, logits.dtype, out)


def fusable_loss_and_logit_grad(
    logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loss_and_logit_grad`, the same values in a form for ``torch.compile``: the one-hot
    term is a comparison of column indices, so the softmax, the subtraction, the cast and the
    store into ``out`` fuse into one pass (see the module docstring; eager, it would build a
    ``[C, V]`` mask)."""
    x = logits.float()
    loss, lse = _loss_and_lse(x, targets)
    hit = torch.arange(x.shape[1], device=x.device) == targets.unsqueeze(1)
    grad = torch.exp(x - lse.unsqueeze(1)) - hit.to(x.dtype)
    return loss, _into(grad, logits.dtype, out)


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's float32 logits stay within ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def group_rows(vocab_size: int, rows: int, element_size: int,
               group_bytes: int = GROUP_BYTES) -> int:
    """Rows per weight-gradient product: whole chunks of ``rows`` whose logit gradients
    (``element_size`` bytes each) stay within ``group_bytes``; at least one chunk."""
    return max(1, group_bytes // (element_size * vocab_size * rows)) * rows


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows: int, group: int, kernel: ChunkKernel,
                sums: WeightGradSum):
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if needs_h else None
        grad_w = None
        grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if needs_b and bias is not None else None)
        n = hidden.shape[0]
        for first in range(0, n, group):
            last = min(n, first + group)
            # a group of one chunk multiplies that chunk's gradient; more write theirs into one
            # buffer, so the group's weight gradient is one product and one add
            logit_grads = None
            for start in range(first, last, rows):
                end = min(last, start + rows)
                logits = F.linear(hidden[start:end], weight, bias)
                if needs_w and last - first > rows and logit_grads is None:
                    logit_grads = logits.new_empty((last - first, logits.shape[1]))
                out = None if logit_grads is None else logit_grads[start - first:end - first]
                chunk_loss, g = kernel(logits, targets[start:end], out)
                loss = loss + chunk_loss
                if grad_h is not None:
                    grad_h[start:end] = g @ weight
                if grad_b is not None:
                    grad_b += g.sum(0).float()
            if needs_w:
                product = (g if logit_grads is None else logit_grads).t() @ hidden[first:last]
                # the first product becomes the float32 sum; later ones are added in one pass
                # that reads the product in its own dtype (no float32 copy of it)
                grad_w = sums.start(product) if grad_w is None else sums.add(grad_w, product)
        if needs_w and grad_w is None:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.sums = sums
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_loss.float()
        dh = (grad_h * scale.to(grad_h.dtype)) if grad_h is not None else None
        # scaled straight into the weight's dtype: one pass over the float32 sum, not two
        dw = ctx.sums.scale(grad_w, scale, w_dtype) if grad_w is not None else None
        db = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return dh, dw, db, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    bias: torch.Tensor | None = None, *, rows: int | None = None, group: int | None = None,
    kernel: ChunkKernel = loss_and_logit_grad, sums: WeightGradSum = EAGER_SUM,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets, reduction="sum")`` in float32,
    computed chunk by chunk (see the module docstring). ``hidden`` ``[N, D]``, ``weight``
    ``[V, D]``, ``targets`` ``[N]`` int64 in ``[0, V)`` (no ignored positions: pass only the
    labelled rows). ``rows`` per chunk and ``group`` rows per weight-gradient product (rounded
    down to whole chunks) default to :func:`chunk_rows` and :func:`group_rows`; ``kernel``
    computes a chunk's loss and logit gradient, ``sums`` the passes over the weight
    gradient's float32 sum."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy wants hidden [N, D] and targets [N], got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    # no rows still goes through the one autograd node (zero gradients): every rank's backward
    # then has the same structure, so FSDP reduces the head's gradient in the same order
    rows = rows or chunk_rows(weight.shape[0])
    group = (max(1, group // rows) * rows if group
             else group_rows(weight.shape[0], rows, weight.element_size()))
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, rows, group, kernel, sums)


class LinearHead(nn.Linear):
    """A linear output head that also returns its summed cross-entropy without keeping the
    logits: ``head(x)`` gives logits, ``head(x, targets)`` the loss (float32 scalar).

    Going through ``__call__`` in both cases lets FSDP gather the weight first; the parameter
    names stay those of ``nn.Linear`` (checkpoints and Hugging Face maps are unchanged).
    """

    #: the chunk kernel and the weight-gradient sum's passes;
    #: ``torchtitan_omni.distributed.compile`` swaps in compiled ones
    loss_kernel: ChunkKernel = staticmethod(loss_and_logit_grad)
    weight_grad_sum: WeightGradSum = EAGER_SUM

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, self.bias, kernel=self.loss_kernel,
                                    sums=self.weight_grad_sum)
