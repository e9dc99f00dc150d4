"""ImageNet-style class folders, read as image-generation rows.

A dataset root that holds a class-name mapping keeps its images in ``{split}/<wnid>/<file>``
(the ILSVRC layout). The mapping is one of :data:`MAPPING_FILES`: lines
``n01440764 tench, Tinca tinca`` (``LOC_synset_mapping.txt`` of Kaggle's ILSVRC download, or
Caffe's ``synset_words.txt``), or a JSON object ``{"n01440764": "tench, Tinca tinca"}`` (a
value may also be a list of names). Each class folder is read like a data file
(:class:`ClassFolder`): its files, sorted by name, are its rows
``{"caption": "Draw a tench.", "gen_image": <path>}``, the caption naming the class by its first
name (the wording of the bundled dataset's generation task). Hidden files (``.name``) are not
rows; every other file is, and one that is not an image is reported as ``corrupt_media`` when
read. A class folder missing from the mapping, a file beside the class folders or a folder
inside one stops the loader with one line naming it: nothing is dropped unseen.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

from torchtitan_omni.errors import DataFileError

#: the class-name mapping files a class-folder dataset root may hold (exactly one of them)
MAPPING_FILES = ("LOC_synset_mapping.txt", "synset_words.txt", "synset_mapping.json")


def mapping_file(root: str) -> str | None:
    """The class-name mapping file in ``root``, or None when ``root`` is no class-folder root."""
    found = [os.path.join(root, n) for n in MAPPING_FILES if os.path.isfile(os.path.join(root, n))]
    if len(found) > 1:
        raise DataFileError(f"{root} holds {' and '.join(map(os.path.basename, found))}: keep "
                            "one class-name mapping")
    return found[0] if found else None


def _first_name(names: str) -> str:
    return names.split(",")[0].strip()


def _read_json(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"cannot read class-name mapping {path}: {e}") from None
    if not isinstance(raw, dict):
        raise DataFileError(f"class-name mapping {path} is a JSON {type(raw).__name__}, not an "
                            "object {wnid: name}")
    out = {}
    for wnid, value in raw.items():
        name = value[0] if isinstance(value, list) and value else value
        if not isinstance(name, str) or not _first_name(name):
            raise DataFileError(f"class-name mapping {path} key {wnid!r}: the class name is "
                                f"{value!r:.60}, not a non-empty string")
        out[wnid] = _first_name(name)
    return out


def _read_lines(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"cannot read class-name mapping {path}: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or not _first_name(parts[1]):
            raise DataFileError(f"{path} line {number}: expected '<wnid> <name>[, <other "
                                f"names>]', got {line.strip()!r:.60}")
        if parts[0] in out:
            raise DataFileError(f"{path} line {number}: class {parts[0]} is named twice")
        out[parts[0]] = _first_name(parts[1])
    return out


def class_names(path: str) -> dict[str, str]:
    """Class folder name (wnid) -> the class's first name, read from a mapping file."""
    try:
        stat = os.stat(path)
    except OSError as e:
        raise DataFileError(f"cannot read class-name mapping {path}: {e}") from None
    # every class folder asks: read once per version of the file
    return _class_names(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _class_names(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    out = _read_json(path) if path.endswith(".json") else _read_lines(path)
    if not out:
        raise DataFileError(f"class-name mapping {path} names no class")
    return out


def caption(name: str) -> str:
    """The generation prompt of a class: ``Draw a tench.``"""
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"Draw {article} {name}."


def _visible(folder: str) -> list[os.DirEntry]:
    return sorted((e for e in os.scandir(folder) if not e.name.startswith(".")),
                  key=lambda e: e.name)


def class_folders(root: str, split: str) -> list[str] | None:
    """The class folders of ``split`` when ``root`` holds a class-name mapping, else None."""
    mapping = mapping_file(root)
    if mapping is None:
        return None
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"no folder {split_dir} of class folders for split {split!r} "
                                f"(the dataset root holds the class-name mapping {mapping})")
    names = class_names(mapping)
    entries = _visible(split_dir)
    files = [e.name for e in entries if not e.is_dir()]
    if files:
        more = ", ..." if len(files) > 3 else ""
        raise DataFileError(f"{split_dir} holds files beside its class folders "
                            f"({', '.join(files[:3])}{more}): put each image in the folder of "
                            "its class, <wnid>/ (Kaggle's LOC_val_solution.csv names the class "
                            "of each val image)")
    if not entries:
        raise DataFileError(f"{split_dir} holds no class folders")
    for e in entries:
        if e.name not in names:
            raise DataFileError(f"class folder {os.path.join(split_dir, e.name)} is not in "
                                f"{mapping} ({len(names)} classes)")
    return [os.path.join(split_dir, e.name) for e in entries]


class ClassFolder:
    """The images of one class folder ``<root>/<split>/<wnid>`` as rows (the interface of
    :class:`~torchtitan_omni.data.jsonl.JsonlFile`; rows have no line numbers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: list[str] | None = None
        self._caption = ""

    def _load(self) -> list[str]:
        if self._files is None:
            root = os.path.dirname(os.path.dirname(self.path))
            mapping = mapping_file(root)
            if mapping is None:
                raise DataFileError(f"{self.path} is a folder, not a data file, and {root} holds "
                                    f"no class-name mapping ({', '.join(MAPPING_FILES)})")
            name = class_names(mapping).get(os.path.basename(self.path))
            if name is None:
                raise DataFileError(f"class folder {self.path} is not in {mapping}")
            entries = _visible(self.path)
            inner = [e.name for e in entries if e.is_dir()]
            if inner:
                raise DataFileError(f"class folder {self.path} holds folders ({inner[0]}, ...): "
                                    "its images must lie directly in it")
            self._caption = caption(name)
            self._files = [os.path.abspath(e.path) for e in entries]
        return self._files

    def __len__(self) -> int:
        return len(self._load())

    def row(self, index: int) -> tuple[dict, None]:
        """``(row, None)`` of image ``index`` (sorted by file name)."""
        return {"caption": self._caption, "gen_image": self._load()[int(index)]}, None

    def stream(self) -> Iterator[tuple[dict, None]]:
        """``(row, None)`` of every image, sorted by file name."""
        for path in self._load():
            yield {"caption": self._caption, "gen_image": path}, None
