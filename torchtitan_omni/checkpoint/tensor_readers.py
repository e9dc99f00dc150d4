"""Whole tensors of an omni model, by full name, read from where they are stored.

The exporter (``hf_export``) reads each output shard's tensors whole through a reader:

- :class:`DCPReader`: a DCP checkpoint (DCP assembles each tensor from every rank's chunks);
- :class:`HFPartReader`: one part's tensors from a Hugging Face folder, assembled through the
  part's adapter table (``HFSource``: per-expert keys stacked, transposes undone) by the
  loader's own reading code, plus what an earlier export wrote under our names
  (``EXTRA_FILE``);
- :func:`sources_reader`: the ``weights.sources`` entries of a config (HF or DCP per part);
- :class:`ChainReader`: the first reader that has a tensor.

Names are full FQNs of the omni model (``llm.layers.0.attention.wq.weight``).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_omni.checkpoint.completion import resolve_checkpoint
from torchtitan_omni.checkpoint.hf_loader import load_tensor
from torchtitan_omni.checkpoint.parts import resolve_part
from torchtitan_omni.checkpoint.safetensors_folder import EXTRA_FILE, SafetensorsFolder
from torchtitan_omni.checkpoint.weights import is_hf_folder, parse_sources
from torchtitan_omni.errors import CheckpointFormatError
from torchtitan_omni.protocols.hf import HFAdapter, HFSource

Meta = tuple[tuple[int, ...], torch.dtype]


class TensorReader(Protocol):
    """Reads whole tensors by full name."""

    #: where the tensors come from, for messages
    where: str

    def meta(self, name: str) -> Meta | None:
        """(shape, dtype) of ``name``, or None when this reader does not have it."""

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The whole tensors ``names`` (each one this reader has)."""


class DCPReader:
    """Tensors of a DCP checkpoint, read in this process (no process group)."""

    def __init__(self, checkpoint: str) -> None:
        self.where = checkpoint
        saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        self._meta = {k: (tuple(md.size), md.properties.dtype) for k, md in saved.items()
                      if isinstance(md, TensorStorageMetadata)}

    def names(self) -> list[str]:
        """Every tensor the checkpoint holds."""
        return list(self._meta)

    def meta(self, name: str) -> Meta | None:
        return self._meta.get(name)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {n: torch.empty(self._meta[n][0], dtype=self._meta[n][1]) for n in names}
        if out:
            dcp.load(out, checkpoint_id=self.where, no_dist=True)
        return out


def _our_shape(hf_shape: tuple[int, ...], source: HFSource) -> tuple[int, ...]:
    """Shape of our tensor made of HF tensors of ``hf_shape`` (inverse of the loader's)."""
    dims = list(hf_shape)
    if source.transpose:
        dims.reverse()
    if source.stack_dim is not None:
        d = source.stack_dim % (len(dims) + 1)
        dims.insert(d, len(source.keys))
    return tuple(dims)


class HFPartReader:
    """One part's tensors from a Hugging Face folder, through the part's adapter."""

    def __init__(self, part: str, folder: str, adapter: HFAdapter) -> None:
        self.where = folder
        self.prefix = part + "."
        self.sources = adapter.sources()
        self.folder = SafetensorsFolder(folder)
        extra = os.path.join(folder, EXTRA_FILE)
        self.extras = SafetensorsFolder(folder, files=[extra]) if os.path.isfile(extra) else None

    def _lookup(self, name: str) -> tuple[SafetensorsFolder, HFSource] | None:
        if not name.startswith(self.prefix):
            return None
        rel = name[len(self.prefix):]
        source = self.sources.get(rel)
        if source is not None and all(k in self.folder.tensors for k in source.keys):
            return self.folder, source
        if self.extras is not None and rel in self.extras.tensors:
            return self.extras, HFSource((rel,))
        return None

    @staticmethod
    def _meta(folder: SafetensorsFolder, source: HFSource) -> Meta:
        info = folder.info(source.keys[0])
        if info.torch_dtype is None:
            raise CheckpointFormatError(
                f"{source.keys[0]} in {info.file} has unsupported dtype {info.dtype}")
        return _our_shape(info.shape, source), info.torch_dtype

    def meta(self, name: str) -> Meta | None:
        found = self._lookup(name)
        return self._meta(*found) if found is not None else None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            found = self._lookup(name)
            if found is None:
                raise KeyError(f"{name} is not in {self.where}")
            folder, source = found
            shape, dtype = self._meta(folder, source)
            out[name] = torch.empty(shape, dtype=dtype)
            load_tensor(folder, name, source, out[name])
        return out


class ChainReader:
    """Each tensor from the first of ``readers`` that has it."""

    def __init__(self, readers: list[TensorReader]) -> None:
        self.readers = readers
        self.where = " or ".join(r.where for r in readers)

    def _first(self, name: str) -> TensorReader | None:
        return next((r for r in self.readers if r.meta(name) is not None), None)

    def meta(self, name: str) -> Meta | None:
        reader = self._first(name)
        return reader.meta(name) if reader is not None else None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        groups: dict[int, list[str]] = {}
        for name in names:
            reader = self._first(name)
            if reader is None:  # read by none of the readers: not silently left out
                raise KeyError(f"{name} is not in {self.where}")
            groups.setdefault(id(reader), []).append(name)
        out = {}
        for reader in self.readers:
            out.update(reader.read(groups.get(id(reader), [])))
        return out


def sources_reader(model: nn.Module, entries: list[str]) -> ChainReader:
    """The tensors ``weights.sources`` gives the model (``model`` on the meta device is
    enough: only its parts' adapters are used)."""
    readers: list[TensorReader] = []
    for src in parse_sources(entries):
        if is_hf_folder(src.path):
            module = resolve_part(model, src.part)
            get = getattr(module, "hf_adapter", None)
            if not callable(get):
                continue  # the loader refuses it; nothing here to read
            readers.append(HFPartReader(src.part, src.path, get()))
        else:
            readers.append(_PartDCPReader(src.part, resolve_checkpoint(src.path)))
    return ChainReader(readers)


class _PartDCPReader(DCPReader):
    """The tensors of one part (``part.``-prefixed names) of a DCP checkpoint."""

    def __init__(self, part: str, checkpoint: str) -> None:
        super().__init__(checkpoint)
        self.prefix = part + "."

    def meta(self, name: str) -> Meta | None:
        return super().meta(name) if name.startswith(self.prefix) else None
