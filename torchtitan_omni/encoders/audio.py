"""Whisper-style audio encoder with Qwen2-Audio's pooling and projector.

Construct with ``AudioEncoder(args: AudioArgs, llm_dim: int)``. ``AudioArgs()`` is
Whisper-large-v3's encoder (width 1280, 32 layers, 20 heads, 128 mel bins), ``AudioArgs.debug()``
a tiny one.

Input (``AudioProcessing``): ``features`` float ``[n, n_mels, T]`` log-mel, zero padded to the
longest item, and ``lengths`` int64 ``[n]`` valid frames. Output: ``[sum_i ceil(L_i / 4),
llm_dim]``, one row per placeholder token, items in input order.

Pipeline: conv (k3, s1) + GELU, conv (k3, s2) + GELU, sinusoidal positions, pre-LN blocks
(Whisper: ``k`` projection without bias), average pooling of frame pairs, final LayerNorm
(Qwen2-Audio's order: pool, then norm) and the projector. Unlike Whisper, which always attends
over a full 30 s window, each clip is encoded alone: frames past its length are zeroed before
each convolution and attention runs within each clip's valid frames (varlen), so padding never
leaks into the output. On a full-length clip both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.encoders.blocks import EncoderBlock, EncoderStack, init_layer_norm, packed_meta
from torchtitan_omni.encoders.hf import Qwen2AudioAdapter, WhisperEncoderAdapter
from torchtitan_omni.encoders.projector import MLPProjector
from torchtitan_omni.modules import init
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.host import to_device
from torchtitan_omni.modules.mlp import GeluMLP
from torchtitan_omni.protocols.batch import AUDIO
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.protocols.processing import AudioProcessing

#: conv stride x pooling: mel frames per LLM token
DOWNSAMPLE = 4
#: the stem's input length is rounded up to a multiple of this many mel frames (1.28 s): cuDNN
#: plans each new convolution shape (milliseconds per step when every batch brings new clip
#: lengths), and rounded lengths repeat from batch to batch; the extra frames are masked
FRAME_BUCKET = 128


@dataclass
class AudioArgs:
    """Audio encoder hyper-parameters (defaults: Whisper-large-v3's encoder)."""

    n_mels: int = 128
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 20
    mlp_dim: int = 5120
    norm_eps: float = 1e-5
    #: projector: ``projector_depth`` linears (1: Qwen2-Audio), hidden width (None: LLM width)
    projector_depth: int = 1
    projector_hidden: int | None = None
    # processing
    sample_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_seconds: float = 30.0
    #: checkpoint naming of ``hf_adapter()``: "whisper" (``model.encoder.*``) or "qwen2_audio"
    hf_format: str = "whisper"

    def __post_init__(self) -> None:
        if self.hf_format not in ("whisper", "qwen2_audio"):
            raise ValueError(
                f"hf_format must be 'whisper' or 'qwen2_audio', got {self.hf_format!r}"
            )

    @classmethod
    def debug(cls) -> "AudioArgs":
        """A tiny encoder for CPU runs (80 mel bins, 10 s chunks)."""
        return cls(n_mels=80, dim=64, n_layers=2, n_heads=4, mlp_dim=128, chunk_seconds=10.0)

    def processing(self) -> AudioProcessing:
        return AudioProcessing(
            sample_rate=self.sample_rate, n_mels=self.n_mels, n_fft=self.n_fft,
            hop_length=self.hop_length, chunk_seconds=self.chunk_seconds, downsample=DOWNSAMPLE,
        )

    @property
    def max_positions(self) -> int:
        """Positions after the strided conv for the longest clip the processor emits."""
        frames = self.processing().num_frames(int(self.chunk_seconds * self.sample_rate))
        return math.ceil(frames / 2)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table ``[length, channels]``: sines, then cosines."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    # float32 on purpose: Whisper's checkpoints were trained with the float32 table
    inv = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32).unsqueeze(1) * inv.unsqueeze(0)
    return torch.cat([t.sin(), t.cos()], dim=1)


