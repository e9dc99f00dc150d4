"""Images for understanding encoders: Qwen2-VL patches (merge-window order) or fixed size."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.media import load_image
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.protocols.processing import ImageProcessing


def normalize(frames: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 ``[..., H, W, 3]`` -> float ``[..., 3, H, W]`` scaled to [0, 1] and standardized."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).float().div_(255.0)
    x = x.movedim(-1, -3)
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return (x - m) / s


def normalized_patches(
    frames: np.ndarray, cfg: ImageProcessing
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 frames ``[T, H, W, 3]`` (T a multiple of the temporal patch) -> standardized
    patches and grid, as ``patchify(normalize(frames))`` gives them.

    The patch layout is made on the uint8 pixels (a quarter of the bytes to move) and the
    standardization runs once, in place, on the float patches: the loader's largest cost on
    realistic media (32 frames of 448 px are 19 M values per clip).
    """
    x = torch.from_numpy(np.ascontiguousarray(frames)).movedim(-1, -3)
    patches, grid = patchify(x, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    # each patch's features are (channel, time, y, x): standardize per channel block
    view = patches.view(patches.shape[0], 3, -1)
    m = torch.tensor(cfg.mean, dtype=torch.float32).view(1, 3, 1)
    s = torch.tensor(cfg.std, dtype=torch.float32).view(1, 3, 1)
    out = view.float().div_(255.0).sub_(m).div_(s)
    return out.view(patches.shape), grid


def patchify(
    pixels: torch.Tensor, patch: int, merge: int, temporal: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, C, H, W]`` -> patches ``[t*h*w, C*temporal*patch*patch]`` and grid ``[3]``.

    Patches are ordered frame group by frame group, then merge window by merge window (row
    major), then row major inside the window, so each ``merge x merge`` window is contiguous
    (the encoder's patch merger pools consecutive rows). Each patch's features are laid out
    (channel, time, y, x), as a Conv3d patch embedding with kernel (temporal, patch, patch)
    flattens its weight.
    """
    frames, channels, height, width = pixels.shape
    if frames % temporal or height % (patch * merge) or width % (patch * merge):
        raise ValueError(
            f"cannot patchify {tuple(pixels.shape)}: frames must be a multiple of {temporal} "
            f"and sides of {patch * merge}"
        )
    gt, gh, gw = frames // temporal, height // patch, width // patch
    x = pixels.reshape(gt, temporal, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = x.reshape(gt * gh * gw, channels * temporal * patch * patch)
    return patches.contiguous(), torch.tensor([gt, gh, gw], dtype=torch.int64)


def resize(image, height: int, width: int):
    """Bicubic resize of a PIL image (what Hugging Face's image processors do)."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.BICUBIC)


class ImageProcessor(Processor):
    """``ImageProcessing`` configs: "patches" (Qwen2-VL) or "fixed" (SigLIP) mode."""

    config: ImageProcessing

    def process_image(self, image) -> Item:
        """One decoded PIL image -> its item."""
        cfg = self.config
        h, w = cfg.resized_hw(image.height, image.width)
        arr = np.array(resize(image, h, w))
        if cfg.mode == "fixed":
            return Item({"pixels": normalize(arr, cfg.mean, cfg.std)}, cfg.num_tokens(h, w))
        frames = np.broadcast_to(arr, (cfg.temporal_patch_size, *arr.shape))
        patches, grid = normalized_patches(frames, cfg)
        return Item({"patches": patches, "grid_thw": grid}, cfg.num_tokens(h, w))

    def __call__(self, ref: Any, root: str, source: Source | None = None) -> list[Item]:
        return [self.process_image(load_image(ref, root, source))]

    def collate(self, items: list[Item]) -> dict[str, torch.Tensor]:
        if self.config.mode == "fixed":
            return {"pixels": torch.stack([it.tensors["pixels"] for it in items])}
        return {
            "patches": torch.cat([it.tensors["patches"] for it in items]),
            "grid_thw": torch.stack([it.tensors["grid_thw"] for it in items]),
        }
