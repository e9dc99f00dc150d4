"""Videos: frames sampled at the configured fps, resized, grouped into temporal patches."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.media import load_video
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.data.processors.image import normalized_patches, resize
from torchtitan_omni.protocols.processing import VideoProcessing


class VideoProcessor(Processor):
    """``VideoProcessing``: Qwen2-VL style patches over ``temporal_patch_size`` frames."""

    config: VideoProcessing

    def process_frames(self, frames: np.ndarray) -> Item:
        """Sampled frames ``[T, H, W, 3]`` uint8 (T a multiple of the temporal patch) -> item."""
        cfg = self.config
        t = frames.shape[0]
        if t % cfg.temporal_patch_size:  # repeat the last frame to fill the last group
            pad = cfg.temporal_patch_size - t % cfg.temporal_patch_size
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        h, w = cfg.resized_hw(frames.shape[1], frames.shape[2])
        resized = np.stack([np.array(resize(Image.fromarray(f), h, w)) for f in frames])
        patches, grid = normalized_patches(resized, cfg)
        return Item({"patches": patches, "grid_thw": grid}, cfg.num_tokens(h, w, frames.shape[0]))

    def __call__(self, ref: Any, root: str, source: Source | None = None) -> list[Item]:
        cfg = self.config
        video = load_video(ref, root, cfg.fps, cfg.max_frames, cfg.temporal_patch_size, source)
        return [self.process_frames(video.frames)]

    def collate(self, items: list[Item]) -> dict[str, torch.Tensor]:
        return {
            "patches": torch.cat([it.tensors["patches"] for it in items]),
            "grid_thw": torch.stack([it.tensors["grid_thw"] for it in items]),
        }
