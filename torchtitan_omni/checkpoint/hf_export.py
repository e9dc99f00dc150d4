"""DCP checkpoints to Hugging Face folders and back, through the parts' adapter tables.

Export (``export_part``) never materializes the model: the model is built on the meta device
for names, shapes and adapters; each output shard's tensors are read whole from the DCP
checkpoint (DCP assembles them from every rank's chunks), split into HF tensors by the same
``HFSource`` table the loader uses (stacked experts unbound, transposes undone), cast, and
written; so peak memory is about one shard (``max_shard_size``). Each part goes to its own
folder with ``config.json`` from its adapter (``hf_config()``) and an index when sharded. Tensors
the adapter declares ``init_only`` (no HF counterpart, e.g. a new projector) are written under
our names to ``EXTRA_FILE`` next to them, outside the index, so importing the folder back
restores them too. The tensors come through a reader (``tensor_readers``): the checkpoint, or
for LoRA checkpoints the base with the adapters merged in (``lora_export``).

Import is the loader itself: build the sharded model, load ``part=path`` sources
(``torchtitan_omni.checkpoint.weights``) and save the model as a published DCP checkpoint
(``save_model_checkpoint``), which the trainer resumes from (a step-0 checkpoint loads the
model only) or ``weights.sources`` reads per part.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchtitan.tools.logging import logger

from torchtitan_omni.checkpoint.completion import publish, step_dir, tmp_dir
from torchtitan_omni.checkpoint.parts import state_tensors, tied_aliases, top_level_parts
from torchtitan_omni.checkpoint.hf_loader import init_only_patterns
from torchtitan_omni.checkpoint.safetensors_folder import (
    EXTRA_FILE, INDEX_FILE, SINGLE_FILE, CheckpointFormatError,
)
from torchtitan_omni.checkpoint.tensor_readers import DCPReader, TensorReader
from torchtitan_omni.distributed.utils import barrier
from torchtitan_omni.protocols.hf import HFAdapter, HFSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def adapter_of(module: nn.Module) -> HFAdapter | None:
    get = getattr(module, "hf_adapter", None)
    return get() if callable(get) else None


def exportable_parts(model: nn.Module) -> dict[str, HFAdapter]:
    """Part path -> adapter: each top-level part with an adapter, else its highest
    sub-modules that have one."""
    out: dict[str, HFAdapter] = {}

    def visit(path: str, module: nn.Module) -> None:
        adapter = adapter_of(module)
        if adapter is not None:
            out[path] = adapter
            return
        for name, child in module.named_children():
            visit(f"{path}.{name}", child)

    for part in top_level_parts(model):
        visit(part, model.get_submodule(part))
    return out


def split_to_hf(tensor: torch.Tensor, source: HFSource) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one of our full tensors is made of (inverse of the loader)."""
    pieces = [tensor] if source.stack_dim is None else list(tensor.unbind(source.stack_dim))
    if len(pieces) != len(source.keys):
        raise CheckpointFormatError(
            f"{len(source.keys)} Hugging Face keys for {len(pieces)} slices ({source.keys[0]}, ...)"
        )
    return [
        (key, (p.t() if source.transpose else p).contiguous())
        for key, p in zip(source.keys, pieces)
    ]


def _unmapped(part: str, names: dict[str, torch.Tensor], adapter: HFAdapter) -> list[str]:
    """Our tensors without an HF name that the adapter declares ``init_only`` (exported under
    our names to ``EXTRA_FILE``); any other gap is an error."""
    sources = adapter.sources()
    init_only = init_only_patterns(adapter)
    tied = tied_aliases(names, sources)  # a tied head is written as the embedding
    extras: list[str] = []
    lost: list[str] = []
    for n in names:
        if n not in sources and n not in tied:
            (extras if any(fnmatch.fnmatchcase(n, p) for p in init_only) else lost).append(n)
    unknown = [n for n in sources if n not in names]
    if lost or unknown:
        lines = [f"{part}.{n} has no Hugging Face name (it would be lost)" for n in lost]
        lines += [f"the adapter maps {part}.{n}, which the model does not have" for n in unknown]
        raise CheckpointFormatError(f"cannot export {part}:\n  " + "\n  ".join(lines[:25]))
    return extras


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)


@dataclass
class ExportReport:
    part: str
    folder: str
    tensors: int  # HF tensors written
    files: int
    bytes: int
    extras: int = 0  # init_only tensors written under our names to EXTRA_FILE


