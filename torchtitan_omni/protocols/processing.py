"""How each modality's raw media is turned into model inputs, as declared by the encoders and
decoders; the data pipeline (``torchtitan_omni.data``) reads these to process samples and to
expand placeholders to the right number of tokens.

Media tensors each processor produces (keys without the ``<modality>_`` prefix):

- ``ImageProcessing(mode="patches")`` (images, Qwen2-VL style): ``patches`` float
  ``[N, 3 * temporal_patch * patch * patch]`` with every item's patches in merge-window order
  (each ``merge x merge`` window contiguous), and ``grid_thw`` int64 ``[n_items, 3]`` in
  patches. An image is repeated to ``temporal_patch`` frames.
- ``ImageProcessing(mode="fixed")`` (SigLIP style): ``pixels`` float ``[n_items, 3, H, W]``.
- ``VideoProcessing``: as ``patches`` mode, frames sampled at ``fps`` and grouped by
  ``temporal_patch``.
- ``AudioProcessing``: ``features`` float ``[n_items, n_mels, T]`` log-mel (zero padded to the
  longest item), ``lengths`` int64 ``[n_items]`` valid frames.
- ``GenImageProcessing``: ``pixels`` float ``[n_items, 3, size, size]`` in ``[-1, 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

IMAGENET_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP/Qwen2-VL normalization
IMAGENET_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessing:
    """Images for an understanding encoder."""

    mode: Literal["patches", "fixed"] = "patches"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    image_size: int = 384  # "fixed" mode only
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    @property
    def factor(self) -> int:
        """Side lengths are resized to multiples of this (one merge window)."""
        return self.patch_size * self.merge_size

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """Target size: aspect kept, sides multiples of ``factor``, area within bounds."""
        if self.mode == "fixed":
            return self.image_size, self.image_size
        f = self.factor
        h = max(f, round(height / f) * f)
        w = max(f, round(width / f) * f)
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / scale / f) * f)
            w = max(f, math.floor(width / scale / f) * f)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * scale / f) * f
            w = math.ceil(width * scale / f) * f
        return h, w

    def num_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """LLM placeholder tokens for one item of this (already resized) size."""
        if self.mode == "fixed":
            return (self.image_size // self.patch_size) ** 2
        t = max(1, math.ceil(frames / self.temporal_patch_size))
        return t * (height // self.patch_size) * (width // self.patch_size) // self.merge_size**2


@dataclass(frozen=True)
class VideoProcessing(ImageProcessing):
    """Videos for a vision encoder with temporal patches."""

    fps: float = 2.0
    max_frames: int = 16
    max_pixels: int = 224 * 224


@dataclass(frozen=True)
class AudioProcessing:
    """Audio for a Whisper-style encoder: 16 kHz log-mel, chunked."""

    sample_rate: int = 16000
    n_mels: int = 80
    n_fft: int = 400
    hop_length: int = 160
    chunk_seconds: float = 30.0
    # frames -> tokens: conv front-end stride times pooling
    downsample: int = 4

    def num_frames(self, num_samples: int) -> int:
        """Mel frames for a clip of ``num_samples`` (after chunk truncation)."""
        limit = int(self.chunk_seconds * self.sample_rate)
        return min(num_samples, limit) // self.hop_length + 1

    def num_tokens(self, num_frames: int) -> int:
        """LLM placeholder tokens for ``num_frames`` mel frames."""
        return max(1, math.ceil(num_frames / self.downsample))


@dataclass(frozen=True)
class GenImageProcessing:
    """Target images for an image-generation decoder (VQ tokenized)."""

    image_size: int = 384
    downsample: int = 16

    def num_tokens(self) -> int:
        """Image tokens the decoder generates per image."""
        return (self.image_size // self.downsample) ** 2
