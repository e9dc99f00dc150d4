"""Reading media references into decoded arrays: images (PIL), video frames, audio waveforms.

A reference is a path (relative to the dataset root unless absolute), bytes, a Hugging Face
``{"bytes": ..., "path": ...}`` dict or a ``data:`` URL. A file that does not exist raises
``BadSample(missing_media)``; one that cannot be decoded ``BadSample(corrupt_media)``.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
import soundfile as sf

from torchtitan_omni.data.bad_samples import CORRUPT_MEDIA, MISSING_MEDIA, BadSample, Source


def resolve(ref: Any, root: str, kind: str, source: Source | None) -> tuple[Any, str]:
    """(path or file object, display name) of one media reference."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            target, name = resolve(ref["bytes"], root, kind, source)
            # the struct's path (the file the bytes came from) tells one row's bytes from another
            return target, (f"{name} of {ref['path']!r}" if ref.get("path") else name)
        if ref.get("path") is not None:
            return resolve(ref["path"], root, kind, source)
        raise BadSample(
            MISSING_MEDIA, f"{kind} reference {ref!r:.80} has neither bytes nor path", source
        )
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(ref)), f"inline {kind} bytes"
    if isinstance(ref, str):
        if ref.startswith("data:"):
            try:
                payload = ref.split(",", 1)[1]
                return io.BytesIO(base64.b64decode(payload)), f"inline {kind} data URL"
            except (IndexError, ValueError) as e:
                raise BadSample(
                    CORRUPT_MEDIA, f"{kind} data URL cannot be decoded: {e}", source
                ) from None
        path = ref if os.path.isabs(ref) else os.path.join(root, ref)
        if not os.path.isfile(path):
            raise BadSample(MISSING_MEDIA, f"{kind} file {path} not found", source)
        return path, path
    raise BadSample(MISSING_MEDIA, f"{kind} reference of type {type(ref).__name__}", source)


def load_image(ref: Any, root: str, source: Source | None = None, kind: str = "image"):
    """The image as an RGB ``PIL.Image``."""
    target, name = resolve(ref, root, kind, source)
    try:
        with Image.open(target) as img:
            img.load()
            return img.convert("RGB")
    except Exception as e:  # noqa: BLE001  (PIL raises many types for bad files)
        raise BadSample(CORRUPT_MEDIA, f"{kind} {name} cannot be decoded: {e}", source) from None


@dataclass
class Video:
    """Decoded frames ``[T, H, W, 3]`` uint8 and the clip's duration in seconds."""

    frames: np.ndarray
    duration: float
    source_frames: int


def _frame_indices(
    total: int, duration: float, fps: float, max_frames: int, group: int
) -> list[int]:
    """Frames sampled at ``fps`` (at most ``max_frames``), a multiple of ``group`` of them."""
    n = int(round(duration * fps))
    n = max(group, min(n, max_frames))
    n = max(group, n // group * group)
    if total <= 0:
        return []
    return [int(round(i)) for i in np.linspace(0, total - 1, n)]


def _rgb(frame) -> np.ndarray:
    """A decoded frame as RGB uint8; one scaling thread (PyAV's thread pool start-up costs
    ~100x the conversion of a small frame)."""
    try:
        return frame.to_ndarray(format="rgb24", threads=1)
    except TypeError:  # PyAV < 15 has no threads argument
        return frame.to_ndarray(format="rgb24")


def load_video(ref: Any, root: str, fps: float, max_frames: int, group: int,
               source: Source | None = None) -> Video:
    """Frames sampled uniformly at ``fps`` (fewer, uniformly, when the clip is long)."""
    import av  # noqa: PLC0415  (loads FFmpeg's libraries: only runs with video pay for it)

    target, name = resolve(ref, root, "video", source)
    try:
        with av.open(target) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
            total = stream.frames
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            else:
                duration = 0.0
            if total <= 0:
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            if duration <= 0:
                duration = total / rate
            wanted = _frame_indices(total, duration, fps, max_frames, group)
            need = set(wanted)
            picked: dict[int, np.ndarray] = {}
            for i, frame in enumerate(container.decode(video=0)):
                if i in need:
                    picked[i] = _rgb(frame)
                if len(picked) == len(need):
                    break
    except BadSample:
        raise
    except Exception as e:  # noqa: BLE001  (PyAV raises many types for bad files)
        raise BadSample(CORRUPT_MEDIA, f"video {name} cannot be decoded: {e}", source) from None
    if not picked:
        raise BadSample(CORRUPT_MEDIA, f"video {name} has no decodable frames", source)
    # Containers may over-report their frame count: reuse the last decoded frame.
    ordered = [picked.get(i, picked[max(picked)]) for i in wanted]
    return Video(np.stack(ordered), duration, total)


def load_audio(ref: Any, root: str, source: Source | None = None) -> tuple[np.ndarray, int]:
    """Mono float32 waveform and its sample rate (soundfile; PyAV for other codecs)."""
    target, name = resolve(ref, root, "audio", source)
    errors = []
    try:
        data, rate = sf.read(target, dtype="float32", always_2d=True)
        wave = data.mean(axis=1)
    except Exception as e:  # noqa: BLE001  (any failure: PyAV gets its turn below)
        errors.append(str(e))
        wave, rate = None, 0
    if wave is None:
        if hasattr(target, "seek"):
            target.seek(0)
        try:
            wave, rate = _decode_audio_av(target)
        except Exception as e:  # noqa: BLE001  (reported with soundfile's error below)
            errors.append(str(e))
    if wave is None or wave.size == 0 or not np.isfinite(wave).all():
        why = "; ".join(errors) or "empty or non-finite samples"
        raise BadSample(CORRUPT_MEDIA, f"audio {name} cannot be decoded: {why}", source)
    return wave.astype(np.float32, copy=False), int(rate)


def _decode_audio_av(target) -> tuple[np.ndarray, int]:
    import av  # noqa: PLC0415  (loads FFmpeg's libraries: only audio soundfile cannot read)

    with av.open(target) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks = []
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), rate
