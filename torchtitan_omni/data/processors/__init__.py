"""Per-modality processors: media reference -> model tensors and placeholder token counts.

A processor turns one placeholder's media reference into one or more :class:`Item` (audio
longer than a chunk becomes several); the placeholder then expands to the modality's begin
token, the items' ``num_tokens`` pads, and the end token. ``collate`` joins the items of a
batch, in placeholder order, into the media tensors of ``torchtitan_omni.protocols.processing``.

The built-in modalities are registered here (``torchtitan_omni.protocols.modality``), in the
order that fixes their special-token ids; a new modality registers itself the same way from
its own module.
"""

from __future__ import annotations

from typing import Any

from torchtitan_omni.data.processors.audio import AudioProcessor
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.data.processors.gen_image import GenImageProcessor
from torchtitan_omni.data.processors.image import ImageProcessor
from torchtitan_omni.data.processors.video import VideoProcessor
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modality import Modality, modalities, register_modality
from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

__all__ = ["Item", "Processor", "ImageProcessor", "VideoProcessor", "AudioProcessor",
           "GenImageProcessor", "build_processors"]

# Do not reorder: the order fixes the special-token ids of every existing tokenizer.
register_modality(Modality(B.IMAGE, "input", ImageProcessing, ImageProcessor))
register_modality(Modality(B.VIDEO, "input", VideoProcessing, VideoProcessor))
register_modality(Modality(B.AUDIO, "input", AudioProcessing, AudioProcessor))
register_modality(Modality(B.GEN_IMAGE, "target", GenImageProcessing, GenImageProcessor))


def _factory(cfg: Any):
    """The processor factory of the registered config class nearest ``type(cfg)`` (a subclass
    config, e.g. VideoProcessing of ImageProcessing, picks its own processor)."""
    by_config = {m.processing: m.processor for m in modalities() if m.processing is not None}
    for cls in type(cfg).__mro__:
        if by_config.get(cls) is not None:
            return by_config[cls]
    return None


def build_processors(configs: dict[str, Any]) -> dict[str, Processor]:
    """A processor per modality from the model's processing configs ({modality: config})."""
    out: dict[str, Processor] = {}
    for modality, cfg in configs.items():
        factory = _factory(cfg)
        if factory is None:
            raise TypeError(
                f"no processor for modality {modality!r} with config {type(cfg).__name__}; "
                "expected a processing config registered with register_modality "
                "(torchtitan_omni.protocols.modality)"
            )
        out[modality] = factory(cfg)
    return out
