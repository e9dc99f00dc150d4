"""The MoE experts that cast their own weights, and those weights stored in bfloat16
(``optimizer.expert_weights_dtype``).

Experts cast their own weights to the compute dtype where no FSDP unit does it for them:
expert parallel over every data rank with every LLM block checkpointed (the experts skip FSDP:
``distributed.parallelize.experts_outside_fsdp``), or no FSDP under a lower-precision
autocast. Two options act on exactly those experts: ``parallelism.expert_compute_copies``
(``components.compute_copies``) and the weights stored in the compute dtype (below).

Why bfloat16 weights: the optimizer's update does not grow with tokens, so it is most of a
MoE step's part that does not (issue 12; docs/performance.md), and it moves every byte of
every expert's state once a step. A float32 weight with its bf16 compute copy costs the
update 20 bytes a parameter with bf16 moments and gradients (read the weight, gradient and
moments; write the weight, moments and copy); a bf16 weight costs 14, and 2 bytes to hold
instead of 6. The compiled update (``components.adam_update``) computes the new weight in
float32 and stores it rounded stochastically, so each stored weight's expectation is the exact
update's; rounding to nearest would drop every update under half of bfloat16's spacing (at a
weight of 0.02, a change of 6e-5). Not bit for bit the float32 run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
import torch.nn as nn

from torchtitan_omni.modules.moe import EXPERT_WEIGHTS, GroupedExperts, _local


#: why an option that acts on the experts that cast their own weights finds none
NO_SELF_CASTING_EXPERTS = (
    "no MoE experts here cast their own weights (they do under expert parallel over every data "
    "rank with every LLM block checkpointed, or without FSDP under a lower-precision "
    "autocast): FSDP's mixed precision casts them, they compute in their weights' dtype "
    "(float32 training, CPU), or the model has none")


def self_casting_experts(model_parts: Iterable[nn.Module], autocast_dtype: torch.dtype | None
                         ) -> list[tuple[str, GroupedExperts, torch.dtype]]:
    """Every ``GroupedExperts`` that casts its own weights, with its name and compute dtype:
    those with a ``compute_dtype`` (outside FSDP), or, with FSDP off, under an autocast to
    ``autocast_dtype``. Each gets that ``compute_dtype`` (what its forward's autocast branch
    picks). Experts whose weights already are in their compute dtype are among them."""
    found = []
    for model in model_parts:
        for name, module in model.named_modules():
            if not isinstance(module, GroupedExperts):
                continue
            dtype = module.compute_dtype or autocast_dtype
            if dtype is None:
                continue
            module.compute_dtype = dtype
            found.append((name, module, dtype))
    return found


@torch.no_grad()
def store_expert_weights_in(model_parts: Iterable[nn.Module],
                            autocast_dtype: torch.dtype | None, dtype: torch.dtype) -> int:
    """Store the weights of every expert that casts its own weights (:func:`self_casting_experts`)
    in ``dtype``, its compute dtype, in place: each parameter object stays the same (the
    optimizer already holds them), its values rounded to ``dtype``. Call it before anything takes
    the parameters' tensors (a checkpointer's cached state dict would keep the old ones): it
    raises RuntimeError where another live tensor still holds an old weight. Returns the
    elements of this rank's expert weights; raises ValueError where an expert computes in
    another dtype, and when no expert casts its own weights."""
    experts = self_casting_experts(model_parts, autocast_dtype)
    if not experts:
        raise ValueError(NO_SELF_CASTING_EXPERTS)
    for name, _, compute_dtype in experts:
        if compute_dtype != dtype:
            raise ValueError(f"{name or 'experts'} compute in {compute_dtype}, not {dtype}: "
                             "their weights would be cast in every pass anyway")
    gc.collect()  # unreachable tensors awaiting collection would count as holders below
    numel = 0
    for name, module, _ in experts:
        # one module's weights at a time: its old tensors stay alive until the check below
        old: list[torch.Tensor] = []
        for which in EXPERT_WEIGHTS:
            param = getattr(module, which)
            numel += _local(param).numel()
            if param.dtype == dtype:
                continue
            stored = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, stored)  # ``stored`` now holds the old values
            old.append(stored)
        if old and (held := _held_elsewhere(old)):
            raise RuntimeError(
                f"{name or 'experts'}: {held} other tensor(s) still hold the weights in their "
                "old dtype (a state dict taken before the conversion?) and would go on reading "
                "the old values (a checkpoint saving them); convert before anything takes them")
    return numel


def _held_elsewhere(old: list[torch.Tensor]) -> int:
    # live tensors on the old weights' storages besides the one each of ``old`` holds (a
    # parameter's own tensor, or a DTensor's local shard; the wrapper has no storage): a state
    # dict or a view taken before the conversion is one
    storages = [_local(t).untyped_storage().data_ptr() for t in old]
    live = {pointer for pointer in storages if pointer != 0}
    found = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): some module proxies warn when their class is read
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            found += obj.untyped_storage().data_ptr() in live
        except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage of its own
            continue
    return found - sum(pointer in live for pointer in storages)
