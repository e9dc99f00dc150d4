"""Row maps over the first ``count`` rows of a worst-case buffer, for the gather expert
dispatch (``torchtitan_omni.distributed.expert_gather``), and with every row used for the MoE
layer's own sort and un-sort of its routed copies (``modules.moe.gather_sorted`` and
``combine``: compiled, torch's index ops moved those rows at 0.6-1.2 TB/s on an H200).

Why: that dispatch sorts this rank's routed copies into a buffer sized for the worst case
(``ranks x tokens x top_k`` rows) whose first ``count`` rows (a device value) are used: on
average ``1 / ranks`` of it. Written with torch's ops, each pass over the buffer (the gather of
the tokens' rows, the masks past ``count``, the combine's un-sort, their backwards) reads and
writes every row; under ``torch.compile`` at EP4 those passes took about 34 ms of a 345 ms
step (docs/performance.md, twenty-sixth session), three quarters of it on rows no expert uses.
The kernels here read and write the used rows only: a row or slot past ``count`` is a masked
load and store, which moves no memory.

Three maps, each an operator made with ``torch.library.triton_op`` (no host read of
``count``), with Triton kernels on CUDA and torch's ops elsewhere. Why ``triton_op`` and not an
opaque custom operator: under ``torch.compile`` inductor sees through it and launches the
kernels from its own generated code. An opaque operator went through the dispatcher, the
operator's autograd wrapper and Triton's Python launcher on every call (eleven calls a MoE
layer and step): on 2x H200 the 8K EP2 step is bound by its host, and py-spy put about a sixth
of the host's time there (docs/performance.md, thirty-ninth session).

- :func:`rows_below`: ``out[i] = src[index[i]] * scale[i]`` for ``i < count``. Rows past
  ``count`` are left unwritten on CUDA (zero elsewhere): nothing reads them. Grouped GEMM
  ignores rows past its last group, and the other two maps read only rows below ``count``.
- :func:`slot_sums`: for each token ``t``, the sum over its ``k`` slots whose row
  ``pos[t * k + j]`` is below ``count`` of ``weights[t, j] * src[pos]``, in float32 (float64
  for float64 inputs), rounded once.
- :func:`slot_dots`: the float32 dot product of ``src[pos[t * k + j]]`` and ``other[t]`` for
  the slots below ``count`` (0 for the others): the weights' gradient of :func:`slot_sums`.

:func:`gather_copies` and :func:`combine_copies` are the dispatch's two differentiable steps,
each the other's adjoint up to the weights. Results equal torch's ops (the rows bit for bit;
the sums up to float32 summation order).

Between them the experts (``modules.moe.GroupedExperts`` with ``used_rows``) keep to the used
rows too: :func:`swiglu_rows` is SwiGLU's product ``silu(a) * b`` over the rows below
``count`` (and its backward). The gate and up projections read the same rows, and autograd
adds their two gradients over the whole buffer: a fork whose backward added them over the used
rows only was an ``autograd.Function``, whose input a compiled, checkpointed block keeps (see
the operators below), and an operator may not return its input.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


#: what the Triton kernels take (they sum in float32); float64 goes to torch's ops
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernels_available(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA with Triton installed)."""
    return triton is not None and device.type == "cuda"


def _kernels_take(src: torch.Tensor) -> bool:
    return kernels_available(src.device) and src.dtype in KERNEL_DTYPES


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    # products and sums in float32, or in the inputs' dtype where wider (float64)
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------- torch's ops (any device)

def _used(x, count):
    # [rows, 1]: whether each row of x is below count
    return (torch.arange(x.shape[0], device=x.device) < count).unsqueeze(1)


def _rows_below_torch(src, index, scale, count):
    out = src.index_select(0, index)
    if scale is not None:
        wide = _sum_dtype(src.dtype)
        out = (out.to(wide) * scale.to(wide).unsqueeze(1)).to(src.dtype)
    return torch.where(_used(index, count), out, 0)


def _slot_rows_torch(src, pos, count):
    # [T * k, D]: each slot's row, zero for slots past count
    rows = src.index_select(0, pos.clamp(max=src.shape[0] - 1))
    return torch.where((pos < count).unsqueeze(1), rows, 0)


def _slot_sums_torch(src, pos, count, weights, top_k):
    rows = _slot_rows_torch(src, pos, count).view(-1, top_k, src.shape[1])
    if weights is None:
        return rows.sum(dim=1)
    return (rows * weights.to(_sum_dtype(src.dtype)).unsqueeze(-1)).sum(dim=1).to(src.dtype)


