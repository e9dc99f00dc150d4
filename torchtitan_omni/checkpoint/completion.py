"""Crash-safe checkpoint folders: write aside, publish by rename, verify before resuming.

A save writes into ``<folder>/saving-<step>.tmp``. Once every rank has written its files and
DCP's coordinator has written ``.metadata`` (which DCP does only after gathering every rank's
write results), rank 0 checks that each byte range ``.metadata`` records lies inside its file,
writes the completion marker ``omni_manifest.json`` (every file's name and size, the step, the
layout) and renames the folder to ``step-<step>``. A process killed at any point before the
rename leaves only a ``saving-*.tmp`` folder, which resume never considers.

Before resuming, a ``step-<N>`` folder is verified against its manifest: a folder without one
(an interrupted save of another tool, or a deleted marker), a missing file or a file whose size
differs (truncated by a full disk, a partial copy) is skipped with a log line naming the
reason, and the newest folder that passes is used.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass

from torchtitan.tools.logging import logger
from torchtitan_omni.errors import CheckpointFormatError

MANIFEST = "omni_manifest.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_DIR = re.compile(r"saving-(\d+)\.tmp")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def tmp_dir(final: str) -> str:
    """The folder a save into ``.../step-N`` writes to before it is published."""
    parent, name = os.path.split(final.rstrip("/"))
    m = _STEP_DIR.fullmatch(name)
    if not m:
        raise ValueError(f"not a checkpoint step folder: {final}")
    return os.path.join(parent, f"saving-{m.group(1)}.tmp")


def step_of(path: str) -> int | None:
    """The step of a ``step-N`` folder path, else None."""
    m = _STEP_DIR.fullmatch(os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


def _files(folder: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST:
                out[rel] = os.path.getsize(path)
    return out


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dcp_extent_problem(folder: str, files: dict[str, int]) -> str | None:
    """A byte range recorded in DCP's ``.metadata`` that its file does not hold, or None."""
    try:
        with open(os.path.join(folder, DCP_METADATA), "rb") as f:
            metadata = pickle.load(f)
    except FileNotFoundError:
        return f"no {DCP_METADATA} (DCP did not finish)"
    except Exception as e:  # noqa: BLE001  (a truncated pickle raises anything from EOFError to ValueError)
        return f"{DCP_METADATA} is unreadable ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            ends[path] = max(ends.get(path, 0), info.offset + info.length)
    for path, end in sorted(ends.items()):
        size = files.get(path)
        if size is None:
            return f"{path} is missing"
        if size < end:
            return (f"{path} is {size} bytes but {DCP_METADATA} records data up to byte {end} "
                    "(truncated)")
    return None


def publish(tmp: str, final: str, info: dict) -> None:
    """Verify a finished save in ``tmp``, write its manifest and rename it to ``final``."""
    files = _files(tmp)
    problem = dcp_extent_problem(tmp, files)
    if problem:
        raise RuntimeError(
            f"checkpoint save into {tmp} is incomplete: {problem}; not publishing it"
        )
    manifest = dict(info, format_version=FORMAT_VERSION, files=files, published=time.time())
    marker = os.path.join(tmp, MANIFEST)
    with open(marker + ".part", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".part", marker)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # an earlier run saved this step: replace it
        old = f"{final}.replaced-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
    if old:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(folder: str) -> dict | None:
    """The completion marker of a checkpoint folder, or None."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def verify(folder: str) -> str | None:
    """Why the checkpoint in ``folder`` must not be loaded, or None when it is complete."""
    if not os.path.isdir(folder):
        return "not found"
    marker = os.path.join(folder, MANIFEST)
    if not os.path.isfile(marker):
        return f"no completion marker {MANIFEST} (the save did not finish)"
    manifest = read_manifest(folder)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return f"completion marker {MANIFEST} is unreadable"
    for rel, size in sorted(manifest["files"].items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{rel} is {actual} bytes, the manifest says {size} (truncated or overwritten)"
    if DCP_METADATA not in manifest["files"]:
        return f"the manifest lists no {DCP_METADATA}"
    return None


@dataclass
class Candidate:
    step: int
    path: str
    manifest: dict


def scan(folder: str) -> tuple[list[Candidate], list[str]]:
    """Complete checkpoints in ``folder`` (oldest first) and one line per skipped folder."""
    complete: list[Candidate] = []
    skipped: list[str] = []
    if not os.path.isdir(folder):
        return complete, skipped
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if _TMP_DIR.fullmatch(name):
            skipped.append(f"{name}: an interrupted save (never published)")
            continue
        m = _STEP_DIR.fullmatch(name)
        if not m or not os.path.isdir(path):
            continue
        problem = verify(path)
        if problem:
            skipped.append(f"{name}: {problem}")
        else:
            complete.append(Candidate(int(m.group(1)), path, read_manifest(path) or {}))
    complete.sort(key=lambda c: c.step)
    return complete, skipped


def remove_interrupted_saves(folder: str) -> None:
    """Delete ``saving-*.tmp`` folders left by killed saves (rank 0, before any new save)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if _TMP_DIR.fullmatch(name):
            logger.warning(f"Removing {os.path.join(folder, name)}: a save that was interrupted")
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def resolve_checkpoint(path: str) -> str:
    """A loadable DCP checkpoint folder for ``path``: a checkpoint folder (verified against its
    manifest, or, written by another tool, against DCP's own metadata) or a checkpoint root
    (its newest complete ``step-N``)."""
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            problem = verify(path)
        else:
            problem = dcp_extent_problem(path, _files(path))
            if not problem:
                logger.warning(f"{path} has no {MANIFEST} (not written by torchtitan-omni): "
                               "checked against DCP's metadata only")
        if problem:
            raise CheckpointFormatError(f"checkpoint {path} cannot be loaded: {problem}")
        return path
    complete, skipped = scan(path)
    if not complete:
        why = ("; ".join(skipped)) if skipped else "no step-N folders and no .metadata"
        raise CheckpointFormatError(f"no complete DCP checkpoint in {path} ({why})")
    for line in skipped:
        logger.warning(f"{path}: skipping {line}")
    return complete[-1].path
