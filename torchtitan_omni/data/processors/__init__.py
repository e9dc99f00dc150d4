"""Per-modality processors: media reference -> model tensors and placeholder token counts.

A processor turns one placeholder's media reference into one or more :class:`Item` (audio
longer than a chunk becomes several); the placeholder then expands to the modality's begin
token, the items' ``num_tokens`` pads, and the end token. ``collate`` joins the items of a
batch, in placeholder order, into the media tensors of ``torchtitan_omni.protocols.processing``.
"""

from __future__ import annotations

from typing import Any

from torchtitan_omni.data.processors.audio import AudioProcessor
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.data.processors.gen_image import GenImageProcessor
from torchtitan_omni.data.processors.image import ImageProcessor
from torchtitan_omni.data.processors.video import VideoProcessor
from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

__all__ = ["Item", "Processor", "ImageProcessor", "VideoProcessor", "AudioProcessor",
           "GenImageProcessor", "build_processors"]


def build_processors(configs: dict[str, Any]) -> dict[str, Processor]:
    """A processor per modality from the model's processing configs ({modality: config})."""
    out: dict[str, Processor] = {}
    for modality, cfg in configs.items():
        # VideoProcessing subclasses ImageProcessing: test it first.
        if isinstance(cfg, VideoProcessing):
            out[modality] = VideoProcessor(cfg)
        elif isinstance(cfg, ImageProcessing):
            out[modality] = ImageProcessor(cfg)
        elif isinstance(cfg, AudioProcessing):
            out[modality] = AudioProcessor(cfg)
        elif isinstance(cfg, GenImageProcessing):
            out[modality] = GenImageProcessor(cfg)
        else:
            raise TypeError(
                f"no processor for modality {modality!r} with config {type(cfg).__name__}; "
                "expected a dataclass of torchtitan_omni.protocols.processing"
            )
    return out
