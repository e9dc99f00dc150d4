"""Adam's and AdamW's update of one tensor, compiled into one kernel (``compile.components``
with ``"optimizer"``); the tensors of one size updated by one compiled call.

Why: torch's fused Adam kernel walks its tensor lists in launches of at most a few hundred
65,536-element chunks, and on one H200 it moves the update's 32 bytes a parameter (the
parameter, gradient and both moments read and written back) at 2.8 TB/s of the memory's
4.8. The same update compiled by inductor, one kernel per large tensor, moves them at 3.9 TB/s
(the 30B-A3B 12-layer cut's EP4-rank proxy, 3.97B parameters: 31.6 ms of kernels against
44.3 ms). The optimizer step does not grow with tokens, so it is most of a MoE step's fixed
part (issue 12; docs/performance.md).

The arithmetic is torch's ``Adam``/``AdamW`` for one tensor in the order of its single-tensor
step; the bias corrections are computed on the device from the ``step`` tensor, as the fused
kernel does, so the host never reads the device.

The moments may be kept in bfloat16 (``optimizer.moments_dtype``): the kernel reads them in
the parameter's dtype, updates the parameter with the unrounded moments, and stores them
rounded stochastically (:func:`round_stochastically`, with bits from a hash of each
element's index and the step: :func:`rounding_noise`). 8 bytes a parameter fewer to move (20
instead of 28 with a bf16 gradient and compute copy) and 4 fewer to hold. Rounding to nearest
would not do: with ``beta2 = 0.999`` a step changes the second moment by 0.1%, under half of
bfloat16's spacing (0.4%), so a decaying moment would never move; stochastic rounding keeps
each stored moment's expectation equal to its exact value.

The parameter itself may be in bfloat16 (``optimizer.expert_weights_dtype``, the MoE experts'
weights): the kernel reads it in float32, computes the update there and stores the new
weight rounded stochastically, with bits of its own (another seed than the moments'). 14
bytes a parameter to move with bf16 moments and gradient, against 20 for a float32 weight
with its bf16 compute copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from torchtitan_omni.compat import mark_size_static, raise_recompile_limit

#: tensors smaller than this stay with torch's fused kernel: a compiled call takes the host
#: about 0.1 ms, and 4M float32 elements take the GPU about as long to update
COMPILED_MIN_NUMEL = 1 << 22

#: the dtypes whose update the compiled kernel computes in the tensors' own dtype, as torch's
#: kernels do (lower precisions compute in float32 there)
COMPILED_DTYPES = (torch.float32, torch.float64)

#: moments' dtypes the compiled kernel keeps for float32 parameters besides float32
LOW_PRECISION_MOMENTS = (torch.bfloat16,)

#: parameters' dtypes the compiled kernel updates in float32 and stores rounded
#: stochastically (their moments in float32 or a dtype of :data:`LOW_PRECISION_MOMENTS`)
LOW_PRECISION_WEIGHTS = (torch.bfloat16,)


#: murmur3's 32-bit finalizer constants as int32 (the products wrap, as its uint32 ones do),
#: and the odd constant that spreads the seed
_MIX = (0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32))
_SEED_SPREAD = 0x9E3779B1 - (1 << 32)


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    # a logical shift of int32 bits (``>>`` copies the sign bit in)
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def rounding_noise(like: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uniform 16-bit integers (int32 tensors shaped as ``like``) per element, for
    :func:`round_stochastically`: the halves of murmur3's 32-bit finalizer of the element's
    index plus a multiple of ``seed`` (an integer scalar tensor; the optimizer passes the step
    count), in int32 arithmetic that wraps. A hash, not torch's generator: an inductor kernel
    draws Philox numbers at about a hundred integer operations each, which made the update
    slower than with float32 moments on an H200; and the same step of a resumed run rounds
    alike. Tensors of one shape get the same bits in a step; the bits of one element differ
    from step to step."""
    index = torch.arange(like.numel(), device=like.device, dtype=torch.int32).view(like.shape)
    h = index + seed.to(torch.int32) * _SEED_SPREAD
    h = h ^ _shift_right(h, 16)
    h = h * _MIX[0]
    h = h ^ _shift_right(h, 13)
    h = h * _MIX[1]
    h = h ^ _shift_right(h, 16)
    return h & 0xFFFF, _shift_right(h, 16)


def round_stochastically(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor
                         ) -> torch.Tensor:
    """``x`` (float32) in ``dtype`` (bfloat16), rounded up or down with the probabilities that
    make the result's expectation ``x`` when ``noise`` (integers shaped as ``x``) is uniform
    in [0, 2^16): it is added to the 16 bits bfloat16 drops, and they are truncated (the carry
    rounds the magnitude up, so it is the same for negative values). Values bfloat16 holds
    exactly come back unchanged; infinities and NaNs stay so."""
    if x.dtype != torch.float32 or dtype != torch.bfloat16:
        raise ValueError(f"round_stochastically: float32 to bfloat16 only, not {x.dtype} to "
                         f"{dtype}")
    bits = (x.view(torch.int32) + noise.to(torch.int32)) & -(1 << 16)
    return bits.view(torch.float32).to(dtype)


