"""Initial weights per part (``[weights] sources``): Hugging Face folders or DCP checkpoints.

Each entry is ``part=path``: ``llm=/ckpt/Meta-Llama-3-8B``, ``encoders.vision=/ckpt/qwen2vl``,
``decoders.gen_image.vq=/outputs/vq/checkpoint``. The path is a Hugging Face safetensors
folder (loaded through the part's adapter, ``hf_loader``) or a DCP checkpoint (a ``step-N``
folder, or a checkpoint root whose newest complete step is used), whose tensors are named as
in the omni model (``llm.layers.0...``); DCP reads only what overlaps each rank's shard. Parts
without an entry keep their layout-invariant random initialization.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.completion import (
    DCP_METADATA, read_manifest, resolve_checkpoint, scan,
)
from torchtitan_omni.checkpoint.hf_loader import LoadReport, load_part_from_hf
from torchtitan_omni.checkpoint.parts import resolve_part, state_tensors, top_level_parts
from torchtitan_omni.checkpoint.safetensors_folder import INDEX_FILE
from torchtitan_omni.errors import CheckpointFormatError
from torchtitan_omni.modules.lora import adapter_names, is_adapter_key


@dataclass(frozen=True)
class WeightSource:
    """One ``part=path`` entry of ``weights.sources``."""

    part: str
    path: str


def parse_sources(entries: list[str]) -> list[WeightSource]:
    """``part=path`` entries, checked for form, duplicates and overlapping parts."""
    out: list[WeightSource] = []
    for entry in entries:
        part, eq, path = entry.partition("=")
        part, path = part.strip(), path.strip()
        if not eq or not part or not path:
            raise CheckpointFormatError(f"weights.sources entry {entry!r} is not 'part=path'")
        for other in out:
            if (
                other.part == part
                or other.part.startswith(part + ".")
                or part.startswith(other.part + ".")
            ):
                raise CheckpointFormatError(
                    f"weights.sources gives overlapping parts {other.part!r} and {part!r}"
                )
        out.append(WeightSource(part, os.path.expanduser(path)))
    return out


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` looks like a Hugging Face safetensors folder."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        return True
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a DCP checkpoint folder or a folder of ``step-N`` checkpoints."""
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return True
    complete, skipped = scan(path)
    return bool(complete or skipped)


@torch.no_grad()
def load_part_from_dcp(model: nn.Module, part: str, path: str) -> LoadReport:
    """Load the part at ``part`` from a DCP checkpoint of an omni model (same tensor names).
    LoRA adapters are loaded when the checkpoint has them (a LoRA run's full checkpoint) and
    otherwise keep their initialization (a base checkpoint)."""
    folder = resolve_checkpoint(path)
    module = resolve_part(model, part)
    tensors = {f"{part}.{name}": t for name, t in state_tensors(module).items()}
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    if not adapter_names(module) and any(is_adapter_key(k) for k in saved
                                         if k.startswith(part + ".")):
        raise CheckpointFormatError(
            f"cannot load part {part!r} from {folder}: it holds LoRA adapters, which this "
            "model has none of (they would be dropped unmerged): enable the run's [lora], or "
            "export it merged (scripts/convert_checkpoint.py) and load that")
    base, kept = set(tensors), []
    for name, t in state_tensors(module, adapters=True).items():
        if f"{part}.{name}" not in base:
            if f"{part}.{name}" in saved:
                tensors[f"{part}.{name}"] = t
            else:
                kept.append(name)
    problems = []
    for key, t in tensors.items():
        md = saved.get(key)
        if md is None:
            problems.append(f"missing tensor {key} in {folder}")
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} in {folder} is not a tensor")
        elif tuple(md.size) != tuple(t.shape):
            problems.append(
                f"shape mismatch: {key} is {tuple(t.shape)} in the model, {tuple(md.size)} in "
                f"{folder}"
            )
    if problems:
        hint = (" (an adapter-only LoRA checkpoint: it holds no base weights)"
                if (read_manifest(folder) or {}).get("adapter_only") else "")
        raise CheckpointFormatError(
            f"cannot load part {part!r} from {folder}{hint}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems[:25])
        )
    dcp.load({k: t.detach() for k, t in tensors.items()}, checkpoint_id=folder)
    report = LoadReport(part, folder, tensors=len(tensors), kept_init=kept)
    for t in tensors.values():
        report.checkpoint_bytes += t.numel() * t.element_size()
    return report


