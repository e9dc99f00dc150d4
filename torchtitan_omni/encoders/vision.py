"""Qwen2-VL style vision encoder: native-resolution patches, 2-D RoPE, packed attention, 2x2
merger. One module serves images and videos (videos bring several temporal patches).

Construct with ``VisionEncoder(args: VisionArgs, llm_dim: int)``; ``VisionArgs()`` is
Qwen2-VL-7B's vision tower (675M parameters), ``VisionArgs.debug()`` a tiny one for CPU runs.

Input (media keys without the ``image_`` / ``video_`` prefix, from ``ImageProcessing(mode=
"patches")`` / ``VideoProcessing``):

- ``patches`` float ``[N, 3 * temporal_patch * patch * patch]``: each row one patch,
  flattened (channel, frame, row, column); rows of one item ordered temporal patch first, then
  merge windows in raster order, then the ``merge x merge`` patches of a window in raster
  order. :func:`patchify` is the reference of this layout (it equals Qwen2-VL's processor).
- ``grid_thw`` int64 ``[n_items, 3]``: temporal patches and patch rows / columns per item.

Output: ``[sum_i t_i * h_i * w_i / merge**2, llm_dim]``, one row per LLM placeholder token, items
in input order (``ImageProcessing.num_tokens`` of each item).

Attention runs within each temporal patch of each item (``attention_span="frame"``, as
Qwen2-VL) or within each whole item (``"item"``); items never see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_omni.encoders.blocks import (
    EncoderBlock, EncoderStack, FusedQKVAttention, QuickGeluMLP, apply_rotary, packed_meta,
)
from torchtitan_omni.encoders.hf import Qwen2VLVisionAdapter
from torchtitan_omni.encoders.projector import PatchMerger
from torchtitan_omni.modules import init
from torchtitan_omni.modules.host import to_device
from torchtitan_omni.modules.mlp import GeluMLP
from torchtitan_omni.protocols.batch import IMAGE, VIDEO
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.protocols.processing import ImageProcessing, VideoProcessing


@dataclass
class VisionArgs:
    """Vision tower hyper-parameters (defaults: Qwen2-VL-7B) and its processing bounds."""

    dim: int = 1280
    depth: int = 32
    n_heads: int = 16
    mlp_ratio: float = 4.0
    in_channels: int = 3
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    #: "quick_gelu" (Qwen2-VL) or "gelu"
    hidden_act: str = "quick_gelu"
    #: "frame": attend within each temporal patch (Qwen2-VL); "item": within the whole video
    attention_span: str = "frame"
    #: LLM width of the Hugging Face checkpoint's merger (None: ours); when it differs, the
    #: merger's last linear is not loaded and keeps its initialization
    hf_llm_dim: int | None = None
    # processing (data pipeline) bounds: Qwen2-VL's recommended image range caps an image at
    # 1,280 LLM tokens (about 1,000 x 1,000 px); video frames up to 448 x 448 px (256 tokens
    # per temporal patch), 32 frames at 2 fps
    image_min_pixels: int = 56 * 56
    image_max_pixels: int = 1280 * 28 * 28
    video_min_pixels: int = 56 * 56
    video_max_pixels: int = 448 * 448
    video_fps: float = 2.0
    video_max_frames: int = 32

    def __post_init__(self) -> None:
        if self.attention_span not in ("frame", "item"):
            raise ValueError(
                f"attention_span must be 'frame' or 'item', got {self.attention_span!r}"
            )
        if self.hidden_act not in ("quick_gelu", "gelu"):
            raise ValueError(f"hidden_act must be 'quick_gelu' or 'gelu', got {self.hidden_act!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(
                f"dim {self.dim} / n_heads {self.n_heads} must give a head_dim divisible by 4 "
                "(2-D rotary embedding)"
            )

    @classmethod
    def debug(cls) -> "VisionArgs":
        """A tiny tower that trains on 2 CPU cores in seconds (8-pixel patches)."""
        return cls(
            dim=64, depth=2, n_heads=4, mlp_ratio=2.0, patch_size=8, image_min_pixels=16 * 16,
            image_max_pixels=64 * 64, video_min_pixels=16 * 16, video_max_pixels=32 * 32,
            video_max_frames=8,
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def patchify(
    frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Reference patch layout: ``frames`` ``[F, C, H, W]`` -> (patches, (t, h, w)).

    ``H`` and ``W`` must be multiples of ``patch_size * merge_size``. Frames are padded to a
    multiple of ``temporal_patch_size`` by repeating the last one (an image is one frame).
    """
    f, c, height, width = frames.shape
    factor = patch_size * merge_size
    if height % factor or width % factor:
        raise ValueError(
            f"frame size {height}x{width} is not a multiple of {factor} (patch x merge)"
        )
    pad = -f % temporal_patch_size
    if pad:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    t, h, w = frames.shape[0] // temporal_patch_size, height // patch_size, width // patch_size
    m, p = merge_size, patch_size
    x = frames.reshape(t, temporal_patch_size, c, h // m, m, p, w // m, m, p)
    # -> (t, window row, window col, row in window, col in window | channel, frame, y, x)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * temporal_patch_size * p * p), (t, h, w)


def merge_window_positions(
    grid: list[list[int]], merge_size: int, device: torch.device
) -> torch.Tensor:
    """(row, column) of every patch, in the merge-window order of :func:`patchify`: ``[N, 2]``."""
    out = []
    m = merge_size
    for t, h, w in grid:
        rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
        cols = torch.arange(w, device=device).view(1, w).expand(h, w)
        hw = torch.stack([rows, cols], dim=-1).reshape(h // m, m, w // m, m, 2)
        out.append(hw.permute(0, 2, 1, 3, 4).reshape(h * w, 2).repeat(t, 1))
    return torch.cat(out, dim=0)


class VisionRotary2D(nn.Module):
    """2-D rotary embedding: the first half of each head's frequencies rotate by the patch row,
    the second half by the column (Qwen2-VL's layout, "rotate half" pairing).

    The encoder computes the tables once per forward (``tables``) and hands them to every
    block through ``AttentionMeta.rope_tables``; the blocks only apply them
    (``torchtitan_omni.encoders.blocks.apply_rotary``).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        axis_dim = self.head_dim // 2
        exponent = torch.arange(0, axis_dim, 2, dtype=torch.float64, device=device) / axis_dim
        return (1.0 / self.theta**exponent).float()

    def tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, signed sin)`` ``[..., S, 1, D]`` of (row, column) ``position_ids``
        ``[..., S, 2]``, as ``apply_rotary`` takes them."""
        inv = self.inverse_frequencies(position_ids.device)
        freqs = (position_ids.float().unsqueeze(-1) * inv).flatten(-2)  # [..., S, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # both halves of a head share the angles; the first half's sine is negated
        return (torch.cat([cos, cos], dim=-1).unsqueeze(-2),
                torch.cat([-sin, sin], dim=-1).unsqueeze(-2))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[..., S, H, D]`` by (row, column) ``position_ids`` ``[..., S, 2]``."""
        return apply_rotary(x, self.tables(position_ids))


class PatchEmbed(nn.Module):
    """A linear over each flattened patch (Qwen2-VL's stride-equal Conv3d, without bias).

    The weight keeps the Conv3d shape ``[dim, C, t, p, p]`` so checkpoints map one-to-one.
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        p = args.patch_size
        self.weight = nn.Parameter(
            torch.empty(args.dim, args.in_channels, args.temporal_patch_size, p, p)
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight.flatten(1))


class VisionEncoder(OmniEncoder):
    """Qwen2-VL vision tower + merger into the LLM width (see the module docstring)."""

    modalities = (IMAGE, VIDEO)
    merge_modalities = True  # images and videos are both patch items with a grid
    #: sub-modules a parallel plan should wrap with FSDP / may checkpoint (patterns)
    fsdp_units = ("blocks.*", "merger")
    ac_units = ("blocks.*",)

    def __init__(self, args: VisionArgs, llm_dim: int) -> None:
        super().__init__()
        self.args = args
        self.llm_dim = llm_dim
        self.patch_embed = PatchEmbed(args)
        self.rope = VisionRotary2D(args.head_dim, args.rope_theta)
        mlp_dim = int(args.dim * args.mlp_ratio)
        mlp_cls = QuickGeluMLP if args.hidden_act == "quick_gelu" else GeluMLP
        self.blocks = EncoderStack(
            EncoderBlock(args.dim, FusedQKVAttention(args.dim, args.n_heads, rope=self.rope),
                         mlp_cls(args.dim, mlp_dim), args.norm_eps)
            for _ in range(args.depth)
        )
        self.merger = PatchMerger(args.dim, llm_dim, args.merge_size, args.norm_eps)
        #: the merger's MLP runs on one row per merge window (model FLOPs: torchtitan_omni.flops)
        self.flops_row_ratios = {"merger.mlp": 1 / args.merge_size**2}

    # ----------------------------------------------------------------- contract
    def processing(self, modality: str):
        a = self.args
        common = dict(patch_size=a.patch_size, merge_size=a.merge_size,
                      temporal_patch_size=a.temporal_patch_size)
        if modality == IMAGE:
            return ImageProcessing(mode="patches", min_pixels=a.image_min_pixels,
                                   max_pixels=a.image_max_pixels, **common)
        if modality == VIDEO:
            return VideoProcessing(mode="patches", min_pixels=a.video_min_pixels,
                                   max_pixels=a.video_max_pixels, fps=a.video_fps,
                                   max_frames=a.video_max_frames, **common)
        raise ValueError(f"VisionEncoder serves {self.modalities}, not {modality!r}")

    def dummy_media(self, modality: str, device: torch.device) -> dict[str, torch.Tensor]:
        m = self.args.merge_size
        return {
            "patches": torch.zeros(m * m, self.args.patch_dim, device=device),
            "grid_thw": torch.tensor([[1, m, m]], dtype=torch.long),  # item sizes stay on the host
        }

    def output_rows(self, media: dict[str, torch.Tensor], modality: str) -> int:
        return sum(t * h * w for t, h, w in media["grid_thw"].tolist()) // self.args.merge_size**2

    def lm_encode(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        patches, grid = self._checked(media, modality)
        x = self.patch_embed(patches)
        # Built on the host from the grid already read, then one copy (no per-item kernels).
        positions = merge_window_positions(grid, self.args.merge_size, torch.device("cpu"))
        positions = to_device(positions, x.device)
        # The rotary tables depend only on the positions: computed once for all the blocks.
        meta = packed_meta(self._segments(grid), x.device, positions, self.rope.tables(positions))
        return self.merger(self.blocks(x, meta))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        init.trunc_normal_(self.patch_embed.weight, std=0.02)
        for block in self.blocks:
            block.init_weights(0.02)
        self.merger.init_weights(0.02)

    def hf_adapter(self):
        return Qwen2VLVisionAdapter(self.args, self.llm_dim)

    def attention_segments(self, media: dict[str, torch.Tensor], modality: str) -> list[int]:
        """Rows of each sequence the blocks attend within: every temporal patch of every item
        (``attention_span = "frame"``) or every whole item (``"item"``). Model FLOPs count the
        towers' attention by these (``torchtitan_omni.flops``)."""
        del modality
        return self._segments(media["grid_thw"].tolist())

    # ----------------------------------------------------------------- helpers
    def _segments(self, grid: list[list[int]]) -> list[int]:
        if self.args.attention_span == "item":
            return [t * h * w for t, h, w in grid]
        return [h * w for t, h, w in grid for _ in range(t)]

    def _checked(
        self, media: dict[str, torch.Tensor], modality: str
    ) -> tuple[torch.Tensor, list[list[int]]]:
        """The patches and the grid as a list, after checking they describe each other."""
        for key in ("patches", "grid_thw"):
            if key not in media:
                raise KeyError(f"{modality}_{key} is missing from the batch (have: "
                               f"{', '.join(modality + '_' + k for k in media)})")
        patches, grid_t = media["patches"], media["grid_thw"]
        if grid_t.dim() != 2 or grid_t.shape[1] != 3:
            raise ValueError(f"{modality}_grid_thw must be [n_items, 3], got {tuple(grid_t.shape)}")
        if patches.dim() != 2 or patches.shape[1] != self.args.patch_dim:
            raise ValueError(
                f"{modality}_patches must be [N, {self.args.patch_dim}] (3 x "
                f"{self.args.temporal_patch_size}"
                f" x {self.args.patch_size}^2), got {tuple(patches.shape)}"
            )
        grid = grid_t.tolist()
        m = self.args.merge_size
        for i, (t, h, w) in enumerate(grid):
            if t < 1 or h < m or w < m or h % m or w % m:
                raise ValueError(
                    f"{modality}_grid_thw row {i} is {(t, h, w)}: t must be >= 1 and h, w "
                    f"positive multiples of the merge size {m}"
                )
        total = sum(t * h * w for t, h, w in grid)
        if total != patches.shape[0]:
            raise ValueError(
                f"{modality}_grid_thw describes {total} patches but {modality}_patches has "
                f"{patches.shape[0]} rows"
            )
        return patches, grid
