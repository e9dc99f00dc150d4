"""Encoders: media -> LLM-width embeddings (one row per placeholder token).

- ``vision.VisionEncoder``: Qwen2-VL style, images and videos (``VisionArgs``)
- ``siglip.SiglipEncoder``: SigLIP tower + Janus aligner, fixed 384 px images (``SiglipArgs``)
- ``audio.AudioEncoder``: Whisper encoder + Qwen2-Audio pooling/projector (``AudioArgs``)
- ``projector``: the MLP projectors and Qwen2-VL's patch merger; ``hf``: HF checkpoint naming

Every constructor is ``Encoder(args, llm_dim)``; see docs/encoders_decoders.md.
"""

from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder
from torchtitan_omni.encoders.siglip import SiglipArgs, SiglipEncoder
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder

__all__ = [
    "AudioArgs",
    "AudioEncoder",
    "SiglipArgs",
    "SiglipEncoder",
    "VisionArgs",
    "VisionEncoder",
]
