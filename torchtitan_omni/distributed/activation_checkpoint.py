"""Per-part activation checkpointing, applied in place (parameter names do not change).

The LLM's units (the plan's ``ac_units`` of the ``llm`` part) follow TorchTitan's
``[activation_checkpoint]``: ``mode = "none" | "full" | "selective"``, where selective takes
``selective_ac_option`` = N (every N-th unit, counted per part), ``"op"`` (every unit, saving
the outputs of matmuls, attention and all-to-alls and recomputing the rest) or ``"attention"``
(every unit, saving only the attention kernel's outputs: the one part of a block whose
recompute grows with the square of its documents' length, for about one activation of memory
a block). Encoder and decoder units follow their ``activation_checkpoint``: their
``[parallelism.parts."<part>"]`` table's, else ``omni.encoder_activation_checkpoint``
(``"none" | "full" | "op" | "attention"``, the last two the per-op selective modes). Under
expert parallel the per-op modes need the experts outside FSDP (``config.values`` refuses them
otherwise): an FSDP unit of the experts' own would run its hooks inside the block.
``omni.encoder_checkpoint_min_tokens`` exempts their small calls: a unit whose input holds
fewer rows (tokens, patches, frames) than that runs without a checkpoint.
Those calls save little memory, and on the GPU their recompute is almost all host time (an
encoder block on a few thumbnails: dozens of kernel launches for microseconds of work each).
The result is the same either way: recomputing repeats the forward exactly.

A unit checkpointed whole (full, or every N-th) whose MoE layers read their expert exchange's
split sizes on the host (the exact dispatcher) records those sizes in its forward and replays
them in its recompute (``torchtitan_omni.distributed.recompute_tape``): one host sync per layer
and step instead of two. Per-op selective checkpointing keeps its own contexts (under
``torch.compile`` they must be dispatch modes).

A checkpointed unit gets :class:`Checkpointed` first in its class
(``torchtitan_omni.modules.wrapping.extend_class``), whose ``forward`` runs the unit's own
through ``torch.utils.checkpoint.checkpoint`` (non-reentrant): parameter names, hence the
layout-invariant init and checkpoints, stay the same with and without AC, and FSDP's hooks
(which live in ``__call__``) stay outside the checkpointed region, so the recomputation neither
re-gathers parameters nor confuses per-op SAC (as PyTorch's composable ``checkpoint`` would:
its hooks run inside FSDP's).

With ``keep_exchanges`` (``parallelism.expert_ac_keep_exchanges``) a unit holding MoE layers
under expert parallel (:func:`pieces_around_exchanges`) is not checkpointed whole but piece by
piece around its all-to-alls: each child without such a layer (norms, attention) and each such
layer's ``experts``. The dispatch and combine exchanges then run outside every checkpoint, once
forward and once backward: 4 per layer and step instead of the 6 of a checkpointed block,
whose recompute exchanges again (and, with the exact dispatcher, reads the split sizes on the
host again). What autograd keeps in their place, per MoE layer: the experts' input (the rows
received for this rank's experts) and the combined rows times their router weights, about
``2 x tokens x top_k x dim`` activations (0.5 GiB for Qwen3-30B-A3B at 8K in bf16) against the
block input a whole checkpoint keeps. (A selective checkpoint of the whole block that saves
the exchanges' results does not work here: the experts' own FSDP unit runs its hooks inside
the block, and they run other ops in the recompute than in the forward, which selective
checkpointing refuses.)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchtitan_omni.distributed.expert_parallel import expert_parallel_layers
from torchtitan_omni.distributed.recompute_tape import checkpoint_contexts
from torchtitan_omni.modules.wrapping import extend_class

# The attention kernels (by name, every overload): what ``selective_ac_option = "attention"``
# keeps. Their outputs are about one activation a block (the output and a row of softmax
# statistics per head), their recompute the block's only work quadratic in document length.
# Where SDPA takes its math path (on CPU for the per-document calls' unbatched [heads, tokens,
# dim] inputs) it runs matmuls and a softmax, no kernel of this list: there the option
# recomputes what full AC does.
_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
    "flash_varlen",  # modules.attention's operator around _flash_attention_forward
}
# Per-op selective checkpointing ("op") keeps the outputs of these ops: matmuls (float8
# linears run ``_scaled_mm`` on GPUs; emulated float8 runs ``mm``), attention, and all-to-alls
# (torch's functional collective: Ulysses' head/sequence exchanges): recomputing an exchange
# would put communication back on the backward's critical path (TorchTitan's MoE models keep
# theirs for the same reason). The rest is recomputed.
_SAVE_OPS = {
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "all_to_all_single",
} | _ATTENTION_OPS
# ... and of these overloads: a whole tensor's max is what float8 scales come from (a scalar
# to keep, as TorchTitan's list does; ``max.dim`` and the like are recomputed)
_SAVE_OVERLOADS = {torch.ops.aten.max.default}


def _keep(op, names: set[str], overloads: Collection = ()) -> CheckpointPolicy:
    """Save the outputs of the ops named in ``names`` (every overload) and of ``overloads``;
    recompute the rest."""
    packet = getattr(op, "overloadpacket", None)
    if (packet is not None and packet.__name__ in names) or op in overloads:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _op_policy(ctx, op, *args, **kwargs):
    return _keep(op, _SAVE_OPS, _SAVE_OVERLOADS)


def _attention_policy(ctx, op, *args, **kwargs):
    return _keep(op, _ATTENTION_OPS)


def _op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def _attention_context():
    return create_selective_checkpoint_contexts(_attention_policy)


#: the per-op selective options: what each keeps
PER_OP_OPTIONS = {"op": _op_context, "attention": _attention_context}


def pieces_around_exchanges(unit: nn.Module) -> list[nn.Module]:
    """What to checkpoint for ``unit`` so that no expert-parallel exchange runs inside a
    checkpoint: ``[unit]`` without MoE layers under expert parallel, else each child holding
    none of them and, for each, its ``experts`` (see the module docstring)."""
    layers = expert_parallel_layers(unit)
    if not layers:
        return [unit]
    if any(layer is unit for layer in layers):
        return [unit.get_submodule("experts")]
    return [piece for child in unit.children() for piece in pieces_around_exchanges(child)]


def checkpoint_units(units: list[nn.Module], mode: str, option: str = "1", *,
                     preserve_rng_state: bool = True, keep_exchanges: bool = False,
                     min_rows: int = 0) -> int:
    """Checkpoint ``units`` (in model order) by ``mode``; returns how many were wrapped.
    ``keep_exchanges``: units with MoE layers under expert parallel are checkpointed around
    their exchanges (:func:`pieces_around_exchanges`), each counting as one unit wrapped.
    ``min_rows``: calls whose first tensor input has fewer rows (its elements over its last
    dimension) run without the checkpoint (0: every call is checkpointed)."""
    if mode == "none" or not units:
        return 0
    kwargs: dict[str, Any] = {"preserve_rng_state": preserve_rng_state, "use_reentrant": False}
    if mode == "full":
        every = 1
    elif mode == "selective" and option in PER_OP_OPTIONS:
        every = 1
        kwargs["context_fn"] = PER_OP_OPTIONS[option]
    elif mode == "selective":
        try:
            every = int(option)
        except ValueError:
            raise ValueError(
                f"activation_checkpoint.selective_ac_option must be 'op', 'attention' or a whole "
                f"number, got {option!r}"
            ) from None
        if every < 1:
            raise ValueError(f"activation_checkpoint.selective_ac_option must be >= 1, got {every}")
    else:
        raise ValueError(f"activation checkpoint mode {mode!r} is not supported here")
    wrapped = 0
    for i, unit in enumerate(units):
        if (i + 1) % every == 0:
            for piece in pieces_around_exchanges(unit) if keep_exchanges else [unit]:
                options = kwargs
                if "context_fn" not in kwargs and _reads_host_sizes(piece):
                    options = {**kwargs, "context_fn": checkpoint_contexts}
                _checkpoint_forward(piece, options, min_rows)
            wrapped += 1
    return wrapped


def _reads_host_sizes(unit: nn.Module) -> bool:
    """Whether ``unit`` holds an expert dispatcher that reads split sizes on the host (its
    recompute then replays them from the forward's tape)."""
    return any(getattr(getattr(m, "dispatcher", None), "host_sync", False)
               for m in unit.modules())


class Checkpointed(nn.Module):
    """Mixin: the unit's forward under ``torch.utils.checkpoint`` (options in
    ``_omni_checkpoint_options``), except for calls whose first tensor input has fewer rows
    than ``_omni_checkpoint_min_rows``."""

    _omni_checkpoint_options: dict
    _omni_checkpoint_min_rows: int = 0

    def forward(self, *args, **kwargs):
        if self._omni_checkpoint_min_rows and _rows(args) < self._omni_checkpoint_min_rows:
            return super().forward(*args, **kwargs)
        return checkpoint(super().forward, *args, **self._omni_checkpoint_options, **kwargs)


def _rows(args: tuple) -> int:
    """Rows of the first tensor among ``args``: its elements over its last dimension."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None or x.dim() == 0:
        return 0
    return x.numel() // max(1, x.shape[-1])


def _checkpoint_forward(unit: nn.Module, kwargs: dict, min_rows: int = 0) -> None:
    if isinstance(unit, Checkpointed):
        raise ValueError(f"{type(unit).__name__} is activation-checkpointed twice")
    extend_class(unit, Checkpointed, _omni_checkpoint_options=kwargs,
                 _omni_checkpoint_min_rows=min_rows)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_units` checkpointed ``module``."""
    return isinstance(module, Checkpointed)
