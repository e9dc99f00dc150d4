"""The parts of an omni model that weights are loaded into, and their tensors by name.

A part is any sub-module named by its dotted path (``llm``, ``encoders.vision``,
``decoders.gen_image.vq``). Its tensors are its parameters and persistent buffers, named
relative to the part as in an unwrapped model: the segments that activation checkpointing and
``torch.compile`` insert (``_checkpoint_wrapped_module``, ``_orig_mod``) are removed, as
``get_model_state_dict`` does, so names match both HF adapters and DCP checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_omni.compat import persistent_buffers
from torchtitan_omni.errors import CheckpointFormatError
from torchtitan_omni.modules.lora import adapter_names

_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_name(name: str) -> str:
    """``name`` without the segments wrappers insert."""
    return ".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS)


def state_tensors(module: nn.Module, adapters: bool = False) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``module``, by clean name (tied names all listed).

    LoRA adapters (``torchtitan_omni.modules.lora``) are left out unless ``adapters``: what
    Hugging Face folders and base checkpoints hold, and what an export writes, is the base.
    """
    out: dict[str, torch.Tensor] = {}
    skip = set() if adapters else adapter_names(module)
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in skip:
            continue
        out[clean_name(name)] = param
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for buf_name, buf in persistent_buffers(mod):
            out[clean_name(f"{mod_name}.{buf_name}" if mod_name else buf_name)] = buf
    return out


def top_level_parts(model: nn.Module) -> list[str]:
    """``llm``, ``encoders.<name>`` and ``decoders.<name>`` of an omni model (for messages)."""
    names = []
    for name, _ in model.named_children():
        child = getattr(model, name)
        if isinstance(child, nn.ModuleDict):
            names += [f"{name}.{k}" for k in child.keys()]
        else:
            names.append(name)
    return names


def resolve_part(model: nn.Module, part: str) -> nn.Module:
    """The sub-module at ``part`` (a clean dotted path), or a clear error."""
    modules = {clean_name(n): m for n, m in model.named_modules()}
    module = modules.get(part)
    if module is None or not part:
        raise CheckpointFormatError(
            f"weights.sources names part {part!r}, which is not a module of the model "
            f"(parts: {', '.join(top_level_parts(model))})"
        )
    return module


def tied_aliases(tensors: dict[str, torch.Tensor], sourced) -> dict[str, str]:
    """Names in ``tensors`` that are the very tensor of a name in ``sourced`` (a tied head is
    the embedding): alias -> the sourced name. They are loaded and saved through that name."""
    owner = {id(tensors[n]): n for n in sourced if n in tensors}
    return {name: owner[id(t)] for name, t in tensors.items()
            if name not in sourced and id(t) in owner}
