"""Decoders: LLM hidden states -> a modality.

- ``gen_image.GenImageDecoder``: Janus-style image generation over a frozen VQ tokenizer
  (``GenImageArgs``)
- ``vq.VQTokenizer``: the VQ image tokenizer (``VQArgs``), trained by ``scripts/train_vq.py``
- ``hf``: Janus checkpoint naming of the VQ, generation aligner and head
"""

from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.decoders.vq import VQArgs, VQTokenizer, load_vq, read_vq_args, save_vq

__all__ = [
    "GenImageArgs",
    "GenImageDecoder",
    "VQArgs",
    "VQTokenizer",
    "load_vq",
    "read_vq_args",
    "save_vq",
]
