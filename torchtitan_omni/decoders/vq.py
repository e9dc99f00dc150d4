"""VQ image tokenizer: convolutional encoder, codebook quantizer, convolutional decoder.

The architecture is LlamaGen's VQ-16 (the tokenizer of Janus / Janus-Pro): ResNet blocks with
GroupNorm and SiLU, self-attention at the lowest resolution, a 1x1 projection into a
low-dimensional codebook whose codes and inputs are l2-normalized, and the mirrored decoder.
``VQArgs()`` is VQ-16 (16384 codes of dimension 8, 16x downsampling, 384 px images: 24 x 24 =
576 codes), ``VQArgs.debug()`` a tiny one (32 px, 4x: 8 x 8 = 64 codes). With the same shape,
Janus' pretrained VQ loads through ``torchtitan_omni.decoders.hf.JanusVQAdapter``.

``VQTokenizer(args)``: ``encode(pixels [n, 3, S, S] in [-1, 1]) -> codes [n, h * w]`` (raster
order), ``decode(codes) -> pixels [n, 3, S, S]``, and ``vq(pixels, op="train")`` for the
training recipe (``scripts/train_vq.py``): reconstruction plus the codebook and commitment
losses, gradients through the quantizer by the straight-through estimator. Every operation runs
inside ``forward``, so a module wrapped by FSDP gathers its parameters for ``encode`` and
``decode`` too.

Weights: ``save_vq`` / ``load_vq`` write and read a safetensors folder with names relative to
the tokenizer (``encoder.conv_in.weight``, ...) and the ``VQArgs`` in the file's metadata; the
trainer loads such a folder through ``hf_adapter()`` (``NativeVQAdapter``), or Janus' VQ from a
Janus checkpoint with ``VQArgs(hf_format="janus")``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchtitan_omni.decoders.hf import FORMAT, JanusVQAdapter, NativeVQAdapter
from torchtitan_omni.modules import init


@dataclass
class VQArgs:
    """VQ tokenizer hyper-parameters (defaults: LlamaGen / Janus VQ-16)."""

    image_size: int = 384
    in_channels: int = 3
    base_channels: int = 128
    #: channels of each resolution level, as multiples of ``base_channels``; one 2x
    #: downsampling between consecutive levels
    channel_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    z_channels: int = 256
    codebook_size: int = 16384
    codebook_dim: int = 8
    #: l2-normalize codes and encoder outputs (LlamaGen): nearest code = largest cosine
    l2_norm: bool = True
    norm_groups: int = 32
    #: commitment loss weight (beta)
    commitment: float = 0.25
    #: checkpoint naming of ``hf_adapter()``: "native" (``scripts/train_vq.py``'s folders) or
    #: "janus" (the VQ inside a Janus / Janus-Pro checkpoint)
    hf_format: str = "native"

    def __post_init__(self) -> None:
        self.channel_mult = tuple(self.channel_mult)
        if self.hf_format not in ("native", "janus"):
            raise ValueError(f"hf_format must be 'native' or 'janus', got {self.hf_format!r}")
        if self.image_size % self.downsample:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of the downsampling "
                f"{self.downsample}"
            )
        for c in [self.base_channels * m for m in self.channel_mult]:
            if c % self.norm_groups:
                raise ValueError(
                    f"{c} channels do not split into {self.norm_groups} GroupNorm groups"
                )

    @classmethod
    def debug(cls) -> "VQArgs":
        """A tiny tokenizer for CPU runs: 32 px images, 4x downsampling, 1024 codes of dim 8."""
        return cls(image_size=32, base_channels=32, channel_mult=(1, 2, 2), num_res_blocks=1,
                   z_channels=64, codebook_size=1024, codebook_dim=8, norm_groups=8)

    @property
    def downsample(self) -> int:
        """Pixels per code along each side."""
        return 2 ** (len(self.channel_mult) - 1)

    @property
    def grid(self) -> int:
        """Codes per image side."""
        return self.image_size // self.downsample

    def to_json(self) -> str:
        """The arguments as JSON (stored in the weights file's metadata)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "VQArgs":
        """Inverse of :meth:`to_json`; unknown fields are an error."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown VQArgs fields {sorted(unknown)}")
        return cls(**data)


# ----------------------------------------------------------------------------- building blocks
def _norm(args: VQArgs, channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(args.norm_groups, channels, eps=1e-6)


class ResBlock(nn.Module):
    """``x + conv(silu(norm(conv(silu(norm(x))))))``; a 1x1 shortcut when the width changes."""

    def __init__(self, args: VQArgs, c_in: int, c_out: int) -> None:
        super().__init__()
        self.norm1 = _norm(args, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = _norm(args, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.shortcut is None else self.shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions of a feature map (1x1 conv projections)."""

    def __init__(self, args: VQArgs, channels: int) -> None:
        super().__init__()
        self.norm = _norm(args, channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (
            conv(y).reshape(n, 1, c, h * w).transpose(2, 3) for conv in (self.q, self.k, self.v)
        )
        o = F.scaled_dot_product_attention(q, k, v)  # [n, 1, hw, c]
        return x + self.proj(o.transpose(2, 3).reshape(n, c, h, w))


class Downsample(nn.Module):
    """Stride-2 3x3 convolution, padded on the right and bottom only (LlamaGen/taming)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest 2x upsampling then a 3x3 convolution."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    """ResBlock, attention, ResBlock at the lowest resolution."""

    def __init__(self, args: VQArgs, channels: int) -> None:
        super().__init__()
        self.res1 = ResBlock(args, channels, channels)
        self.attn = AttnBlock(args, channels)
        self.res2 = ResBlock(args, channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res2(self.attn(self.res1(x)))


class Level(nn.Module):
    """One resolution: ResBlocks (each followed by attention at the lowest resolution) and an
    optional resampling at the end."""

    def __init__(self, args: VQArgs, c_in: int, c_out: int, n_blocks: int, attention: bool,
                 resample: nn.Module | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ResBlock(args, c_in if i == 0 else c_out, c_out) for i in range(n_blocks)
        )
        self.attns = (
            nn.ModuleList(AttnBlock(args, c_out) for _ in range(n_blocks)) if attention else None
        )
        self.resample = resample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.attns is not None:
                x = self.attns[i](x)
        return x if self.resample is None else self.resample(x)


class VQEncoder(nn.Module):
    """Pixels ``[n, 3, S, S]`` -> pre-quantization latents ``[n, codebook_dim, S/d, S/d]``."""

    def __init__(self, args: VQArgs) -> None:
        super().__init__()
        ch = [args.base_channels * m for m in args.channel_mult]
        last = len(ch) - 1
        self.conv_in = nn.Conv2d(args.in_channels, args.base_channels, 3, padding=1)
        c_in = args.base_channels
        levels = []
        for i, c in enumerate(ch):
            levels.append(Level(args, c_in, c, args.num_res_blocks, attention=i == last,
                                resample=Downsample(c) if i != last else None))
            c_in = c
        self.levels = nn.ModuleList(levels)
        self.mid = MidBlock(args, ch[-1])
        self.norm_out = _norm(args, ch[-1])
        self.conv_out = nn.Conv2d(ch[-1], args.z_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(args.z_channels, args.codebook_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.levels:
            x = level(x)
        x = self.conv_out(F.silu(self.norm_out(self.mid(x))))
        return self.quant_conv(x)


class VQDecoder(nn.Module):
    """Code vectors ``[n, codebook_dim, h, w]`` -> pixels ``[n, 3, h*d, w*d]``."""

    def __init__(self, args: VQArgs) -> None:
        super().__init__()
        ch = [
            args.base_channels * m for m in reversed(args.channel_mult)
        ]  # lowest resolution first
        last = len(ch) - 1
        self.post_quant_conv = nn.Conv2d(args.codebook_dim, args.z_channels, 1)
        self.conv_in = nn.Conv2d(args.z_channels, ch[0], 3, padding=1)
        self.mid = MidBlock(args, ch[0])
        levels = []
        c_in = ch[0]
        for i, c in enumerate(ch):
            levels.append(Level(args, c_in, c, args.num_res_blocks + 1, attention=i == 0,
                                resample=Upsample(c) if i != last else None))
            c_in = c
        self.levels = nn.ModuleList(levels)
        self.norm_out = _norm(args, ch[-1])
        self.conv_out = nn.Conv2d(ch[-1], args.in_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.conv_in(self.post_quant_conv(z)))
        for level in self.levels:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


# ----------------------------------------------------------------------------- quantizer
@dataclass
class Quantized:
    """What the quantizer returns for latents ``[n, D, h, w]``."""

    #: code vectors with straight-through gradients to the latents, ``[n, D, h, w]``
    z_q: torch.Tensor
    #: nearest codes ``[n, h, w]``
    codes: torch.Tensor
    #: ``||sg(z) - e||^2`` (moves the codes) and ``||z - sg(e)||^2`` (moves the encoder), means
    codebook_loss: torch.Tensor
    commitment_loss: torch.Tensor
    #: the (normalized) latents ``[n * h * w, D]``, e.g. to restart dead codes
    z_flat: torch.Tensor


class Quantizer(nn.Module):
    """Nearest-code vector quantizer over a learned codebook ``[codebook_size, codebook_dim]``."""

    #: rows per distance block: bounds memory at ``chunk x codebook_size`` scores
    chunk = 4096

    def __init__(self, args: VQArgs) -> None:
        super().__init__()
        self.l2_norm = args.l2_norm
        self.codebook = nn.Embedding(args.codebook_size, args.codebook_dim)

    def vectors(self) -> torch.Tensor:
        """The codebook as used (l2-normalized if configured)."""
        w = self.codebook.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def nearest(self, z_flat: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of ``z_flat`` ``[M, D]``."""
        e = self.vectors().detach().to(z_flat.dtype)
        e_sq = (e * e).sum(-1)
        out = []
        for block in z_flat.detach().split(self.chunk):
            # ||z - e||^2 = ||z||^2 - 2 z.e + ||e||^2; the ||z||^2 term does not change the argmin
            out.append((e_sq - 2 * block @ e.t()).argmin(dim=-1))
        return torch.cat(out)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Code vectors ``[..., D]`` for integer codes ``[...]``."""
        return F.embedding(codes, self.vectors())

    def forward(self, z: torch.Tensor) -> Quantized:
        n, d, h, w = z.shape
        z_flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        if self.l2_norm:
            z_flat = F.normalize(z_flat, dim=-1)
        codes = self.nearest(z_flat)
        e = self.lookup(codes)
        codebook_loss = F.mse_loss(e, z_flat.detach())
        commitment_loss = F.mse_loss(z_flat, e.detach())
        z_q = z_flat + (e - z_flat).detach()
        return Quantized(
            z_q=z_q.reshape(n, h, w, d).permute(0, 3, 1, 2), codes=codes.reshape(n, h, w),
            codebook_loss=codebook_loss, commitment_loss=commitment_loss, z_flat=z_flat,
        )


@torch.no_grad()
def restart_dead_codes(quantizer: Quantizer, usage: torch.Tensor, z_flat: torch.Tensor,
                       generator: torch.Generator | None = None) -> int:
    """Re-seed codes never used (``usage == 0``) with random latents of the current batch.

    A standard remedy for codebook collapse; returns how many codes were restarted.
    """
    dead = (usage == 0).nonzero().flatten()
    if dead.numel() == 0 or z_flat.shape[0] == 0:
        return 0
    pick = torch.randint(0, z_flat.shape[0], (dead.numel(),), generator=generator, device="cpu")
    quantizer.codebook.weight[dead] = z_flat[pick.to(z_flat.device)].to(
        quantizer.codebook.weight.dtype
    )
    return int(dead.numel())


# ----------------------------------------------------------------------------- tokenizer
@dataclass
class VQTrainOutput:
    """One training forward: reconstruction, codes and the loss terms (means)."""

    recon: torch.Tensor
    codes: torch.Tensor
    l1: torch.Tensor
    l2: torch.Tensor
    codebook_loss: torch.Tensor
    commitment_loss: torch.Tensor
    z_flat: torch.Tensor


class VQTokenizer(nn.Module):
    """Encoder + quantizer + decoder (see the module docstring)."""

    def __init__(self, args: VQArgs) -> None:
        super().__init__()
        self.args = args
        self.encoder = VQEncoder(args)
        self.quantizer = Quantizer(args)
        self.decoder = VQDecoder(args)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Codes ``[n, h * w]`` (raster order) of images ``[n, 3, S, S]`` in ``[-1, 1]``."""
        return self(pixels, op="encode")

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Images ``[n, 3, S, S]`` (unclamped, nominally in ``[-1, 1]``) of codes ``[n, h * w]``."""
        return self(codes, op="decode")

    def forward(self, x: torch.Tensor, op: str = "train"):
        if op == "encode":
            return self.quantizer(self.encoder(self._checked_pixels(x))).codes.flatten(1)
        if op == "decode":
            return self.decoder(self._code_vectors(x))
        if op == "train":
            pixels = self._checked_pixels(x)
            q = self.quantizer(self.encoder(pixels))
            recon = self.decoder(q.z_q)
            return VQTrainOutput(
                recon=recon, codes=q.codes, l1=F.l1_loss(recon, pixels),
                l2=F.mse_loss(recon, pixels), codebook_loss=q.codebook_loss,
                commitment_loss=q.commitment_loss, z_flat=q.z_flat,
            )
        raise ValueError(f"unknown VQ operation {op!r} (encode, decode or train)")

    def _checked_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        a = self.args
        if pixels.dim() != 4 or pixels.shape[1] != a.in_channels:
            raise ValueError(
                f"VQ pixels must be [n, {a.in_channels}, H, W], got {tuple(pixels.shape)}"
            )
        h, w = pixels.shape[2:]
        if h % a.downsample or w % a.downsample:
            raise ValueError(
                f"VQ image size {h}x{w} is not a multiple of the downsampling {a.downsample}"
            )
        return pixels.to(self.encoder.conv_in.weight.dtype)

    def _code_vectors(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"VQ codes must be integer [n, h * w], got {codes.dtype} {tuple(codes.shape)}"
            )
        side = math.isqrt(codes.shape[1])
        if side * side != codes.shape[1]:
            raise ValueError(
                f"VQ decode needs a square grid of codes, got {codes.shape[1]} per image"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.args.codebook_size):
            raise ValueError(
                f"VQ codes must lie in [0, {self.args.codebook_size}), got [{int(codes.min())}, "
                f"{int(codes.max())}]"
            )
        e = self.quantizer.lookup(codes.long()).to(self.decoder.conv_in.weight.dtype)
        return e.reshape(codes.shape[0], side, side, -1).permute(0, 3, 1, 2)

    def hf_adapter(self):
        """The tensor naming of the checkpoints this tokenizer loads (``VQArgs.hf_format``)."""
        names = vq_tensor_names(self.args)
        if self.args.hf_format == "janus":
            return JanusVQAdapter(self.args, names)
        return NativeVQAdapter(self.args, names)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """PyTorch's default conv init (layout-invariant), unit GroupNorms, unit-normal codes."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                init.kaiming_uniform_linear_(module.weight)
                init.zeros_(module.bias)
            elif isinstance(module, nn.GroupNorm):
                init.ones_(module.weight)
                init.zeros_(module.bias)
        init.normal_(self.quantizer.codebook.weight, std=1.0)


# ----------------------------------------------------------------------------- weights
WEIGHTS_FILE = "model.safetensors"


def _weights_file(path: str) -> str:
    return os.path.join(path, WEIGHTS_FILE) if os.path.isdir(path) else path


def vq_tensor_names(args: VQArgs) -> list[str]:
    """The tensor names of a ``VQTokenizer`` with ``args`` (from a meta-device instance)."""
    with torch.device("meta"):
        return list(VQTokenizer(args).state_dict())


def save_vq(vq: VQTokenizer, folder: str, extra: dict[str, str] | None = None) -> str:
    """Write the tokenizer as a safetensors folder: ``model.safetensors`` (names relative to the
    tokenizer, ``VQArgs`` in the metadata) and ``config.json``. Returns the weights file.

    ``weights.sources = ["decoders.gen_image.vq=<folder>"]`` loads it through
    ``NativeVQAdapter``; :func:`load_vq` loads it without the trainer.
    """
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in vq.state_dict().items()}
    meta = {"format": FORMAT, "vq_args": vq.args.to_json(), **(extra or {})}
    path = os.path.join(folder, WEIGHTS_FILE)
    save_file(tensors, path, metadata=meta)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"format": FORMAT, **asdict(vq.args), **(extra or {})}, f, indent=2)
    return path


def read_vq_args(path: str) -> VQArgs:
    """The ``VQArgs`` stored by :func:`save_vq` (``path``: the folder or its weights file)."""
    file = _weights_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no VQ weights at {file} (write them with scripts/train_vq.py)")
    with safe_open(file, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT or "vq_args" not in meta:
        raise ValueError(f"{file} is not a torchtitan_omni VQ file (no '{FORMAT}' metadata)")
    return VQArgs.from_json(meta["vq_args"])


def load_vq(vq: VQTokenizer, path: str) -> None:
    """Load weights written by :func:`save_vq`, checking the shape and every tensor name."""
    stored = read_vq_args(path)
    # Training and naming settings do not change the network.
    if replace(stored, commitment=vq.args.commitment, hf_format=vq.args.hf_format) != vq.args:
        raise ValueError(f"{path} holds a VQ of shape {stored}, the model's is {vq.args}")
    tensors = load_file(_weights_file(path))
    own = vq.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, value in own.items():
            value.copy_(tensors[name])
