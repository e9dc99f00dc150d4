"""Target images for image generation: square, ``image_size`` pixels, values in [-1, 1]."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.media import load_image
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.data.processors.image import resize
from torchtitan_omni.protocols.processing import GenImageProcessing


def center_square(image):
    """The largest centered square crop of a PIL image."""
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return image.crop((left, top, left + side, top + side))


class GenImageProcessor(Processor):
    """``GenImageProcessing``: pixels ``[3, size, size]`` in [-1, 1] per item."""

    config: GenImageProcessing

    def process_image(self, image) -> Item:
        """One decoded PIL image -> its item."""
        size = self.config.image_size
        arr = np.array(resize(center_square(image), size, size))
        pixels = torch.from_numpy(np.ascontiguousarray(arr)).float().div_(127.5).sub_(1.0)
        return Item({"pixels": pixels.permute(2, 0, 1).contiguous()}, self.config.num_tokens())

    def __call__(self, ref: Any, root: str, source: Source | None = None) -> list[Item]:
        return [self.process_image(load_image(ref, root, source, kind="gen_image"))]

    def collate(self, items: list[Item]) -> dict[str, torch.Tensor]:
        return {"pixels": torch.stack([it.tensors["pixels"] for it in items])}
