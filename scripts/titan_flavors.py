"""Llama-3-8B cut to fewer layers, as flavors of stock TorchTitan 0.2.2's ``llama3`` model.

The omni runs keep the first N blocks of the 8B foundation (``--omni.llm_layers N``) to fit a
real layer shape on fewer GPUs; their stock baseline needs the same shape. TorchTitan reads
flavors from ``torchtitan.models.llama3.llama3_args`` (the dict its ``TrainSpec`` holds), and
imports ``--experimental.custom_import`` before it looks the flavor up, so from the
repository root:

    torchrun --nproc_per_node 1 -m torchtitan.train --experimental.custom_import \\
        scripts.titan_flavors --model.name llama3 --model.flavor 8B_16L ...

registers ``8B_<N>L`` (Llama-3-8B's arguments with ``n_layers = N``) for N in
:data:`LAYER_CUTS`.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3 import llama3_args

LAYER_CUTS = (4, 8, 12, 16, 20, 24, 28)


def flavor_name(layers: int) -> str:
    """The flavor of Llama-3-8B cut to ``layers`` blocks."""
    return f"8B_{layers}L"


def register() -> None:
    """Add the cut flavors to stock TorchTitan's llama3 flavors (idempotent)."""
    for n in LAYER_CUTS:
        llama3_args.setdefault(flavor_name(n), dataclasses.replace(llama3_args["8B"], n_layers=n))


register()