def load_initial_weights(model: nn.Module, entries: list[str]) -> list[LoadReport]:
    """Load every ``weights.sources`` entry into the (sharded, materialized) model."""
    sources = parse_sources(entries)
    reports = []
    for src in sources:
        resolve_part(model, src.part)  # a bad part name fails before any read
    for src in sources:
        begin = time.monotonic()
        if is_hf_folder(src.path):
            report = load_part_from_hf(model, src.part, src.path)
            kind = "Hugging Face"
        elif os.path.isdir(src.path) and is_dcp_checkpoint(src.path):
            report = load_part_from_dcp(model, src.part, src.path)
            kind = "DCP"
        else:
            raise CheckpointFormatError(
                f"weights.sources {src.part}={src.path}: "
                + ("no such folder" if not os.path.isdir(src.path)
                   else "neither a Hugging Face safetensors folder nor a DCP checkpoint")
            )
        read = (
            f", {report.bytes_read / 2**20:.1f} MiB read by this rank" if report.bytes_read else ""
        )
        logger.info(
            f"Loaded {src.part} from {kind} {report.path}: {report.tensors} tensors "
            f"({report.checkpoint_bytes / 2**20:.1f} MiB in full{read}) in "
            f"{time.monotonic() - begin:.1f}s"
        )
        for name, (start, stop) in report.mean_rows.items():
            logger.info(f"{src.part}.{name}: rows {start}..{stop - 1} (added tokens) start as "
                        f"the mean of rows 0..{start - 1}")
        if report.kept_init:
            shown = ", ".join(report.kept_init[:6]) + (" ..." if len(report.kept_init) > 6 else "")
            logger.info(f"{src.part}: {len(report.kept_init)} tensors have no counterpart in "
                        f"{src.path} and keep their initialization ({shown})")
        reports.append(report)
    loaded = {s.part for s in sources}
    random = [p for p in top_level_parts(model)
              if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in loaded)]
    if random:
        logger.info(f"Randomly initialized (no weights.sources entry): {', '.join(random)}")
    return reports


@torch.no_grad()
def load_job_weights(model: nn.Module, path: str, sources: list[str]) -> list[str]:
    """Every weight of a job's model from its DCP checkpoint ``path`` (a ``step-N`` folder or
    a checkpoint root): part by part, or, for an adapter-only LoRA checkpoint, the base from
    ``sources`` (the job's ``weights.sources``; without any, the model's seeded init stays)
    and then what the checkpoint holds. Returns the parts loaded."""
    folder = resolve_checkpoint(path)
    parts = top_level_parts(model)
    if not (read_manifest(folder) or {}).get("adapter_only"):
        for part in parts:
            load_part_from_dcp(model, part, folder)
        return parts
    if sources:
        load_initial_weights(model, sources)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    problems = [f"missing tensor {n} in {folder}" for n in trained if n not in saved]
    problems += [f"shape mismatch: {n} is {tuple(p.shape)} in the model, "
                 f"{tuple(saved[n].size)} in {folder}" for n, p in trained.items()
                 if n in saved and tuple(saved[n].size) != tuple(p.shape)]
    if problems or not trained:
        raise CheckpointFormatError(
            f"{folder} is an adapter-only LoRA checkpoint; this model "
            + ("has no LoRA (lora.enable)" if not trained else
               f"does not match it: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:25])))
    dcp.load({n: p.detach() for n, p in trained.items()}, checkpoint_id=folder)
    return parts