def export_part(model: nn.Module, part: str, adapter: HFAdapter, checkpoint: str, out: str,
                dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
                reader: TensorReader | None = None) -> ExportReport:
    """Write ``part`` of the DCP ``checkpoint`` as a Hugging Face folder ``out``; ``reader``
    (default: the checkpoint itself) supplies the tensors, e.g. LoRA-merged ones."""
    tensors = state_tensors(model.get_submodule(part))
    sources = adapter.sources()
    extras = _unmapped(part, tensors, adapter)
    for alias in tied_aliases(tensors, sources):
        del tensors[alias]
    reader = reader or DCPReader(checkpoint)
    problems = []
    for name, t in tensors.items():
        md = reader.meta(f"{part}.{name}")
        if md is None:
            problems.append(f"{part}.{name}: not in {reader.where}")
        elif tuple(md[0]) != tuple(t.shape):
            problems.append(f"{part}.{name}: {tuple(md[0])} in {reader.where}, "
                            f"{tuple(t.shape)} in the model")
    if problems:
        raise CheckpointFormatError(f"cannot export {part}:\n  " + "\n  ".join(problems[:25]))

    limit = _parse_size(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sources:  # adapter order keeps layers together
        shape, saved_dtype = reader.meta(f"{part}.{name}")
        n = saved_dtype.itemsize
        for d in shape:
            n *= d
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n

    writer = ShardedWriter(out, limit)
    out_dtype = None
    for names in shards:
        full = reader.read([f"{part}.{n}" for n in names])
        for n in names:
            for key, value in split_to_hf(full[f"{part}.{n}"], sources[n]):
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                if value.is_floating_point():
                    out_dtype = out_dtype or value.dtype
                writer.add(key, value)
        writer.flush()
        del full  # keep memory at about one shard
    files = writer.close()
    if extras:  # init_only tensors, under our names, outside the HF index
        full = reader.read([f"{part}.{n}" for n in extras])
        save_file({n: full[f"{part}.{n}"].contiguous() for n in extras},
                  os.path.join(out, EXTRA_FILE), metadata={"format": "pt"})
    config = dict(adapter.hf_config())
    if out_dtype in _DTYPE_NAMES:
        config["torch_dtype"] = _DTYPE_NAMES[out_dtype]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ExportReport(part, out, len(writer.weight_map), files, writer.total, len(extras))


class ShardedWriter:
    """Writes HF tensors into safetensors shards of about ``limit`` bytes, then the index.

    A key added twice (tied weights) must carry the same values; it is written once.
    """

    def __init__(self, folder: str, limit: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[str] = []
        self.weight_map: dict[str, int] = {}  # key -> shard number
        self.total = 0

    def add(self, key: str, value: torch.Tensor) -> None:
        if key in self.pending or key in self.weight_map:
            other = self.pending[key] if key in self.pending else self._read_back(key)
            if not torch.equal(other, value):
                raise CheckpointFormatError(f"{key} is mapped from tensors that differ")
            return
        size = value.numel() * value.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[key] = value.contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, os.path.join(self.folder, name), metadata={"format": "pt"})
        for key, value in self.pending.items():
            self.weight_map[key] = len(self.files)
            self.total += value.numel() * value.element_size()
        self.files.append(name)
        self.pending, self.pending_bytes = {}, 0

    def _read_back(self, key: str) -> torch.Tensor:
        with safe_open(
            os.path.join(self.folder, self.files[self.weight_map[key]]), framework="pt"
        ) as f:
            return f.get_tensor(key)

    def close(self) -> int:
        """Name the shards (``model.safetensors`` or ``model-i-of-n``), write the index."""
        self.flush()
        n = len(self.files)
        names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for tmp, final in zip(self.files, names):
            os.replace(os.path.join(self.folder, tmp), os.path.join(self.folder, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: names[i] for k, i in self.weight_map.items()}}
            with open(os.path.join(self.folder, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        return n


def copy_tokenizer(hf_assets_path: str | None, out: str) -> list[str]:
    """Copy the tokenizer files of ``model.hf_assets_path`` next to the exported LLM."""
    copied = []
    if hf_assets_path and os.path.isdir(hf_assets_path):
        for name in TOKENIZER_FILES:
            src = os.path.join(hf_assets_path, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out, name))
                copied.append(name)
    return copied


def save_model_checkpoint(
    model: nn.Module, folder: str, step: int = 0, layout: dict | None = None
) -> str:
    """Save the model alone as a published DCP checkpoint ``folder/step-<step>`` (collective)."""
    final = step_dir(folder, step)
    tmp = tmp_dir(final)
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=tmp)
    if not dist.is_initialized() or dist.get_rank() == 0:
        publish(tmp, final, {"step": step, "model_only": True, "layout": layout or {},
                             "torch": torch.__version__})
        logger.info(f"Published model-only checkpoint {final}")
    barrier()  # no rank returns before the checkpoint is published
    return final