def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: torch.Tensor, coef: torch.Tensor | None,
                 compute_copy: torch.Tensor | None = None, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
                 maximize: bool) -> None:
    """One Adam (or, with ``decoupled_weight_decay``, AdamW) update of ``param`` in place,
    ``step`` already counted. ``coef``: a clipping coefficient the gradient is multiplied by
    as it is read, or None; ``grad`` itself is only read (writing the clipped gradient back
    would move 4 more bytes a parameter, for a tensor the trainer clears before its next
    backward). ``grad`` may be in ``compute_copy``'s lower precision (the experts' gradients
    that ``components.compute_copies`` keeps): it is read in ``param``'s dtype, which holds
    it exactly. ``compute_copy``: a lower-precision copy of ``param`` set to the updated
    value's cast, or None. ``exp_avg`` and ``exp_avg_sq`` may be in a dtype of
    :data:`LOW_PRECISION_MOMENTS` (float32 ``param``): read in float32, stored rounded
    stochastically. ``param`` may be in a dtype of :data:`LOW_PRECISION_WEIGHTS` (with a
    gradient in that dtype and no compute copy): updated in float32, stored rounded
    stochastically."""
    stored_param = param
    if param.dtype in LOW_PRECISION_WEIGHTS:  # computed in float32, stored rounded below
        param = param.to(torch.float32)
    g = grad.to(param.dtype)
    if coef is not None:
        g = g * coef
    if maximize:
        g = g.neg()
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    stored = (exp_avg, exp_avg_sq)
    low_precision = exp_avg.dtype != param.dtype
    if low_precision:  # computed in the update's dtype, stored rounded below
        exp_avg, exp_avg_sq = exp_avg.to(param.dtype), exp_avg_sq.to(param.dtype)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step = step.to(param.dtype)  # the fused kernels' bias corrections are in the update's dtype
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.sub_(exp_avg / denom * (lr / bias_correction1))
    if compute_copy is not None:
        compute_copy.copy_(param)
    seed = step.to(torch.int32)
    if low_precision:
        noises = rounding_noise(param, seed)
        for low, exact, noise in zip(stored, (exp_avg, exp_avg_sq), noises):
            low.copy_(round_stochastically(exact, low.dtype, noise))
    if stored_param is not param:
        # bits of their own: the negated step seeds a hash the moments' positive steps never do
        noise, _ = rounding_noise(param, -seed)
        stored_param.copy_(round_stochastically(param, stored_param.dtype, noise))


def adam_update_many_(params: list[torch.Tensor], grads: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                      steps: list[torch.Tensor], coef: torch.Tensor | None,
                      compute_copies: list[torch.Tensor | None], **hyper) -> None:
    """:func:`adam_update_` of each tensor of the lists (compiled, one graph and one call for
    them all)."""
    for p, g, m, v, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps,
                                      compute_copies):
        adam_update_(p, g, m, v, step, coef, copy, **hyper)


#: tensor sizes whose update gets a graph of its own (those that update the most elements in
#: all, :meth:`CompiledAdamUpdate.prefer_sizes`, else the first ones met): its kernel knows the
#: size and reads and writes without bounds masks. On one H200 that took the update of a 50M-
#: element expert tensor from 0.31 to 0.18 ms with bf16 weights and moments, 0.30 to 0.24 ms
#: with bf16 moments and a compute copy, 0.30 to 0.26 ms with bf16 weights (the kernels that
#: round; float32 ones move the same bytes either way). The update of any further size runs in
#: one graph for all sizes.
STATIC_SIZES_MAX = 8

#: graphs the compiled update may hold: each static size and the shared one, for up to four
#: layouts (dtypes, a clipping coefficient or not, a compute copy or not); past dynamo's
#: default limit of 8 a function's new inputs would run eagerly
GRAPHS_MAX = 4 * (STATIC_SIZES_MAX + 1)


def _flat_alias(t: torch.Tensor) -> torch.Tensor:
    # a 1-D tensor on t's memory that is neither a Parameter nor a view (dynamo guards a view
    # on its base's shape, and keeps a Parameter's static): graphs are told apart by size only
    return t.view(-1).data


