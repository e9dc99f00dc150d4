"""Short video clips for the bundled dataset: a handwritten digit moving across the frame,
written as H.264/MPEG-4 mp4 with PyAV.

The encoding is reproducible: the same frames give the same bytes on every run, and with
FFmpeg's and x264's SIMD code off (as on another CPU), for the same PyAV/FFmpeg/x264 build.
Frames go to the encoder as YUV made here in integer arithmetic, not by swscale (whose SIMD
code rounds differently from its C code); x264 runs ``cpu-independent`` (its CPU-specific intra
analysis reads uninitialized memory on these small frames: the same frames encoded twice could
differ) and on one thread (its output depends on its thread count, which by default follows
the machine's cores for bigger frames); the MPEG-4 fallback uses FFmpeg's bit-exact DCTs.
"""

from __future__ import annotations

import random

import av
import numpy as np

from torchtitan_omni.data.default_dataset.vision import COLORS, DigitBank, paste, render_digit

DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


def moving_digit(rng: random.Random, bank: DigitBank, size: int = 32, frames: int = 8):
    """Frames ``[T, size, size, 3]`` of one digit moving; returns (frames, digit, color,
    direction)."""
    pick = rng.randrange(len(bank.labels))
    color = rng.choice(sorted(COLORS))
    direction = rng.choice(sorted(DIRECTIONS))
    dy, dx = DIRECTIONS[direction]
    d = size // 2
    digit = render_digit(bank.images[pick], d, COLORS[color])
    travel = size - d
    cross = rng.randint(2, travel - 2)
    out = np.zeros((frames, size, size, 3), np.uint8)
    background = rng.randint(0, 30)
    for t in range(frames):
        along = round(t * travel / (frames - 1))
        pos = along if (dy + dx) > 0 else travel - along
        top, left = (pos, cross) if dy else (cross, pos)
        canvas = np.full((size, size, 3), background, np.float32)
        paste(canvas, digit, top, left)
        out[t] = np.clip(canvas, 0, 255).astype(np.uint8)
    return out, int(bank.labels[pick]), color, direction


def yuv420p(rgb: np.ndarray) -> np.ndarray:
    """An RGB frame ``[H, W, 3]`` (even sides) as PyAV's yuv420p array ``[H * 3 / 2, W]``:
    BT.601 limited range, chroma averaged over 2x2 pixels, in integer arithmetic."""
    h, w = rgb.shape[:2]
    r, g, b = (rgb[..., i].astype(np.int32) for i in range(3))
    y = ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
    r4, g4, b4 = (c.reshape(h // 2, 2, w // 2, 2).sum(axis=(1, 3)) for c in (r, g, b))
    u = ((-38 * r4 - 74 * g4 + 112 * b4 + 512) >> 10) + 128
    v = ((112 * r4 - 94 * g4 - 18 * b4 + 512) >> 10) + 128
    return np.concatenate([y.ravel(), u.ravel(), v.ravel()]).astype(np.uint8).reshape(-1, w)


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
    """Encode RGB frames (even sides) to an mp4 file (H.264 when available, else MPEG-4 part 2),
    reproducibly (see the module docstring)."""
    with av.open(path, "w") as container:
        try:
            stream = container.add_stream("libx264", rate=fps)
            stream.options = {"crf": "18", "preset": "veryfast", "threads": "1",
                              "x264-params": "cpu-independent=1"}
        except Exception:  # noqa: BLE001  (a PyAV build without libx264)
            stream = container.add_stream("mpeg4", rate=fps)
            stream.bit_rate = 400_000
            stream.options = {"threads": "1", "flags": "+bitexact", "dct": "int",
                              "idct": "simple"}
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            frame = av.VideoFrame.from_ndarray(yuv420p(f), format="yuv420p")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
