"""Loading one part of a sharded omni model from a Hugging Face safetensors folder.

The part's adapter (``part.hf_adapter()``, see ``torchtitan_omni.protocols.hf``) says which HF
tensors make up each of our tensors. Before reading anything, every name and shape is checked
both ways: each of our parameters and persistent buffers has a source (or matches the adapter's
optional ``init_only()`` patterns: tensors the checkpoint has no counterpart of, such as a new
projector, which keep their initialization unless an export wrote them to ``EXTRA_FILE``),
each source exists with the expected shape, and each HF tensor in the folder is either loaded
or matched by the adapter's ``ignored_hf_keys``. All problems are reported at once, naming the
tensor and file.

Then each rank reads only its own block of each tensor (``torchtitan_omni.checkpoint
.sharding``): rows of an FSDP shard, the local experts of an expert-parallel stack (one HF key
per local expert; other experts' keys are never opened), everything for a replicated tensor.
Blocks are converted to the parameter's dtype and copied into the local shard in place.

A tied tensor (the head that is the embedding) is loaded once, through the name that has a
source. An embedding-shaped source with ``hf_rows`` / ``mean_rows`` (a vocabulary grown by added
tokens) loads the rows the checkpoint has, and the added tokens' rows get the mean of the
tokenizer's own rows, which a rank owning some of them computes by reading those rows in chunks.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from torchtitan_omni.checkpoint.parts import resolve_part, state_tensors, tied_aliases
from torchtitan_omni.checkpoint.safetensors_folder import (
    EXTRA_FILE, CheckpointFormatError, SafetensorsFolder,
)
from torchtitan_omni.checkpoint.sharding import local_runs, local_shape, local_tensor
from torchtitan_omni.protocols.hf import HFAdapter, HFSource

_MAX_LISTED = 25
#: rows read at a time when averaging an embedding (bounds the host memory of the mean)
_MEAN_CHUNK_ROWS = 8192


@dataclass
class LoadReport:
    """What loading one part did on this rank."""

    part: str
    path: str
    tensors: int = 0
    checkpoint_bytes: int = 0  # size of the HF tensors the part uses, whole
    bytes_read: int = 0  # what this rank read of them
    kept_init: list[str] = field(default_factory=list)  # init_only tensors left as they were
    #: tensors whose added-token rows were set to a mean: name -> (start, stop)
    mean_rows: dict[str, tuple[int, int]] = field(default_factory=dict)


def expected_hf_shape(shape: tuple[int, ...], source: HFSource) -> tuple[int, ...]:
    """Shape of each HF tensor of ``source`` for one of our tensors of ``shape``."""
    dims = list(shape)
    if source.hf_rows is not None:
        if source.stack_dim is not None or source.transpose or not dims:
            raise CheckpointFormatError("hf_rows needs a single, untransposed Hugging Face tensor")
        dims[0] = source.hf_rows
    if source.stack_dim is not None:
        dims.pop(source.stack_dim % len(shape))
    if source.transpose:
        if len(dims) != 2:
            raise CheckpointFormatError(
                f"transpose=True needs 2-D Hugging Face tensors, these would be {tuple(dims)}"
            )
        dims.reverse()
    return tuple(dims)


def _nbytes(folder: SafetensorsFolder, key: str) -> int:
    info = folder.info(key)
    n = 1
    for d in info.shape:
        n *= d
    return n * (info.torch_dtype.itemsize if info.torch_dtype else 1)


def init_only_patterns(adapter: HFAdapter) -> tuple[str, ...]:
    """``fnmatch`` patterns of our tensors the adapter's checkpoints have no counterpart of."""
    get = getattr(adapter, "init_only", None)
    return tuple(get()) if callable(get) else ()


