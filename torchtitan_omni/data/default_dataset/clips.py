"""Short video clips for the bundled dataset: a handwritten digit moving across the frame,
written as H.264/MPEG-4 mp4 with PyAV."""

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


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
    """Encode RGB frames to an mp4 file (H.264 when available, else MPEG-4 part 2)."""
    with av.open(path, "w") as container:
        try:
            stream = container.add_stream("libx264", rate=fps)
            stream.options = {"crf": "18", "preset": "veryfast"}
        except Exception:  # noqa: BLE001  (a PyAV build without libx264)
            stream = container.add_stream("mpeg4", rate=fps)
            stream.bit_rate = 400_000
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