def _slot_dots_torch(src, other, pos, count, top_k):
    wide = _sum_dtype(src.dtype)
    rows = _slot_rows_torch(src, pos, count).view(-1, top_k, src.shape[1]).to(wide)
    return (rows * other.to(wide).unsqueeze(1)).sum(dim=-1)


def _swiglu_torch(a, b, count):
    wide = _sum_dtype(a.dtype)
    out = (torch.nn.functional.silu(a.to(wide)) * b.to(wide)).to(a.dtype)
    return torch.where(_used(a, count), out, 0)


def _swiglu_backward_torch(grad, a, b, count):
    wide = _sum_dtype(a.dtype)
    g, a32, b32 = grad.to(wide), a.to(wide), b.to(wide)
    sig = torch.sigmoid(a32)
    grad_a = g * b32 * sig * (1 + a32 * (1 - sig))
    grad_b = g * a32 * sig
    used = _used(a, count)
    return (torch.where(used, grad_a.to(a.dtype), 0), torch.where(used, grad_b.to(b.dtype), 0))


# ---------------------------------------------------------------- Triton kernels (CUDA)

if triton is not None:

    @triton.jit
    def _rows_below_kernel(src_ptr, index_ptr, scale_ptr, out_ptr, count_ptr, rows, width,
                           HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # a tile of ROWS rows: a program per row spent most of its time starting up on the
        # unused rows (which move nothing: every lane of a row past count is masked)
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        limit = tl.where(row < tl.minimum(tl.load(count_ptr), rows), width, 0)
        mask = cols[None, :] < limit[:, None]
        src_row = tl.load(index_ptr + row, mask=limit > 0, other=0).to(tl.int64)
        values = tl.load(src_ptr + src_row[:, None] * width + cols[None, :], mask=mask)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row, mask=limit > 0, other=0.0).to(tl.float32)
            values = values.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + row.to(tl.int64)[:, None] * width + cols[None, :],
                 values.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _slot_sums_kernel(src_ptr, pos_ptr, weights_ptr, out_ptr, count_ptr, width,
                          TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        count = tl.load(count_ptr)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pos = tl.load(pos_ptr + token * TOP_K + j)
            values = tl.load(src_ptr + pos.to(tl.int64) * width + cols,
                             mask=cols < tl.where(pos < count, width, 0),
                             other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                values = values * tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
            total += values
        tl.store(out_ptr + token.to(tl.int64) * width + cols,
                 total.to(out_ptr.dtype.element_ty), mask=cols < width)

    @triton.jit
    def _slot_dots_kernel(src_ptr, other_ptr, pos_ptr, out_ptr, count_ptr, width,
                          TOP_K: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        token = tl.program_id(0)
        count = tl.load(count_ptr)
        for j in tl.static_range(TOP_K):
            pos = tl.load(pos_ptr + token * TOP_K + j)
            limit = tl.where(pos < count, width, 0)  # a slot past count reads nothing
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for block in range(BLOCKS):  # a constant bound: Triton 3.6's interpreter wants one
                cols = block * BLOCK + tl.arange(0, BLOCK)
                mask = cols < limit
                a = tl.load(src_ptr + pos.to(tl.int64) * width + cols, mask=mask, other=0.0)
                b = tl.load(other_ptr + token.to(tl.int64) * width + cols, mask=mask, other=0.0)
                total += a.to(tl.float32) * b.to(tl.float32)
            tl.store(out_ptr + token * TOP_K + j, tl.sum(total, axis=0))


    @triton.jit
    def _rowwise_kernel(a_ptr, b_ptr, c_ptr, out_ptr, out2_ptr, count_ptr, rows, width,
                        OP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # OP 0: out = silu(a) * b; 1: (out, out2) = SwiGLU's gradients for grad c
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        limit = tl.where(row < tl.minimum(tl.load(count_ptr), rows), width, 0)
        mask = cols[None, :] < limit[:, None]
        at = row.to(tl.int64)[:, None] * width + cols[None, :]
        a = tl.load(a_ptr + at, mask=mask).to(tl.float32)
        b = tl.load(b_ptr + at, mask=mask).to(tl.float32)
        if OP == 0:
            tl.store(out_ptr + at, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty),
                     mask=mask)
        else:
            g = tl.load(c_ptr + at, mask=mask).to(tl.float32)
            sig = tl.sigmoid(a)
            tl.store(out_ptr + at, (g * b * sig * (1 + a * (1 - sig))).to(
                out_ptr.dtype.element_ty), mask=mask)
            tl.store(out2_ptr + at, (g * a * sig).to(out2_ptr.dtype.element_ty), mask=mask)


def _rowwise_triton(op: int, a, b, count, grad=None, out=None):
    a, b = a.contiguous(), b.contiguous()
    if out is None:  # as in _rows_below_triton
        out = torch.empty_like(a)
    # the kernel writes out2 for op 1 only; the others get a read-only input in its place, so
    # that no argument it writes aliases another (inductor clones the arguments it writes)
    out2 = torch.empty_like(b) if op == 1 else b
    if a.numel():
        width = a.shape[1]
        block = _block(width)
        _launchable(_rowwise_kernel)[(triton.cdiv(a.shape[0], TILE_ROWS),
                                      triton.cdiv(width, block))](
            a, b, a if grad is None else grad.contiguous(), out, out2, count, a.shape[0], width,
            OP=op, ROWS=TILE_ROWS, BLOCK=block)
    return (out, out2) if op == 1 else out


def _launchable(kernel):
    """``kernel`` wrapped for ``torch.library.triton_op`` (inductor launches it from its own
    code); under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) the kernel as it
    is, which torch 2.11's ``wrap_triton`` refuses."""
    # Not cached: ``wrap_triton`` gives the bare kernel in eager calls and a traceable wrapper
    # while compiling, so a cached eager answer breaks a later compile (the GPU tests caught it).
    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel


#: rows per program of the row-wise kernels
TILE_ROWS = 4


def _block(width: int) -> int:
    return min(1024, triton.next_power_of_2(width))


def _rows_below_triton(src, index, scale, count, out=None):
    # ``out``: where to write (its rows past count are left as they are); new by default
    if out is None:
        out = torch.empty((index.numel(), src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        block = _block(src.shape[1])
        grid = (triton.cdiv(index.numel(), TILE_ROWS), triton.cdiv(src.shape[1], block))
        _launchable(_rows_below_kernel)[grid](
            src, index, index if scale is None else scale.contiguous(), out, count,
            index.numel(), src.shape[1], HAS_SCALE=scale is not None, ROWS=TILE_ROWS,
            BLOCK=block)
    return out


def _slot_sums_triton(src, pos, count, weights, top_k):
    tokens = pos.numel() // top_k
    out = torch.empty((tokens, src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        block = _block(src.shape[1])
        grid = (tokens, triton.cdiv(src.shape[1], block))
        _launchable(_slot_sums_kernel)[grid](
            src, pos, pos if weights is None else weights.contiguous(), out, count,
            src.shape[1], TOP_K=top_k, HAS_WEIGHTS=weights is not None, BLOCK=block)
    return out


def _slot_dots_triton(src, other, pos, count, top_k):
    tokens = pos.numel() // top_k
    out = torch.empty((tokens, top_k), dtype=torch.float32, device=src.device)
    if out.numel():
        block = _block(src.shape[1])
        _launchable(_slot_dots_kernel)[(tokens,)](
            src, other, pos, out, count, src.shape[1], TOP_K=top_k, BLOCK=block,
            BLOCKS=triton.cdiv(src.shape[1], block))
    return out


# ---------------------------------------------------------------- the operators

@triton_op("torchtitan_omni::rows_below", mutates_args=())
def rows_below(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
               count: torch.Tensor) -> torch.Tensor:
    """``[len(index), D]``: ``src[index[i]]`` (times ``scale[i]`` in float32, or float64, if
    given) for ``i < count``; the rows past ``count`` unwritten on CUDA, zero elsewhere."""
    src, index = src.contiguous(), index.contiguous()
    run = _rows_below_triton if _kernels_take(src) else _rows_below_torch
    return run(src, index, scale, count)


@triton_op("torchtitan_omni::slot_sums", mutates_args=())
def slot_sums(src: torch.Tensor, pos: torch.Tensor, count: torch.Tensor,
              weights: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """``[len(pos) / top_k, D]``: per token, the sum over its slots below ``count`` of
    ``weights[t, j] * src[pos[t * top_k + j]]`` (float32, or float64, rounded once to ``src``'s
    dtype)."""
    src, pos = src.contiguous(), pos.contiguous()
    run = _slot_sums_triton if _kernels_take(src) else _slot_sums_torch
    return run(src, pos, count, weights, top_k)


@triton_op("torchtitan_omni::slot_dots", mutates_args=())
def slot_dots(src: torch.Tensor, other: torch.Tensor, pos: torch.Tensor, count: torch.Tensor,
              top_k: int) -> torch.Tensor:
    """``[len(pos) / top_k, top_k]`` in float32 (float64 for float64 ``src``): ``src[pos[t *
    top_k + j]] . other[t]`` for the slots below ``count``, 0 for the others."""
    src, other, pos = src.contiguous(), other.contiguous(), pos.contiguous()
    run = _slot_dots_triton if _kernels_take(src) else _slot_dots_torch
    return run(src, other, pos, count, top_k)


# ---------------------------------------------------------------- differentiable steps

# Operators with their own backward (``register_autograd``), not ``torch.autograd.Function``s:
# inside a compiled block that is checkpointed as a whole, what an autograd.Function took as
# input was kept for the backward instead of recomputed (on CUDA: the sorted copies, 1 GiB a
# MoE layer at 16K under EP2, forty-third session), where an operator's is recomputed.

@triton_op("torchtitan_omni::gather_copies", mutates_args=())
def gather_copies(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                  count: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[len(order), D]``: row ``i < count`` is the token of slot ``order[i]`` (``x[order[i] //
    top_k]``, ``x`` ``[T, D]``); ``inverse[order] = arange``. The backward sums each token's
    slots below ``count``."""
    return rows_below(x, torch.div(order, top_k, rounding_mode="floor"), None, count)


def _gather_setup(ctx, inputs, output) -> None:
    _, _, inverse, count, top_k = inputs
    ctx.save_for_backward(inverse, count)
    ctx.top_k = top_k


def _gather_backward(ctx, grad):
    inverse, count = ctx.saved_tensors
    return slot_sums(grad, inverse, count, None, ctx.top_k), None, None, None, None


gather_copies.register_autograd(_gather_backward, setup_context=_gather_setup)


@triton_op("torchtitan_omni::combine_copies", mutates_args=())
def combine_copies(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                   inverse: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[T, D]``: each token's slots below ``count`` un-sorted from ``y`` (row ``inverse[t *
    k + j]``) and summed weighed by ``weights`` ``[T, k]``, rounded to ``y``'s dtype as
    ``modules.moe.combine`` rounds them (weights in ``y``'s dtype, float32 products and sum,
    one rounding). Rows of ``y`` at or past ``count`` are never read."""
    y, inverse = y.contiguous(), inverse.contiguous()
    run = _slot_sums_triton if _kernels_take(y) else _slot_sums_torch
    return run(y, inverse, count, weights.to(y.dtype), weights.shape[1])


def _combine_setup(ctx, inputs, output) -> None:
    y, weights, order, inverse, count = inputs
    ctx.save_for_backward(y, weights, order, inverse, count)


def _combine_backward(ctx, grad):
    y, weights, order, inverse, count = ctx.saved_tensors
    top_k = weights.shape[1]
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        scale = weights.to(y.dtype).reshape(-1).index_select(0, order)
        grad_y = rows_below(grad, torch.div(order, top_k, rounding_mode="floor"), scale, count)
    if ctx.needs_input_grad[1]:
        dots = slot_dots(y, grad, inverse, count, top_k)
        grad_w = dots.to(y.dtype).to(weights.dtype)
    return grad_y, grad_w, None, None, None


combine_copies.register_autograd(_combine_backward, setup_context=_combine_setup)


@triton_op("torchtitan_omni::swiglu_rows", mutates_args=())
def swiglu_rows(a: torch.Tensor, b: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (``[M, H]``, float32 inside, one rounding) for the rows below ``count``;
    the rest unwritten on CUDA, zero elsewhere."""
    if _kernels_take(a):
        return _rowwise_triton(0, a, b, count)
    return _swiglu_torch(a, b, count)


@triton_op("torchtitan_omni::swiglu_rows_backward", mutates_args=())
def swiglu_rows_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`swiglu_rows` for ``a`` and ``b`` over the rows below ``count``."""
    if _kernels_take(a):
        return _rowwise_triton(1, a, b, count, grad)
    return _swiglu_backward_torch(grad, a, b, count)


def _swiglu_setup(ctx, inputs, output) -> None:
    a, b, count = inputs
    ctx.save_for_backward(a, b, count)


def _swiglu_backward(ctx, grad):
    a, b, count = ctx.saved_tensors
    grad_a, grad_b = swiglu_rows_backward(grad, a, b, count)
    return grad_a, grad_b, None


swiglu_rows.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)