def check_part(
    part: str, tensors: dict[str, torch.Tensor], adapter: HFAdapter, folder: SafetensorsFolder
) -> tuple[list[tuple[str, HFSource]], list[str]]:
    """Match ``tensors`` with the folder through ``adapter``; raise listing every problem.
    Returns what to load, and the ``init_only`` tensors without a source."""
    sources = adapter.sources()
    init_only = init_only_patterns(adapter)
    problems: list[str] = []
    unsourced: list[str] = []
    where = folder.folder
    tied = tied_aliases(tensors, sources)
    for name, t in tensors.items():
        if name in sources or name in tied:
            continue
        if any(fnmatch.fnmatchcase(name, pat) for pat in init_only):
            unsourced.append(name)
        else:
            problems.append(
                f"{part}.{name} {tuple(t.shape)}: the adapter gives no Hugging Face source"
            )
    for name in sources:
        if name not in tensors:
            problems.append(f"the adapter maps {part}.{name}, which the model does not have")
    used: set[str] = set()
    plan: list[tuple[str, HFSource]] = []
    for name, source in sources.items():
        if name not in tensors:
            continue
        shape = tuple(tensors[name].shape)
        used.update(source.keys)
        if source.stack_dim is not None:
            d = source.stack_dim % max(len(shape), 1)
            if not shape or shape[d] != len(source.keys):
                problems.append(
                    f"{part}.{name} {shape}: stacks {len(source.keys)} Hugging Face tensors along "
                    f"dim {source.stack_dim}, which has size {shape[d] if shape else 'none'}"
                )
                continue
        try:
            want = expected_hf_shape(shape, source)
        except CheckpointFormatError as e:
            problems.append(f"{part}.{name} {shape}: {e}")
            continue
        ok = True
        for key in source.keys:
            info = folder.tensors.get(key)
            if info is None:
                problems.append(
                    f"missing Hugging Face tensor {key} (source of {part}.{name}) in {where}"
                )
                ok = False
            elif info.shape != want:
                problems.append(
                    f"shape mismatch: {part}.{name} {shape} needs {key} of shape {want}, but "
                    f"{info.file} has {info.shape}"
                )
                ok = False
            elif info.torch_dtype is None:
                problems.append(f"{key} in {info.file} has unsupported dtype {info.dtype}")
                ok = False
        if ok:
            plan.append((name, source))
    ignored = adapter.ignored_hf_keys()
    for key in folder.keys():
        if key not in used and not any(fnmatch.fnmatchcase(key, pat) for pat in ignored):
            problems.append(
                f"unexpected Hugging Face tensor {key} in {folder.info(key).file}: not loaded by "
                f"{type(adapter).__name__} and not in its ignored_hf_keys"
            )
    if problems:
        more = (
            f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        )
        raise CheckpointFormatError(
            f"cannot load part {part!r} from {where}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems[:_MAX_LISTED]) + more
        )
    return plan, unsourced


