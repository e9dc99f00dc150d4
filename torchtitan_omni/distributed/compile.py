"""``torch.compile`` of the omni model's blocks and of its loss kernel (TorchTitan's ``[compile]``).

``components = ["model"]`` compiles every repeated block of every part (the plan's
``ac_units``: the LLM's layers, each encoder's blocks), one block at a time as TorchTitan
does, after activation checkpointing and before FSDP (a :class:`Compiled` mixin, see
``torchtitan_omni.modules.wrapping``): the compiled region is the block's
forward with its checkpoint (so selective per-op AC is traced too), while FSDP's all-gathers
and reduce-scatters stay outside it. Blocks of one class share their graphs.

Shapes vary from batch to batch (packed rows are padded to a multiple of
``data.pad_multiple``, media counts change): the first batch compiles static shapes and the
first change marks the varying sizes dynamic, so a job compiles each block class two or three
times and never again. :func:`compiled_graphs` counts the compilations; the trainer logs
their sum over the ranks (``compile/graphs``, "compiled graphs" on the console).

A block whose forward cannot be one graph says so with ``compile_fullgraph`` False (an MoE
block whose experts are an FSDP unit of their own, whose hooks dynamo never traces, or whose
dispatcher reads split sizes on the host; with its experts left out of FSDP and the gather or
capacity dispatch it is one graph, its recompute inside the compiled backward). It is compiled in
pieces with graph breaks, and *before* activation checkpointing (``compile_units(...,
graph_breaks=True)``), so the checkpoint wraps the compiled pieces: dynamo cannot split a
checkpointed region, and a graph break inside one would run the whole block eagerly. Its
pieces compile with dynamic sizes from the first batch: the split sizes enter them as host
integers, each of which would otherwise be specialized until it first changed, so new
variants kept coming for as long as some size had not yet changed (the token dispatch's
pieces: two more every other step on CPU, none with dynamic sizes).

``components = ["loss"]`` compiles the elementwise kernel of the chunked text-head loss and
the passes over its weight gradient's float32 sum
(``torchtitan_omni.modules.linear_cross_entropy``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_omni.compat import compiled_graph_count, raise_recompile_limit
from torchtitan_omni.modules.wrapping import extend_class
from torchtitan_omni.modules.linear_cross_entropy import (
    EAGER_SUM,
    LinearHead,
    WeightGradSum,
    fusable_loss_and_logit_grad,
)

#: compiled code objects are shared by all blocks that run the same forward (one mixin's
#: ``forward`` serves every part), so the per-code cache must hold every part's graphs and
#: their dynamic-shape variants
CACHE_SIZE_LIMIT = 64


class Compiled(nn.Module):
    """Mixin: the unit's forward (with its activation checkpoint, if any) as compiled by
    ``torch.compile``; FSDP's hooks in ``__call__`` stay outside the compiled region."""

    _omni_compiled_forward: object

    def forward(self, *args, **kwargs):
        return self._omni_compiled_forward(*args, **kwargs)


def breaks_graph(unit: nn.Module) -> bool:
    """Whether ``unit``'s forward cannot be one graph (``compile_fullgraph`` False)."""
    return not getattr(unit, "compile_fullgraph", True)


def compile_units(units: list[nn.Module], backend: str, graph_breaks: bool | None = None) -> int:
    """Compile each unit's forward (names and FSDP hooks unchanged); returns the count.

    ``graph_breaks``: compile only the units that break the graph (True), only those that are
    one graph (False), or all (None)."""
    raise_recompile_limit(CACHE_SIZE_LIMIT)
    if graph_breaks is not None:
        units = [u for u in units if breaks_graph(u) == graph_breaks]
    for unit in units:
        if isinstance(unit, Compiled):
            raise ValueError(f"{type(unit).__name__} is compiled twice")
        fullgraph = not breaks_graph(unit)
        inner = unit.forward  # the class's forward as it is now (possibly checkpointed)
        extend_class(unit, Compiled, _omni_compiled_forward=torch.compile(
            inner, backend=backend, fullgraph=fullgraph,
            dynamic=None if fullgraph else True))
    return len(units)


def compile_loss_heads(model: nn.Module, backend: str) -> int:
    """Use a compiled chunk kernel and compiled weight-gradient passes in every
    ``LinearHead``; returns how many heads."""
    kernel = torch.compile(fusable_loss_and_logit_grad, backend=backend)
    # a head's weight keeps its shape: a graph per head shape, sizes fixed (no bounds masks)
    sums = WeightGradSum(*(torch.compile(f, backend=backend, fullgraph=True, dynamic=False)
                           for f in EAGER_SUM))
    heads = [m for m in model.modules() if isinstance(m, LinearHead)]
    for head in heads:
        head.loss_kernel = kernel
        head.weight_grad_sum = sums
    return len(heads)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_units` compiled ``module``."""
    return isinstance(module, Compiled)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled so far in this process: one per compilation (first or
    recompile) of each compiled piece. Constant after the first few steps: no recompile storm."""
    return compiled_graph_count()
