"""SigLIP-style vision encoder with Janus' understanding aligner.

Construct with ``SiglipEncoder(args: SiglipArgs, llm_dim: int)``. ``SiglipArgs()`` is
SigLIP-L/16 at 384 px (width 1024, 24 layers, 16 heads, MLP 4096, tanh GELU as Hugging Face's
``SiglipVisionModel``); ``SiglipArgs.janus()`` the same tower as Janus / Janus-Pro load it
(exact GELU, Janus checkpoint naming); ``SiglipArgs.debug()`` a tiny one.

Input (``ImageProcessing(mode="fixed")``): ``pixels`` float ``[n, 3, S, S]``, ``S =
image_size``, normalized with mean = std = 0.5. Output: ``[n * (S / patch)**2, llm_dim]``, the
576 patch embeddings of each image (SigLIP-L/16 @ 384) in raster order, images in input order.

Tower: 16x16 patch convolution + learned position embeddings, pre-LN blocks (LayerNorm,
attention with biases, GELU MLP), post-LayerNorm (no pooling head: Janus reads the patches);
then the aligner, an MLP of ``aligner_depth`` linears to the LLM width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan_omni.encoders.blocks import EncoderBlock, EncoderStack, init_layer_norm, packed_meta
from torchtitan_omni.encoders.hf import JanusVisionAdapter, SiglipVisionAdapter
from torchtitan_omni.encoders.projector import MLPProjector
from torchtitan_omni.modules import init
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.mlp import GeluMLP
from torchtitan_omni.protocols.batch import IMAGE
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.protocols.processing import ImageProcessing


@dataclass
class SiglipArgs:
    """SigLIP vision tower + aligner hyper-parameters (defaults: SigLIP-L/16 @ 384)."""

    image_size: int = 384
    patch_size: int = 16
    in_channels: int = 3
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    mlp_dim: int = 4096
    norm_eps: float = 1e-6
    #: GELU of the tower's MLP: "tanh" (SigLIP) or "none" (Janus' timm tower)
    gelu_approximate: str = "tanh"
    #: aligner: ``aligner_depth`` linears, hidden width ``aligner_hidden`` (None: the LLM width)
    aligner_depth: int = 2
    aligner_hidden: int | None = None
    #: Hugging Face checkpoint naming of ``hf_adapter()``: "siglip" or "janus"
    hf_format: str = "siglip"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.hf_format not in ("siglip", "janus"):
            raise ValueError(f"hf_format must be 'siglip' or 'janus', got {self.hf_format!r}")

    @classmethod
    def janus(cls) -> "SiglipArgs":
        """The SigLIP-L/16 @ 384 tower of Janus / Janus-Pro (exact GELU, Janus naming)."""
        return cls(gelu_approximate="none", hf_format="janus")

    @classmethod
    def debug(cls) -> "SiglipArgs":
        """A tiny tower for CPU runs: 32 px images, 8 px patches (16 tokens per image)."""
        return cls(image_size=32, patch_size=8, dim=64, n_layers=2, n_heads=4, mlp_dim=128,
                   hf_format="janus", gelu_approximate="none")

    @property
    def num_patches(self) -> int:
        """Patches (= LLM tokens) per image."""
        return (self.image_size // self.patch_size) ** 2


class SiglipEncoder(OmniEncoder):
    """SigLIP tower + Janus aligner (see the module docstring)."""

    modalities = (IMAGE,)
    fsdp_units = ("blocks.*", "aligner")
    ac_units = ("blocks.*",)

    def __init__(self, args: SiglipArgs, llm_dim: int) -> None:
        super().__init__()
        self.args = args
        self.llm_dim = llm_dim
        self.patch_embed = nn.Conv2d(args.in_channels, args.dim, args.patch_size, args.patch_size)
        self.pos_embed = nn.Parameter(torch.empty(args.num_patches, args.dim))
        self.blocks = EncoderStack(
            EncoderBlock(
                args.dim,
                SelfAttention(args.dim, args.n_heads, qkv_bias=True, out_bias=True, causal=False),
                GeluMLP(args.dim, args.mlp_dim, approximate=args.gelu_approximate),
                args.norm_eps,
            )
            for _ in range(args.n_layers)
        )
        self.post_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.aligner = MLPProjector(
            args.dim, llm_dim, args.aligner_hidden or llm_dim, args.aligner_depth
        )

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Post-LayerNorm patch features ``[n, num_patches, dim]`` (before the aligner)."""
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.pos_embed.to(x.dtype)
        n, s, _ = x.shape
        # Each image is one document of the packed sequence (varlen attention, no mask).
        meta = packed_meta([s] * n, x.device)
        x = self.blocks(x.reshape(n * s, -1), meta)
        return self.post_norm(x).reshape(n, s, -1)

    # ----------------------------------------------------------------- contract
    def lm_encode(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        if "pixels" not in media:
            raise KeyError(f"{modality}_pixels is missing from the batch (have: "
                           f"{', '.join(modality + '_' + k for k in media)})")
        pixels = media["pixels"]
        size = self.args.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.args.in_channels, size, size):
            raise ValueError(
                f"{modality}_pixels must be [n, {self.args.in_channels}, {size}, {size}], got "
                f"{tuple(pixels.shape)}"
            )
        return self.aligner(self.features(pixels)).flatten(0, 1)

    def processing(self, modality: str):
        if modality != IMAGE:
            raise ValueError(f"SiglipEncoder serves {self.modalities}, not {modality!r}")
        a = self.args
        return ImageProcessing(mode="fixed", patch_size=a.patch_size, image_size=a.image_size,
                               merge_size=1, mean=a.mean, std=a.std)

    def output_rows(self, media: dict[str, torch.Tensor], modality: str) -> int:
        return media["pixels"].shape[0] * self.args.num_patches

    def dummy_media(self, modality: str, device: torch.device) -> dict[str, torch.Tensor]:
        s = self.args.image_size
        return {"pixels": torch.zeros(1, self.args.in_channels, s, s, device=device)}

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        init.trunc_normal_(self.patch_embed.weight, std=0.02)
        init.zeros_(self.patch_embed.bias)
        init.normal_(self.pos_embed, std=0.02)
        for block in self.blocks:
            block.init_weights(0.02)
        init_layer_norm(self.post_norm)
        self.aligner.init_weights(0.02)

    def hf_adapter(self):
        if self.args.hf_format == "janus":
            return JanusVisionAdapter(self.args, self.llm_dim)
        return SiglipVisionAdapter(self.args, self.llm_dim)
