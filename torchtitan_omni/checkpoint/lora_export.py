"""LoRA checkpoints out of torchtitan-omni: merged into the base, or the adapters alone.

``scripts/convert_checkpoint.py dcp-to-hf`` on a checkpoint of a LoRA run (the config's
``[lora]`` must be the run's):

- by default every adapted weight is written merged, ``W + (alpha / r) B A`` (per expert for
  grouped experts), so the Hugging Face folders hold no LoRA tensors and load in
  ``transformers`` as plain models (:func:`merged_reader`). An adapter-only checkpoint
  (``lora.save_adapter_only``) holds no base: the base tensors come from the config's
  ``weights.sources`` (Hugging Face folders or DCP checkpoints), the trained ones from the
  checkpoint;
- ``--adapter-only`` writes what the run trained (adapters and ``lora.train_modules``) under
  our names to one small safetensors file with its settings (:func:`export_adapter`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors.torch import save_file

from torchtitan_omni.checkpoint.completion import read_manifest
from torchtitan_omni.checkpoint.safetensors_folder import CheckpointFormatError
from torchtitan_omni.checkpoint.tensor_readers import (
    ChainReader, DCPReader, Meta, TensorReader, sources_reader,
)
from torchtitan_omni.modules.lora import (
    adapter_names, is_adapter_key, lora_modules, merge_table, merged_weight,
)

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def holds_adapters(checkpoint: DCPReader) -> bool:
    """Whether a DCP checkpoint holds LoRA adapter tensors."""
    return any(is_adapter_key(n) for n in checkpoint.names() if not n.startswith("optimizer."))


class MergedReader:
    """Base tensors with their adapters merged in; every other tensor as ``base`` has it."""

    def __init__(self, base: TensorReader, adapters: TensorReader,
                 table: dict[str, tuple[str, str, float]]) -> None:
        self.base, self.adapters, self.table = base, adapters, table
        self.where = base.where

    def meta(self, name: str) -> Meta | None:
        meta = self.base.meta(name)
        if meta is None or name not in self.table:
            return meta
        a = self.adapters.meta(self.table[name][0])
        return meta[0], torch.promote_types(meta[1], a[1]) if a else meta[1]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = self.base.read(names)
        merged = [n for n in names if n in self.table]
        pairs = self.adapters.read([x for n in merged for x in self.table[n][:2]])
        for n in merged:
            a, b, scale = self.table[n]
            out[n] = merged_weight(out[n], pairs[a], pairs[b], scale)
        return out


def check_run_settings(model: nn.Module, checkpoint: str, saved: DCPReader,
                       settings: dict) -> None:
    """The config's ``[lora]`` must be the run's: every adapter of ``model`` in the checkpoint
    with its shape, and the rank and alpha the checkpoint's manifest records (if any)."""
    params = dict(model.named_parameters())
    for name in sorted(adapter_names(model)):
        meta = saved.meta(name)
        if meta is None or tuple(meta[0]) != tuple(params[name].shape):
            found = "missing" if meta is None else f"{tuple(meta[0])} there"
            raise CheckpointFormatError(
                f"{checkpoint} does not hold the LoRA adapter tensors of this config "
                f"({name} {tuple(params[name].shape)}: {found}): the config's [lora] must "
                "be the run's")
    recorded = (read_manifest(checkpoint) or {}).get("lora") or {}
    for key in ("rank", "alpha"):
        if key in recorded and recorded[key] != settings[key]:
            raise CheckpointFormatError(
                f"{checkpoint} was trained with lora.{key} = {recorded[key]}, the config has "
                f"{settings[key]}")


def merged_reader(model: nn.Module, checkpoint: str, weights_sources: list[str],
                  settings: dict) -> MergedReader:
    """The tensors of ``model`` (adapted by ``torchtitan_omni.lora.apply_lora``) to export from
    a LoRA run's ``checkpoint``, adapters merged (see the module docstring); ``settings``: the
    config's ``[lora]`` values (``torchtitan_omni.lora.lora_settings``)."""
    saved = DCPReader(checkpoint)
    check_run_settings(model, checkpoint, saved, settings)
    table = merge_table(model)
    base: TensorReader = saved
    if (read_manifest(checkpoint) or {}).get("adapter_only"):
        if not weights_sources:
            raise CheckpointFormatError(
                f"{checkpoint} is adapter-only and the config has no weights.sources: the base "
                "weights it was trained on cannot be found (export a full checkpoint instead)")
        base = ChainReader([saved, sources_reader(model, weights_sources)])
    return MergedReader(base, saved, table)


@dataclass
class AdapterReport:
    """What :func:`export_adapter` wrote."""

    path: str
    tensors: int
    bytes: int
    modules: int


def export_adapter(model: nn.Module, parts: list[str], checkpoint: str, out: str,
                   settings: dict) -> AdapterReport:
    """Write the tensors a LoRA run trained (adapters, ``lora.train_modules``) of ``parts``
    from ``checkpoint`` to ``out/ADAPTER_FILE`` under our names, with ``settings`` (the
    ``[lora]`` values) in ``out/ADAPTER_CONFIG``."""
    saved = DCPReader(checkpoint)
    check_run_settings(model, checkpoint, saved, settings)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n in trained if any(n == p or n.startswith(p + ".") for p in parts)]
    missing = [n for n in names if saved.meta(n) is None]
    if missing:
        raise CheckpointFormatError(
            f"{checkpoint} lacks {len(missing)} trained tensors of this config (e.g. "
            f"{missing[0]}): the config's [lora] must be the run's")
    tensors = {n: t.contiguous() for n, t in saved.read(names).items()}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, ADAPTER_FILE)
    save_file(tensors, path, metadata={"format": "pt", "lora_rank": str(settings["rank"]),
                                       "lora_alpha": str(settings["alpha"])})
    modules = [n for n, _ in lora_modules(model)
               if any(n == p or n.startswith(p + ".") for p in parts)]
    adapters = adapter_names(model)
    config = {"format": "torchtitan-omni-lora", **settings, "parts": parts,
              "adapted_modules": modules,
              "trained_in_full": sorted(n for n in names if n not in adapters)}
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return AdapterReport(path, len(tensors), size, len(modules))
