"""A Hugging Face safetensors folder: which file holds which tensor, their shapes, and sliced
reads of only the rows and columns a rank owns.

Headers are parsed directly (8-byte length + JSON), so opening a folder reads no tensor data
and a truncated file is caught before any read: every tensor's byte range must lie inside its
file. Reads go through ``safetensors.safe_open(...).get_slice``, which memory-maps the file and
copies only the requested block.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open

from torchtitan_omni.checkpoint.sharding import Runs, local_shape
from torchtitan_omni.errors import CheckpointFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: our tensors without a Hugging Face counterpart (an adapter's ``init_only``), by our names,
#: written next to an export so that importing it back loses nothing; not an HF file
EXTRA_FILE = "torchtitan_omni_extra.safetensors"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorInfo:
    """Where one HF tensor lives and what it is."""

    file: str  # absolute path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.dtype)


def read_header(path: str) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header, checked against the file size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointFormatError(
                    f"{path}: not a safetensors file (shorter than 8 bytes)"
                )
            (length,) = struct.unpack("<Q", raw)
            if length > size - 8:
                raise CheckpointFormatError(
                    f"{path}: header of {length} bytes does not fit in a file of {size} bytes "
                    "(truncated or not a safetensors file)"
                )
            header = json.loads(f.read(length))
    except OSError as e:
        raise CheckpointFormatError(f"cannot read {path}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for key, entry in header.items():
        end = entry["data_offsets"][1]
        if end > data_size:
            raise CheckpointFormatError(
                f"{path}: tensor {key} ends at byte {end} of the data section, which holds "
                f"only {data_size} bytes (the file is truncated)"
            )
    return header


class SafetensorsFolder:
    """Index of a Hugging Face safetensors checkpoint folder (sharded or single-file), or of
    the given ``files`` only."""

    def __init__(self, folder: str, files: list[str] | None = None) -> None:
        self.folder = folder
        if not os.path.isdir(folder):
            raise CheckpointFormatError(f"Hugging Face checkpoint folder not found: {folder}")
        by_file: dict[str, set[str]] = ({f: set() for f in files} if files is not None
                                        else self._files())
        self.tensors: dict[str, TensorInfo] = {}
        for path, expected in by_file.items():
            for key, entry in read_header(path).items():
                if key in self.tensors:
                    raise CheckpointFormatError(
                        f"{folder}: tensor {key} is in both "
                        f"{os.path.basename(self.tensors[key].file)} "
                        f"and {os.path.basename(path)}"
                    )
                self.tensors[key] = TensorInfo(path, tuple(entry["shape"]), entry["dtype"])
            for key in expected:
                info = self.tensors.get(key)
                if info is None or info.file != path:
                    raise CheckpointFormatError(
                        f"{folder}/{INDEX_FILE} says {key} is in {os.path.basename(path)}, "
                        "but that file's header does not list it"
                    )
        self._handles: dict[str, object] = {}

    def _files(self) -> dict[str, set[str]]:
        """Absolute file path -> keys the index promises in it (empty set: no index)."""
        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointFormatError(
                    f"{index}: not a valid safetensors index ({e})"
                ) from None
            files: dict[str, set[str]] = {}
            for key, name in weight_map.items():
                files.setdefault(os.path.join(self.folder, name), set()).add(key)
            for path in files:
                if not os.path.isfile(path):
                    raise CheckpointFormatError(
                        f"{index} lists {os.path.basename(path)}, which is missing"
                    )
            return files
        names = sorted(n for n in os.listdir(self.folder)
                       if n.endswith(".safetensors") and n != EXTRA_FILE)
        if not names:
            raise CheckpointFormatError(
                f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face safetensors "
                "folder)"
            )
        return {os.path.join(self.folder, n): set() for n in names}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, key: str) -> TensorInfo:
        return self.tensors[key]

    def _handle(self, path: str):
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return handle

    def read(self, key: str, runs: list[Runs] | None = None) -> torch.Tensor:
        """``key``'s block given by per-dimension index runs (None: the whole tensor)."""
        info = self.tensors[key]
        handle = self._handle(info.file)
        if runs is None or not info.shape:
            return handle.get_tensor(key)
        if any(not r for r in runs):
            dtype = info.torch_dtype or torch.float32
            return torch.empty(local_shape(runs), dtype=dtype)
        part = handle.get_slice(key)
        return _read_runs(lambda sl: part[sl], runs)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_runs(get, runs: list[Runs]) -> torch.Tensor:
    """Read the block of ``runs`` with one slice per combination of runs, concatenated."""
    split = next((d for d, r in enumerate(runs) if len(r) > 1), None)
    if split is None:
        return get(tuple(slice(r[0][0], r[0][1]) for r in runs))
    pieces = [_read_runs(get, runs[:split] + [[run]] + runs[split + 1:]) for run in runs[split]]
    return torch.cat(pieces, dim=split)
