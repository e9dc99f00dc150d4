"""The rows of one split: data files found under the dataset root, cut into shards
(data-parallel rank x loader worker), in a seeded per-epoch order.

JSON lines are read by ``torchtitan_omni.data.jsonl`` (line by line: a line that is not JSON is
one bad sample, and rows of a file may differ in shape); Parquet with ``datasets`` (Arrow).
Map-style (default): every file is indexed (JSONL) or loaded (memory-mapped Arrow) and each
epoch visits all rows in a fresh seeded permutation; shard ``s`` of ``n`` takes positions
``s, s + n, ...``. Streaming (``data.streaming``): files are read in order (their order
shuffled per epoch); whole files go to shards when their number divides evenly, else every
``n``-th row. Either way a shard's rows are numbered ``q = 0, 1, ...`` per epoch, which is all
the resumable state needs.

A dataset root holding a class-name mapping is a folder of ImageNet-style class folders
(``torchtitan_omni.data.image_folders``): each class folder of the split is read as one file.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np

from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.image_folders import MAPPING_FILES, ClassFolder, class_folders
from torchtitan_omni.data.jsonl import JsonlFile
from torchtitan_omni.errors import DataFileError

_EXTENSIONS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
               ".parquet": "parquet"}


def file_format(path: str, fmt: str = "auto") -> str:
    """The reader of a data file: "json" (JSON lines) or "parquet"."""
    if fmt == "jsonl":
        return "json"
    if fmt != "auto":
        return fmt
    for ext, builder in _EXTENSIONS.items():
        if path.endswith(ext):
            return builder
    raise DataFileError(f"data file {path} has an unknown extension (known: "
                        f"{', '.join(_EXTENSIONS)}); set data.format")


def find_files(path: str, split: str) -> list[str]:
    """Data files of ``split`` under the dataset root ``path`` (or ``path`` itself, a file); the
    class folders of the split when ``path`` holds a class-name mapping."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset path {path} does not exist")
    folders = class_folders(path, split)
    if folders is not None:
        return folders
    found: set[str] = set()
    for ext in _EXTENSIONS:
        for pattern in (f"{split}{ext}", f"{split}-*{ext}", f"{split}_*{ext}", f"{split}/**/*{ext}",
                        f"data/{split}{ext}", f"data/{split}-*{ext}"):
            found.update(glob.glob(os.path.join(path, pattern), recursive=True))
    if not found:
        listing = ", ".join(sorted(os.listdir(path))[:20]) or "nothing"
        raise FileNotFoundError(
            f"no data files for split {split!r} in {path} (looked for {split}.jsonl, "
            f"{split}-*.parquet, {split}/*.jsonl, ..., or {MAPPING_FILES[0]} beside "
            f"{split}/<class>/ folders; it holds: {listing})"
        )
    return sorted(found)


def _load_parquet(file: str, streaming: bool):
    try:
        ds = datasets.load_dataset("parquet", data_files=[file], split="train",
                                   streaming=streaming)
    except Exception as e:  # noqa: BLE001  (datasets/pyarrow raise many types for bad files)
        raise DataFileError(f"cannot read Parquet file {file}: {e}") from None
    # Keep encoded media as {"bytes", "path"}: the processors decode it themselves.
    features = getattr(ds, "features", None) or {}
    for name, feat in features.items():
        if type(feat).__name__ in ("Image", "Audio", "Video") and getattr(feat, "decode", False):
            ds = ds.cast_column(name, type(feat)(decode=False))
    return ds


class ParquetFile:
    """The rows of one Parquet file, read with ``datasets`` (the same interface as
    :class:`~torchtitan_omni.data.jsonl.JsonlFile`; rows have no line numbers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._table = None

    def _loaded(self):
        if self._table is None:
            self._table = _load_parquet(self.path, streaming=False)
        return self._table

    def __len__(self) -> int:
        return len(self._loaded())

    def row(self, index: int) -> tuple[Any, None]:
        """``(row, None)`` of row ``index``."""
        return self._loaded()[int(index)], None

    def stream(self) -> Iterator[tuple[Any, None]]:
        """``(row, None)`` of every row in file order, without loading the file."""
        for row in _load_parquet(self.path, streaming=True):
            yield row, None


def open_file(path: str, fmt: str = "auto") -> JsonlFile | ParquetFile | ClassFolder:
    """The reader of one data file (``data.format``: "auto" picks by extension) or class
    folder."""
    if os.path.isdir(path):
        return ClassFolder(path)
    return ParquetFile(path) if file_format(path, fmt) == "parquet" else JsonlFile(path)


@dataclass(frozen=True)
class ShardSpec:
    """Which shard of the split this iterator reads."""

    index: int
    count: int


class RowSource:
    """Rows of one split, in seeded per-epoch order, shard by shard."""

    def __init__(self, files: list[str], fmt: str = "auto", streaming: bool = False,
                 seed: int = 0, shuffle: bool = True) -> None:
        self.files = list(files)
        self.fmt = fmt
        self.streaming = streaming
        self.seed = seed
        self.shuffle = shuffle
        self._readers = [open_file(f, fmt) for f in self.files]
        self._offsets: list[int] | None = None
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ----------------------------------------------------------------- map-style
    def _ensure_loaded(self) -> None:
        if self._offsets is None:
            self._offsets = list(np.cumsum([0] + [len(r) for r in self._readers]))

    def __len__(self) -> int:
        self._ensure_loaded()
        return int(self._offsets[-1])

    def row(self, index: int) -> tuple[Any, Source]:
        """Row ``index`` of the concatenated files (map-style only): the row as read (see
        ``parse_row``) and where it comes from."""
        self._ensure_loaded()
        f = bisect.bisect_right(self._offsets, index) - 1
        local = int(index - self._offsets[f])
        value, line = self._readers[f].row(local)
        return value, Source(self.files[f], local, line)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self)
        if not self.shuffle:
            order = np.arange(n)
        else:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        self._order_cache = (epoch, order)
        return order

    # ----------------------------------------------------------------- both
    def shard_rows(
        self, shard: ShardSpec, epoch: int, start: int = 0
    ) -> Iterator[tuple[int, dict, Source]]:
        """``(q, row, source)`` for the shard's rows ``q >= start`` of ``epoch``."""
        if self.streaming:
            yield from self._stream(shard, epoch, start)
            return
        order = self._order(epoch)
        for q in range(start, (len(order) - shard.index + shard.count - 1) // shard.count):
            row, src = self.row(int(order[q * shard.count + shard.index]))
            yield q, row, src

    def shard_row(self, shard: ShardSpec, epoch: int, q: int) -> tuple[dict, Source]:
        """Row ``q`` of the shard in ``epoch``, i.e. position ``q * count + index`` of the
        epoch's order (map-style random access)."""
        order = self._order(epoch)
        return self.row(int(order[q * shard.count + shard.index]))

    # ----------------------------------------------------------------- streaming
    def _file_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.files)))
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        return [int(i) for i in perm]

    def _stream(
        self, shard: ShardSpec, epoch: int, start: int
    ) -> Iterator[tuple[int, dict, Source]]:
        files = self._file_order(epoch)
        by_file = len(files) % shard.count == 0
        if by_file:
            files = files[shard.index::shard.count]
        q = 0  # the shard's row number
        g = 0  # the global row number (row-level sharding)
        for f in files:
            for local, (row, line) in enumerate(self._readers[f].stream()):
                mine = by_file or g % shard.count == shard.index
                g += 1
                if not mine:
                    continue
                if q >= start:
                    yield q, row, Source(self.files[f], local, line)
                q += 1
