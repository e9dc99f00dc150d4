"""The bundled default dataset (``training.dataset = "omni_default"``) and its tokenizer.

Built offline, once, from material shipped in package registries (see ``build``), into
``training.dataset_path`` (default ``./data/omni_default``), with a copy of its tokenizer put
at ``model.hf_assets_path`` when that folder has no ``tokenizer.json``. Several processes
(every rank of a launch) may ask at once: a file lock lets one build while the others wait,
and the folder appears atomically (built under a temporary name, then renamed).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from torchtitan.tools.logging import logger

from torchtitan_omni.data.default_dataset.manifest import MANIFEST, VERSION

__all__ = ["DEFAULT_DATA_DIR", "DEFAULT_NAME", "MANIFEST", "VERSION", "default_data_dir",
           "ensure_default_dataset", "is_built", "maybe_build_default"]

DEFAULT_NAME = "omni_default"
DEFAULT_DATA_DIR = "./data/omni_default"


def default_data_dir(job_config) -> str:
    """Where the bundled dataset lives for this job."""
    return job_config.training.dataset_path or DEFAULT_DATA_DIR


def is_built(data_dir: str | os.PathLike) -> bool:
    """Whether ``data_dir`` holds a complete build of the current version."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("version") == VERSION
    except (OSError, ValueError):
        return False


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install_tokenizer(data_dir: Path, tokenizer_dir: Path) -> None:
    if (tokenizer_dir / "tokenizer.json").is_file():
        return
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    # tokenizer.json last: processes that find it (without taking the lock) find the rest too
    names = sorted(os.listdir(data_dir / "tokenizer"), key=lambda n: (n == "tokenizer.json", n))
    for name in names:
        tmp = tokenizer_dir / f".{name}.tmp{os.getpid()}"
        shutil.copyfile(data_dir / "tokenizer" / name, tmp)
        os.replace(tmp, tokenizer_dir / name)
    logger.info(f"installed the bundled tokenizer in {tokenizer_dir}")


def ensure_default_dataset(data_dir: str | os.PathLike = DEFAULT_DATA_DIR,
                           tokenizer_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Build the default dataset into ``data_dir`` unless present; copy its tokenizer into
    ``tokenizer_dir`` unless that has a ``tokenizer.json``. Idempotent and multi-process safe."""
    data_dir = Path(data_dir)
    with _file_lock(data_dir.parent / f".{data_dir.name}.lock"):
        if not is_built(data_dir):
            # here, not at the top: the builder loads scikit-learn, scikit-image and espeak-ng
            # (seconds), which a run on a built dataset never needs
            from torchtitan_omni.data.default_dataset.build import (  # noqa: PLC0415
                build_default_dataset,
            )

            tmp = data_dir.parent / f".{data_dir.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            logger.info(f"building the bundled dataset {DEFAULT_NAME} into {data_dir} (once)")
            build_default_dataset(tmp, seed=seed)
            if data_dir.exists():  # an incomplete or outdated build
                shutil.rmtree(data_dir)
            os.replace(tmp, data_dir)
        if tokenizer_dir is not None:
            _install_tokenizer(data_dir, Path(tokenizer_dir))
    return data_dir


def maybe_build_default(job_config) -> None:
    """Build the bundled dataset/tokenizer for a job on ``omni_default`` when they are missing."""
    if job_config.training.dataset != DEFAULT_NAME:
        return
    data_dir = default_data_dir(job_config)
    tok_dir = job_config.model.hf_assets_path
    need_data = not is_built(data_dir)
    need_tok = bool(tok_dir) and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))
    if not (need_data or need_tok):
        return
    if not job_config.data.build_if_missing:
        if need_data:
            raise FileNotFoundError(
                f"the bundled dataset is not built in {data_dir} and data.build_if_missing is "
                "off; run: python scripts/build_default_dataset.py"
            )
        return
    ensure_default_dataset(data_dir, tok_dir if need_tok else None)
