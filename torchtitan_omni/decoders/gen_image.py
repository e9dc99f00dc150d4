"""Image-generation decoder (Janus style): a frozen VQ tokenizer, a generation aligner into the
LLM and a generation head over the codebook.

Construct with ``GenImageDecoder(args: GenImageArgs, llm_dim: int)``. ``GenImageArgs()`` is
Janus-Pro's (VQ-16, code embedding of dimension 8, aligner and head of the LLM width),
``GenImageArgs.debug()`` a tiny one.

- ``encode_targets({"pixels": [n, 3, S, S]})``: VQ codes of the target images, flattened
  ``[n * h * w]`` (image by image, raster order), without gradients.
- ``lm_embed(ids)``: ``aligner`` = code embedding (Janus' ``gen_embed``) + MLP (``gen_aligner``).
- ``logits(hidden)``: ``head`` = MLP to codebook scores (``gen_head``); ``lm_head`` the summed
  cross-entropy, computed by the head chunk by chunk.
- ``lm_generate(ids [n, h * w])``: VQ decode to images in ``[-1, 1]``.

Parallel plan: ``aligner`` and ``head`` are FSDP units. ``vq`` is frozen (``requires_grad``
False, always) and kept replicated in float32 (a part of its own with mesh "none"): it is
small, frozen, and takes float32 pixels. The omni model runs it on every rank, on
:meth:`dummy_media` when a batch has no targets, so ranks stay in step. The decoder holds no
parameters of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from torchtitan_omni.decoders.hf import JanusGenAdapter
from torchtitan_omni.decoders.vq import VQArgs, VQTokenizer, vq_tensor_names
from torchtitan_omni.encoders.projector import MLPProjector
from torchtitan_omni.modules import init
from torchtitan_omni.protocols.batch import GEN_IMAGE
from torchtitan_omni.protocols.modules import OmniDecoder
from torchtitan_omni.protocols.processing import GenImageProcessing


@dataclass
class GenImageArgs:
    """Generation decoder hyper-parameters (defaults: Janus-Pro with VQ-16)."""

    vq: VQArgs = field(default_factory=VQArgs)
    #: aligner: code embedding then ``aligner_depth`` linears to the LLM width
    aligner_depth: int = 2
    #: head: ``head_depth`` linears, hidden width ``head_hidden`` (None: the LLM width)
    head_depth: int = 2
    head_hidden: int | None = None

    @classmethod
    def debug(cls) -> "GenImageArgs":
        """The debug VQ (32 px, 64 codes per image, 1024-code book)."""
        return cls(vq=VQArgs.debug())


class GenAligner(nn.Module):
    """Code ids ``[N]`` -> LLM inputs ``[N, llm_dim]``: an embedding then an MLP."""

    def __init__(self, num_codes: int, code_dim: int, llm_dim: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_codes, code_dim)
        self.mlp = MLPProjector(code_dim, llm_dim, llm_dim, depth)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))

    def init_weights(self) -> None:
        init.normal_(self.embed.weight, std=1.0)
        self.mlp.init_weights(0.02)


class GenImageDecoder(OmniDecoder):
    """Frozen VQ + generation aligner + generation head (see the module docstring)."""

    modality = GEN_IMAGE
    #: sub-modules a parallel plan should wrap with FSDP
    fsdp_units = ("aligner", "head")
    #: frozen sub-modules to keep replicated (outside FSDP)
    frozen_units = ("vq",)

    def __init__(self, args: GenImageArgs, llm_dim: int) -> None:
        super().__init__()
        self.args = args
        self.llm_dim = llm_dim
        self.vq = VQTokenizer(args.vq)
        self.aligner = GenAligner(
            args.vq.codebook_size, args.vq.codebook_dim, llm_dim, args.aligner_depth
        )
        self.head = MLPProjector(
            llm_dim, args.vq.codebook_size, args.head_hidden or llm_dim, args.head_depth
        )
        self.vq.requires_grad_(False)
        self.vq.eval()

    def train(self, mode: bool = True) -> "GenImageDecoder":
        super().train(mode)
        self.vq.eval()  # frozen: never in training mode
        return self

    # ----------------------------------------------------------------- contract
    def encode_targets(self, media: dict[str, torch.Tensor]) -> torch.Tensor:
        if "pixels" not in media:
            raise KeyError(f"{GEN_IMAGE}_pixels is missing from the batch (have: "
                           f"{', '.join(GEN_IMAGE + '_' + k for k in media)})")
        pixels = media["pixels"]
        size = self.args.vq.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.args.vq.in_channels, size, size):
            raise ValueError(
                f"{GEN_IMAGE}_pixels must be [n, {self.args.vq.in_channels}, {size}, {size}], got "
                f"{tuple(pixels.shape)}"
            )
        with torch.no_grad():
            return self.vq(pixels, op="encode").flatten()

    def lm_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.aligner(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def lm_head(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the head's last linear and the loss in chunks: no [N, codebook] logits kept
        return self.head(hidden, targets)

    def lm_generate(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.vq(ids, op="decode").clamp(-1.0, 1.0)

    def processing(self):
        return GenImageProcessing(
            image_size=self.args.vq.image_size, downsample=self.args.vq.downsample
        )

    def dummy_media(self, device: torch.device) -> dict[str, torch.Tensor]:
        """One blank target image (for plans that need every rank to run the VQ)."""
        s = self.args.vq.image_size
        return {"pixels": torch.zeros(1, self.args.vq.in_channels, s, s, device=device)}

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # The VQ gets a random init here; its trained weights are loaded afterwards
        # (``weights.sources``: decoders.gen_image.vq=<file written by scripts/train_vq.py>).
        self.vq.init_weights(buffer_device)
        self.vq.requires_grad_(False)
        self.aligner.init_weights()
        self.head.init_weights(0.02)

    def hf_adapter(self):
        return JanusGenAdapter(self.args, self.llm_dim, vq_tensor_names(self.args.vq))