class CompiledAdamUpdate:
    """:func:`adam_update_` under ``torch.compile`` with one backend. Each tensor runs
    flattened; up to :data:`STATIC_SIZES_MAX` sizes (those :meth:`prefer_sizes` picks, then the
    first ones met) get a graph each with the size fixed, any other size a shared graph with it
    symbolic. :meth:`update_all` updates the tensors of one such size in one call of their
    graph: each compiled call costs the host its dynamo entry and wrapper (about 0.1 ms in a
    profiled step), once per size instead of once per tensor (62 calls a step on an EP2 rank of
    the MoE 12-layer cut, whose 8K step waits for its host). The hyperparameters are graph
    inputs, not constants, so a schedule's new learning rate does not recompile."""

    def __init__(self, backend: str = "inductor") -> None:
        self._update = torch.compile(adam_update_many_, backend=backend, fullgraph=True,
                                     dynamic=True)
        self.static_sizes: set[int] = set()
        raise_recompile_limit(GRAPHS_MAX)

    def prefer_sizes(self, numels: Iterable[int]) -> None:
        """Give the sizes among ``numels`` (one a tensor to update) that update the most
        elements in all their graphs of their own, while fewer than :data:`STATIC_SIZES_MAX`
        have one: the largest tensors' kernels gain the most, and a model's small tensors may
        come first."""
        if len(self.static_sizes) >= STATIC_SIZES_MAX:  # every step's call past the first
            return
        totals = Counter(numels)
        for numel in sorted(totals, key=lambda n: n * totals[n], reverse=True):
            if len(self.static_sizes) >= STATIC_SIZES_MAX:
                break
            self.static_sizes.add(numel)

    def update_all(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                   steps: list[torch.Tensor], coef: torch.Tensor | None,
                   compute_copies: list[torch.Tensor | None], **hyper) -> None:
        """Update each tensor of the lists (as :func:`adam_update_` would), those of one
        static size in one compiled call, all others in one call of the shared graph."""
        by_size: dict[int | None, list[tuple]] = {}
        for param, grad, m, v, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps,
                                                 compute_copies):
            flat = [_flat_alias(t) for t in (param, grad, m, v)]
            flat_copy = None if copy is None else _flat_alias(copy)
            numel = param.numel()
            static = numel in self.static_sizes or len(self.static_sizes) < STATIC_SIZES_MAX
            if static:
                self.static_sizes.add(numel)
                for t in (*flat, flat_copy):
                    if t is not None:
                        mark_size_static(t)
            by_size.setdefault(numel if static else None, []).append((*flat, step, flat_copy))
        for entries in by_size.values():
            p, g, m, v, step, copy = (list(column) for column in zip(*entries))
            self._update(p, g, m, v, step, coef, copy, **hyper)

    def __call__(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: torch.Tensor, coef: torch.Tensor | None,
                 compute_copy: torch.Tensor | None = None, **hyper) -> None:
        """One tensor's update, with :func:`adam_update_`'s arguments."""
        self.update_all([param], [grad], [exp_avg], [exp_avg_sq], [step], coef,
                        [compute_copy], **hyper)


_compiled: dict[str, CompiledAdamUpdate] = {}


def compiled_adam_update(backend: str = "inductor") -> CompiledAdamUpdate:
    """The process's :class:`CompiledAdamUpdate` for ``backend``."""
    if backend not in _compiled:
        _compiled[backend] = CompiledAdamUpdate(backend)
    return _compiled[backend]


def compiles(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, min_numel: int,
             compute_copy: torch.Tensor | None = None) -> bool:
    """Whether a tensor's update goes to the compiled kernel: float32 or float64, at least
    ``min_numel`` elements unless its moments are in a lower precision (only this kernel
    keeps those); or a parameter in a dtype of :data:`LOW_PRECISION_WEIGHTS`, of any size
    (only this kernel rounds it stochastically), with no compute copy. The parameter,
    gradient and moments alike in shape and device, each contiguous (one graph serves them
    all), and in dtype but for the moments' lower precision and the compute copy's, which the
    gradient may have too."""
    if exp_avg.dtype != exp_avg_sq.dtype:
        return False
    if param.dtype in LOW_PRECISION_WEIGHTS:  # any size: torch's kernels round to nearest
        if compute_copy is not None or exp_avg.dtype not in (torch.float32,
                                                             *LOW_PRECISION_MOMENTS):
            return False
    elif param.dtype not in COMPILED_DTYPES:
        return False
    elif exp_avg.dtype == param.dtype:
        if param.numel() < min_numel:
            return False
    elif param.dtype != torch.float32 or exp_avg.dtype not in LOW_PRECISION_MOMENTS:
        return False
    grad_dtypes = {param.dtype} | ({compute_copy.dtype} if compute_copy is not None else set())
    if grad.dtype not in grad_dtypes:
        return False
    tensors = [param, grad, exp_avg, exp_avg_sq]
    if compute_copy is not None:
        tensors.append(compute_copy)
    return all(t.shape == param.shape and t.device == param.device and t.is_contiguous()
               for t in tensors)
