"""Shared helpers of the data-pipeline tests: job configs, tiny tokenizers and processing
configs, and writing small datasets with real media files."""

from __future__ import annotations

import json
import os

import numpy as np

from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

SMALL_PROCESSING = {
    "image": ImageProcessing(patch_size=4, merge_size=2, temporal_patch_size=2,
                             min_pixels=8 * 8, max_pixels=16 * 16),
    "video": VideoProcessing(patch_size=4, merge_size=2, temporal_patch_size=2, fps=2.0,
                             max_frames=4, min_pixels=8 * 8, max_pixels=16 * 16),
    "audio": AudioProcessing(chunk_seconds=1.0),
    "gen_image": GenImageProcessing(image_size=16, downsample=8),
}


def job_config(*args: str):
    """A JobConfig with the omni sections, parsed from CLI-style overrides (no validation)."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(
        ["--job.custom_config_module", "torchtitan_omni.config.job_config", *args]
    )


def tokenizer_dir(tmp_path, texts=("hello world, a small corpus of words " * 5,)) -> str:
    """A tiny trained BPE tokenizer with the omni special tokens, saved under ``tmp_path``."""
    from torchtitan_omni.data.default_dataset.bpe import train_tokenizer

    out = os.path.join(str(tmp_path), "tok")
    train_tokenizer(list(texts), out, vocab_size=400)
    return out


def write_jsonl(path, rows) -> str:
    """Write rows as JSON lines; returns the path."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_png(path, h: int, w: int, seed: int = 0) -> str:
    """A random RGB PNG of ``h x w``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


def write_wav(path, seconds: float, rate: int = 22050, freq: float = 440.0) -> str:
    """A sine tone WAV."""
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    sf.write(str(path), 0.5 * np.sin(2 * np.pi * freq * t), rate, subtype="PCM_16")
    return str(path)


def write_mp4(path, frames: np.ndarray, fps: int) -> str:
    """An mp4 of uint8 RGB frames."""
    from torchtitan_omni.data.default_dataset.clips import write_mp4 as _write

    _write(str(path), frames, fps)
    return str(path)


def loader_batches(cfg, split: str, n: int, processing: dict) -> list:
    """Up to ``n`` ``(batch, labels)`` of one pass over ``split`` through the real loader (no
    workers), with the given processing configs."""
    from torchtitan_omni.data.loader import build_omni_dataloader

    loader = build_omni_dataloader(1, 0, None, cfg, split=split, infinite=False,
                                   processing=processing, num_workers=0)
    out = []
    for batch, labels in loader:
        out.append((batch, labels))
        if len(out) == n:
            break
    return out
