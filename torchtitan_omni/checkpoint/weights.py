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

from torchtitan_omni.checkpoint.completion import DCP_METADATA, resolve_checkpoint, scan
from torchtitan_omni.checkpoint.hf_loader import LoadReport, load_part_from_hf
from torchtitan_omni.checkpoint.parts import resolve_part, state_tensors, top_level_parts
from torchtitan_omni.checkpoint.safetensors_folder import INDEX_FILE
from torchtitan_omni.errors import CheckpointFormatError


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
            if other.part == part or other.part.startswith(part + ".") or part.startswith(other.part + "."):
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
    """Load the part at ``part`` from a DCP checkpoint of an omni model (same tensor names)."""
    folder = resolve_checkpoint(path)
    module = resolve_part(model, part)
    tensors = {f"{part}.{name}": t for name, t in state_tensors(module).items()}
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    problems = []
    for key, t in tensors.items():
        md = saved.get(key)
        if md is None:
            problems.append(f"missing tensor {key} in {folder}")
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} in {folder} is not a tensor")
        elif tuple(md.size) != tuple(t.shape):
            problems.append(
                f"shape mismatch: {key} is {tuple(t.shape)} in the model, {tuple(md.size)} in {folder}"
            )
    if problems:
        raise CheckpointFormatError(
            f"cannot load part {part!r} from {folder}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems[:25])
        )
    dcp.load({k: t.detach() for k, t in tensors.items()}, checkpoint_id=folder)
    report = LoadReport(part, folder, tensors=len(tensors))
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
        read = f", {report.bytes_read / 2**20:.1f} MiB read by this rank" if report.bytes_read else ""
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
