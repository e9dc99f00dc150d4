"""JSON-lines files read line by line: a line that is not JSON is one bad sample, named by its
file and line, not a failed file; and rows of one file may differ in shape (Arrow, which
``datasets`` uses, needs one schema per file).

Blank lines are not rows; rows keep their 1-based line numbers. Map-style access indexes the
line starts once per process (the file is memory-mapped; a gzipped file is decompressed into
memory). A ``.json`` file whose first character is ``[`` is one JSON array, one row per item.
"""

from __future__ import annotations

import gzip
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_omni.errors import DataFileError

#: characters of a bad line quoted in its message
QUOTE_CHARS = 60


@dataclass(frozen=True)
class UnreadableLine:
    """A line that is not a JSON value; ``parse_row`` reports it as ``invalid_json``."""

    error: str
    text: str

    def describe(self) -> str:
        """The parse error and the start of the line, on one line."""
        quoted = self.text if len(self.text) <= QUOTE_CHARS else self.text[:QUOTE_CHARS] + "..."
        return f"{self.error}: {quoted!r}"


def parse_line(raw: bytes) -> Any:
    """The JSON value of one line, or an :class:`UnreadableLine` saying why there is none."""
    raw = raw.rstrip(b"\r\n")  # streamed lines keep their end: report both readers alike
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return UnreadableLine(f"not UTF-8 text ({e.reason} at byte {e.start})",
                              raw.decode("utf-8", "replace").strip())
    text = text.lstrip("\ufeff")  # a byte-order mark some editors write at the start
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return UnreadableLine(f"not valid JSON: {e.msg} (column {e.colno})", text.strip())


def _is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def _open(path: str):
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def _is_array_file(path: str) -> bool:
    """A ``.json`` (or ``.json.gz``) file holding one JSON array rather than JSON lines."""
    if not (path.endswith(".json") or path.endswith(".json.gz")):
        return False
    with _open(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _read_array(path: str) -> list[Any]:
    with _open(path) as f:
        raw = f.read()
    try:
        rows = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(
            f"data file {path} starts with '[' but is not one JSON array: {e}") from None
    if not isinstance(rows, list):
        raise DataFileError(f"data file {path} is not a JSON array of rows")
    return rows


class JsonlFile:
    """The rows of one JSON-lines file: ``len``, random access and a sequential stream."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data: Any = None  # mmap or bytes of the whole file
        self._starts: np.ndarray | None = None  # byte offset of each row's line
        self._ends: np.ndarray | None = None
        self._lines: np.ndarray | None = None  # 1-based line number of each row
        self._array: list[Any] | None = None

    def __getstate__(self) -> dict:
        # An mmap does not pickle (spawned loader workers); each process re-indexes.
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _load(self) -> None:
        if self._starts is not None or self._array is not None:
            return
        try:
            if _is_array_file(self.path):
                self._array = _read_array(self.path)
                return
            if _is_gzip(self.path):
                with gzip.open(self.path, "rb") as f:
                    data: Any = f.read()
            elif os.path.getsize(self.path) == 0:
                data = b""
            else:
                with open(self.path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, EOFError) as e:
            raise DataFileError(f"cannot read data file {self.path}: {e}") from None
        starts, ends, lines = [], [], []
        pos, number, size = 0, 0, len(data)
        while pos < size:
            nl = data.find(b"\n", pos)
            end = size if nl < 0 else nl
            number += 1
            if data[pos:end].strip():
                starts.append(pos)
                ends.append(end)
                lines.append(number)
            pos = end + 1
        self._data = data
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray(ends, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        self._load()
        return len(self._array) if self._array is not None else len(self._starts)

    def row(self, index: int) -> tuple[Any, int | None]:
        """``(value, line)`` of row ``index``: the parsed JSON value (or an
        :class:`UnreadableLine`) and its 1-based line number (None in a JSON array file)."""
        self._load()
        if self._array is not None:
            return self._array[index], None
        start, end = int(self._starts[index]), int(self._ends[index])
        return parse_line(self._data[start:end]), int(self._lines[index])

    def stream(self) -> Iterator[tuple[Any, int | None]]:
        """``(value, line)`` of every row in file order, reading one line at a time."""
        if _is_array_file(self.path):
            yield from ((row, None) for row in _read_array(self.path))
            return
        number = 0
        try:
            with _open(self.path) as f:
                for raw in f:
                    number += 1
                    if raw.strip():
                        yield parse_line(raw), number
        except (OSError, EOFError) as e:
            raise DataFileError(
                f"cannot read data file {self.path} after line {number}: {e}") from None
