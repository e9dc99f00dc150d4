"""Audio for Whisper-style encoders: mono, resampled to 16 kHz, log-mel, chunked.

Clips longer than ``chunk_seconds`` are split into consecutive chunks, each an item of its own
(the placeholder expands to all chunks' tokens), so nothing is cut off. Features follow
Whisper: periodic Hann window, centered reflect-padded STFT, power spectrum, Slaney mel filters,
``log10`` clamped at 1e-10, floored at (max - 8), then ``(x + 4) / 4``. A chunk of ``n``
samples has ``n // hop_length + 1`` frames (``AudioProcessing.num_frames``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.media import load_audio
from torchtitan_omni.data.processors.base import Item, Processor
from torchtitan_omni.protocols.processing import AudioProcessing


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited polyphase resampling of a mono waveform from ``rate`` to ``target`` Hz."""
    if rate == target:
        return wave.astype(np.float32, copy=False)
    from scipy.signal import resample_poly  # noqa: PLC0415  (seconds to import; rarely needed)

    g = math.gcd(rate, target)
    return resample_poly(wave.astype(np.float64), target // g, rate // g).astype(np.float32)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    lin = m * (200.0 / 3)
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log, lin)


@functools.lru_cache(maxsize=8)
def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Slaney-normalized triangular mel filters ``[n_mels, n_fft // 2 + 1]`` (librosa's)."""
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    lower = (freqs[None, :] - edges[:-2, None]) / np.diff(edges)[:-1, None]
    upper = (edges[2:, None] - freqs[None, :]) / np.diff(edges)[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights).float()


def log_mel(wave: np.ndarray, cfg: AudioProcessing) -> torch.Tensor:
    """Whisper log-mel features ``[n_mels, len // hop + 1]`` of a 16 kHz mono chunk."""
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
    if x.numel() < cfg.n_fft // 2 + 1:  # reflect padding needs more samples than half a window
        x = torch.nn.functional.pad(x, (0, cfg.n_fft // 2 + 1 - x.numel()))
        frames = cfg.num_frames(wave.shape[0])
    else:
        frames = None
    spec = torch.stft(
        x, cfg.n_fft, cfg.hop_length, window=torch.hann_window(cfg.n_fft), center=True,
        pad_mode="reflect", return_complex=True,
    )
    power = spec.abs() ** 2
    mel = mel_filters(cfg.sample_rate, cfg.n_fft, cfg.n_mels) @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    out = (logs + 4.0) / 4.0
    return out[:, :frames] if frames is not None else out


class AudioProcessor(Processor):
    """``AudioProcessing``: features ``[n_mels, T]`` and length ``T`` per chunk."""

    config: AudioProcessing

    def process_wave(self, wave: np.ndarray, rate: int) -> list[Item]:
        """A mono waveform at ``rate`` Hz -> one item per chunk."""
        cfg = self.config
        wave = resample(wave, rate, cfg.sample_rate)
        limit = int(cfg.chunk_seconds * cfg.sample_rate)
        items = []
        for start in range(0, max(1, wave.shape[0]), limit):
            chunk = wave[start:start + limit]
            feats = log_mel(chunk, cfg)
            assert feats.shape[1] == cfg.num_frames(chunk.shape[0]), (feats.shape, chunk.shape)
            items.append(Item(
                {"features": feats, "lengths": torch.tensor(feats.shape[1], dtype=torch.int64)},
                cfg.num_tokens(feats.shape[1]),
            ))
        return items

    def __call__(self, ref: Any, root: str, source: Source | None = None) -> list[Item]:
        wave, rate = load_audio(ref, root, source)
        return self.process_wave(wave, rate)

    def collate(self, items: list[Item]) -> dict[str, torch.Tensor]:
        longest = max(it.tensors["features"].shape[1] for it in items)
        feats = torch.zeros(len(items), self.config.n_mels, longest)
        for i, it in enumerate(items):
            f = it.tensors["features"]
            feats[i, :, : f.shape[1]] = f
        return {"features": feats, "lengths": torch.stack([it.tensors["lengths"] for it in items])}
