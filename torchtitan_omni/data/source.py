"""The rows of one split: data files found under the dataset root, read with ``datasets``,
cut into shards (data-parallel rank x loader worker), in a seeded per-epoch order.

Map-style (default): every file is loaded (memory-mapped Arrow) and each epoch visits all rows
in a fresh seeded permutation; shard ``s`` of ``n`` takes positions ``s, s + n, ...``.
Streaming (``data.streaming``): files are read in order (their order shuffled per epoch);
whole files go to shards when their number divides evenly, else every ``n``-th row. Either way
a shard's rows are numbered ``q = 0, 1, ...`` per epoch, which is all the resumable state needs.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from torchtitan_omni.data.bad_samples import Source

_EXTENSIONS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
               ".parquet": "parquet"}


def file_format(path: str, fmt: str = "auto") -> str:
    """The ``datasets`` builder ("json" or "parquet") of a data file."""
    if fmt == "jsonl":
        return "json"
    if fmt != "auto":
        return fmt
    for ext, builder in _EXTENSIONS.items():
        if path.endswith(ext):
            return builder
    raise ValueError(f"data file {path} has an unknown extension (known: {', '.join(_EXTENSIONS)});"
                     " set data.format")


def find_files(path: str, split: str) -> list[str]:
    """Data files of ``split`` under the dataset root ``path`` (or ``path`` itself, a file)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"dataset path {path} does not exist")
    found: set[str] = set()
    for ext in _EXTENSIONS:
        for pattern in (f"{split}{ext}", f"{split}-*{ext}", f"{split}_*{ext}", f"{split}/**/*{ext}",
                        f"data/{split}{ext}", f"data/{split}-*{ext}"):
            found.update(glob.glob(os.path.join(path, pattern), recursive=True))
    if not found:
        listing = ", ".join(sorted(os.listdir(path))[:20]) or "nothing"
        raise FileNotFoundError(
            f"no data files for split {split!r} in {path} (looked for {split}.jsonl, "
            f"{split}-*.parquet, {split}/*.jsonl, ...; it holds: {listing})"
        )
    return sorted(found)


def _load(file: str, fmt: str, streaming: bool):
    import datasets

    try:
        ds = datasets.load_dataset(file_format(file, fmt), data_files=[file], split="train",
                                   streaming=streaming)
    except Exception as e:
        raise ValueError(
            f"cannot read data file {file} with datasets: {e} (every row of a file must share "
            "one schema: e.g. 'images' always a list, message 'content' always a string)"
        ) from None
    # Keep encoded media as {"bytes", "path"}: the processors decode it themselves.
    features = getattr(ds, "features", None) or {}
    for name, feat in features.items():
        if type(feat).__name__ in ("Image", "Audio", "Video") and getattr(feat, "decode", False):
            ds = ds.cast_column(name, type(feat)(decode=False))
    return ds


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
        self._tables = None
        self._offsets: list[int] = []
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ----------------------------------------------------------------- map-style
    def _ensure_loaded(self) -> None:
        if self._tables is None:
            self._tables = [_load(f, self.fmt, False) for f in self.files]
            self._offsets = list(np.cumsum([0] + [len(t) for t in self._tables]))

    def __len__(self) -> int:
        self._ensure_loaded()
        return int(self._offsets[-1])

    def row(self, index: int) -> tuple[dict, Source]:
        """Row ``index`` of the concatenated files (map-style only)."""
        self._ensure_loaded()
        f = bisect.bisect_right(self._offsets, index) - 1
        local = index - self._offsets[f]
        return self._tables[f][int(local)], Source(self.files[f], int(local))

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
    def shard_rows(self, shard: ShardSpec, epoch: int, start: int = 0) -> Iterator[tuple[int, dict, Source]]:
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
    def _file_order(self, epoch: int) -> list[str]:
        if not self.shuffle:
            return list(self.files)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        return [self.files[i] for i in perm]

    def _stream(self, shard: ShardSpec, epoch: int, start: int) -> Iterator[tuple[int, dict, Source]]:
        files = self._file_order(epoch)
        by_file = len(files) % shard.count == 0
        if by_file:
            files = files[shard.index::shard.count]
        q = 0  # the shard's row number
        g = 0  # the global row number (row-level sharding)
        for file in files:
            for local, row in enumerate(_load(file, self.fmt, True)):
                mine = by_file or g % shard.count == shard.index
                g += 1
                if not mine:
                    continue
                if q >= start:
                    yield q, row, Source(file, local)
                q += 1