def _read_block(folder: SafetensorsFolder, source: HFSource, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``tensor`` assembled from its HF tensors."""
    runs = local_runs(tensor)
    if source.stack_dim is None:
        block = folder.read(source.keys[0], runs[::-1] if source.transpose else runs)
        return block.t() if source.transpose else block
    s = source.stack_dim % tensor.dim()
    rest = runs[:s] + runs[s + 1:]
    hf_runs = rest[::-1] if source.transpose else rest
    pieces = []
    for start, stop in runs[s]:
        for i in range(start, stop):  # only this rank's experts are read
            piece = folder.read(source.keys[i], hf_runs)
            pieces.append(piece.t() if source.transpose else piece)
    if not pieces:
        return torch.empty(local_shape(runs))
    return torch.stack(pieces, dim=s)


def _row_mean(folder: SafetensorsFolder, key: str, rows: int, col_runs: list) -> torch.Tensor:
    """Mean of HF rows ``[0, rows)`` of ``key`` (this rank's columns), in float64."""
    total = None
    for start in range(0, rows, _MEAN_CHUNK_ROWS):
        chunk = folder.read(key, [[(start, min(rows, start + _MEAN_CHUNK_ROWS))], *col_runs])
        part = chunk.double().sum(0)
        total = part if total is None else total + part
    return total / rows


@torch.no_grad()
def load_vocab_tensor(folder: SafetensorsFolder, name: str, source: HFSource,
                      tensor: torch.Tensor) -> int:
    """Load an embedding-shaped tensor whose checkpoint has fewer rows (``hf_rows``) or some
    of whose rows belong to added tokens (``mean_rows``: set to the mean of the rows before
    them, the tokenizer's own tokens). Returns bytes read."""
    runs = local_runs(tensor)
    local = local_tensor(tensor)
    hf_rows = source.hf_rows if source.hf_rows is not None else tensor.shape[0]
    start, stop = source.mean_rows or (hf_rows, hf_rows)
    rows = torch.tensor([i for a, b in runs[0] for i in range(a, b)], dtype=torch.long)
    new = (rows >= start) & (rows < stop)
    if bool(((rows >= hf_rows) & ~new).any()):
        raise CheckpointFormatError(
            f"{name}: rows {hf_rows}..{tensor.shape[0] - 1} are neither in {folder.folder} nor "
            f"added tokens ({start}..{stop - 1})")
    read = [(a, min(b, hf_rows)) for a, b in runs[0] if a < hf_rows]
    nbytes = 0
    if read:
        block = folder.read(source.keys[0], [read, *runs[1:]])
        # local rows are sorted, so the checkpoint's rows are a prefix of them
        local[: block.shape[0]].copy_(block)
        nbytes += block.numel() * block.element_size()
    if bool(new.any()):
        if start < 1:
            raise CheckpointFormatError(f"{name}: no rows to average for the added tokens")
        mean = _row_mean(folder, source.keys[0], start, runs[1:])
        local[new.nonzero().squeeze(1)] = mean.to(local.dtype).expand(int(new.sum()), -1)
        nbytes += start * mean.numel() * folder.info(source.keys[0]).torch_dtype.itemsize
    return nbytes


@torch.no_grad()
def load_tensor(
    folder: SafetensorsFolder, name: str, source: HFSource, tensor: torch.Tensor
) -> int:
    """Copy this rank's block of ``tensor`` from the folder; returns bytes read."""
    if source.hf_rows is not None or source.mean_rows is not None:
        return load_vocab_tensor(folder, name, source, tensor)
    block = _read_block(folder, source, tensor)
    local = local_tensor(tensor)
    if tuple(block.shape) != tuple(local.shape):
        raise RuntimeError(
            f"{name}: read a block of shape {tuple(block.shape)} for a local shard of shape "
            f"{tuple(local.shape)} (placements {getattr(tensor, 'placements', None)})"
        )
    # copy_ casts on the fly (on the device for a GPU shard): no full-size cast copy on the host
    local.copy_(block)
    return block.numel() * block.element_size()


def load_part_from_hf(model: nn.Module, part: str, path: str) -> LoadReport:
    """Load the part at ``part`` of ``model`` from the HF safetensors folder ``path``."""
    module = resolve_part(model, part)
    get_adapter = getattr(module, "hf_adapter", None)
    adapter = get_adapter() if callable(get_adapter) else None
    if adapter is None:
        raise CheckpointFormatError(
            f"weights.sources gives a Hugging Face folder for {part!r}, but "
            f"{type(module).__name__} has no hf_adapter(); give a DCP checkpoint instead or "
            "leave it randomly initialized"
        )
    tensors = state_tensors(module)
    report = LoadReport(part, path)
    with SafetensorsFolder(path) as folder:
        plan, unsourced = check_part(part, tensors, adapter, folder)
        # File by file, unmapping each when done: the touched pages of a memory-mapped file
        # count as resident memory until it is closed.
        plan.sort(key=lambda item: folder.info(item[1].keys[0]).file)
        current = None
        for name, source in plan:
            file = folder.info(source.keys[0]).file
            if file != current:
                folder.close()
                current = file
            report.bytes_read += load_tensor(folder, f"{part}.{name}", source, tensors[name])
            report.tensors += 1
            if source.mean_rows is not None:
                report.mean_rows[name] = source.mean_rows
        report.checkpoint_bytes = sum(
            _nbytes(folder, k) for k in {k for _, s in plan for k in s.keys}
        )
    report.kept_init = _load_extras(part, path, {n: tensors[n] for n in unsourced}, report)
    return report


def _load_extras(
    part: str, path: str, tensors: dict[str, torch.Tensor], report: LoadReport
) -> list[str]:
    """Load ``init_only`` tensors an export saved under our names; returns those left as is."""
    extra = os.path.join(path, EXTRA_FILE)
    if not tensors or not os.path.isfile(extra):
        return sorted(tensors)
    with SafetensorsFolder(path, files=[extra]) as folder:
        kept = []
        for name, t in tensors.items():
            info = folder.tensors.get(name)
            if info is None:
                kept.append(name)
                continue
            if info.shape != tuple(t.shape):
                raise CheckpointFormatError(
                    f"shape mismatch: {part}.{name} {tuple(t.shape)}, {extra} has {info.shape}")
            report.bytes_read += load_tensor(folder, f"{part}.{name}", HFSource((name,)), t)
            report.tensors += 1
        return sorted(kept)