def pair_pool_index(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (a, b) averaged into each pooled row of a packed sequence of items of ``lengths``.

    Pairs never cross items; an odd item's last frame is pooled with itself (so an item of
    ``L`` frames gives ``ceil(L / 2)`` rows).
    """
    first, second = [], []
    start = 0
    for n in lengths:
        a = list(range(start, start + n, 2))
        first += a
        second += [min(i + 1, start + n - 1) for i in a]
        start += n
    return to_device(first, device, torch.long), to_device(second, device, torch.long)


def valid_rows(lengths: list[int], padded: int, device: torch.device) -> torch.Tensor:
    """Rows of a flattened ``[n, padded, ...]`` batch of items holding the first
    ``lengths[i]`` rows of item ``i``, items back to back (a boolean mask's rows, without the
    host wait of a boolean-mask index)."""
    rows = [i * padded + j for i, n in enumerate(lengths) for j in range(n)]
    return to_device(rows, device, torch.long)


class AudioEncoder(OmniEncoder):
    """Whisper encoder + pooling + projector (see the module docstring)."""

    modalities = (AUDIO,)
    fsdp_units = ("blocks.*", "projector")
    ac_units = ("blocks.*",)

    def __init__(self, args: AudioArgs, llm_dim: int) -> None:
        super().__init__()
        self.args = args
        self.llm_dim = llm_dim
        self.conv1 = nn.Conv1d(args.n_mels, args.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(args.dim, args.dim, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positions", sinusoids(args.max_positions, args.dim), persistent=False)
        self.blocks = EncoderStack(self._block() for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.projector = MLPProjector(args.dim, llm_dim, args.projector_hidden or llm_dim,
                                      args.projector_depth)
        #: rows per block row (model FLOPs: torchtitan_omni.flops): the first conv runs on every
        #: mel frame (two per block row), the projector on the pooled pairs
        self.flops_row_ratios = {"conv1": 2.0, "projector": 0.5}

    def _block(self) -> EncoderBlock:
        a = self.args
        attn = SelfAttention(a.dim, a.n_heads, qkv_bias=True, out_bias=True, causal=False)
        attn.wk = nn.Linear(a.dim, a.dim, bias=False)  # Whisper's key projection has no bias
        return EncoderBlock(a.dim, attn, GeluMLP(a.dim, a.mlp_dim), a.norm_eps)

    # ----------------------------------------------------------------- forward
    def frames(
        self, features: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """Block outputs of the valid frames, packed ``[sum_i ceil(L_i / 2), dim]``, and the
        per-item frame counts after the strided conv."""
        lens = self._checked_lengths(features, lengths)
        longest = max(lens)  # frames past the longest clip are all padding
        # at most the frames the position table covers (the length check's limit)
        t = min(-(-longest // FRAME_BUCKET) * FRAME_BUCKET, 2 * self.positions.shape[0])
        features = F.pad(features[..., :longest], (0, t - longest))
        steps = torch.arange(t, device=features.device)
        valid = steps.unsqueeze(0) < to_device(lens, features.device).unsqueeze(1)  # [n, T]
        x = features.to(self.conv1.weight.dtype) * valid.unsqueeze(1)
        x = F.gelu(self.conv1(x)) * valid.unsqueeze(1)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [n, ceil(T / 2), dim]
        half = [(length + 1) // 2 for length in lens]
        x = x + self.positions[: x.shape[1]].to(x.dtype)
        # items back to back, valid frames only
        x = x.flatten(0, 1).index_select(0, valid_rows(half, x.shape[1], x.device))
        return self.blocks(x, packed_meta(half, x.device)), half

    def lm_encode(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        for key in ("features", "lengths"):
            if key not in media:
                raise KeyError(f"{modality}_{key} is missing from the batch (have: "
                               f"{', '.join(modality + '_' + k for k in media)})")
        x, half = self.frames(media["features"], media["lengths"])
        a, b = pair_pool_index(half, x.device)
        x = 0.5 * (x[a] + x[b])
        return self.projector(self.norm(x))

    # ----------------------------------------------------------------- contract
    def processing(self, modality: str):
        if modality != AUDIO:
            raise ValueError(f"AudioEncoder serves {self.modalities}, not {modality!r}")
        return self.args.processing()

    def output_rows(self, media: dict[str, torch.Tensor], modality: str) -> int:
        # ceil(L / 2) frames after the strided conv, then pairs pooled: ceil of half again
        return sum(((length + 1) // 2 + 1) // 2 for length in media["lengths"].tolist())

    def dummy_media(self, modality: str, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "features": torch.zeros(1, self.args.n_mels, DOWNSAMPLE, device=device),
            "lengths": torch.tensor([DOWNSAMPLE], dtype=torch.long),  # sizes stay on the host
        }

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device or self.positions.device
        if device.type != "meta":
            self.positions = sinusoids(self.args.max_positions, self.args.dim).to(device)
        for conv in (self.conv1, self.conv2):
            init.kaiming_uniform_linear_(conv.weight)
            init.zeros_(conv.bias)
        for block in self.blocks:
            block.init_weights(0.02)
        init_layer_norm(self.norm)
        self.projector.init_weights(0.02)

    def hf_adapter(self):
        if self.args.hf_format == "qwen2_audio":
            return Qwen2AudioAdapter(self.args, self.llm_dim)
        return WhisperEncoderAdapter(self.args, self.llm_dim)

    # ----------------------------------------------------------------- checks
    def _checked_lengths(self, features: torch.Tensor, lengths: torch.Tensor) -> list[int]:
        a = self.args
        if features.dim() != 3 or features.shape[1] != a.n_mels:
            raise ValueError(
                f"audio_features must be [n, {a.n_mels}, T], got {tuple(features.shape)}"
            )
        if lengths.dim() != 1 or lengths.shape[0] != features.shape[0]:
            raise ValueError(
                f"audio_lengths must be [n] with n = {features.shape[0]} clips, got "
                f"{tuple(lengths.shape)}"
            )
        lens = [int(v) for v in lengths.tolist()]
        t = features.shape[2]
        limit = 2 * a.max_positions
        for i, length in enumerate(lens):
            if not 1 <= length <= t:
                raise ValueError(
                    f"audio_lengths[{i}] = {length} is outside [1, {t}] (features' frames)"
                )
            if length > limit:
                raise ValueError(
                    f"audio clip {i} has {length} mel frames, more than the {limit} of a "
                    f"{a.chunk_seconds} s chunk; the processor should split or truncate it"
                )
        return lens
