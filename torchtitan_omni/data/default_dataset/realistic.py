"""Media of realistic sizes for benchmark workloads, from the bundled dataset's own sources.

Real omni training feeds images of 448-1,344 px, video clips of 16-32 frames and 10-30 s of
speech; the bundled dataset's media are thumbnails (48 px photos, 8 frames of 32 px, 1 s of
speech), which make every image 4 LLM tokens. This module makes full-size media from the
same offline material:

- images: real photos (scikit-image, scikit-learn) cropped to a random aspect ratio and
  resized to sides of 448-1,024 px (JPEG), and grids of colored handwritten digits of that
  size (PNG);
- video: pans and zooms over the photos, and digits bouncing on a larger canvas; 224-448 px
  frames written at 4 fps for 8-16 s (mp4), so sampling at the processors' 2 fps yields
  16-32 frames;
- speech: the bundled eSpeak NG clips joined with short silences into 10-30 s (wav).

Item ``i`` of a kind depends only on (seed, kind, i): a cache holding fewer items is a prefix
of a bigger one, and :class:`MediaCache` makes only the missing files (in parallel).
"""

from __future__ import annotations

import fcntl
import json
import math
import multiprocessing
import os
import random
import shutil
from contextlib import contextmanager

import numpy as np
from PIL import Image
import soundfile as sf
from sklearn.datasets import load_sample_images

from torchtitan_omni.data.default_dataset import clips, vision

#: bumped when the generated media change, so an older cache is rebuilt
VERSION = 2  # 2: reproducible mp4 encoding, and the bundled speech clips of manifest VERSION 2
KINDS = ("image", "video", "audio")
IMAGE_SIDES = (448, 1024)
VIDEO_SIDES = (224, 448)
VIDEO_FRAMES = (16, 32)  # frames the processors sample, at SAMPLE_FPS
SAMPLE_FPS = 2
SOURCE_FPS = 4  # written frames per second (two per sampled frame)
AUDIO_SECONDS = (10.0, 30.0)
SILENCE_SECONDS = (0.15, 0.6)
#: the real photos among the bundled dataset's scikit-image pictures (no drawings, no
#: test patterns)
PHOTO_NAMES = ("astronaut", "camera", "coffee", "chelsea", "rocket", "coins", "moon", "page",
               "clock", "hubble_deep_field", "immunohistochemistry", "retina", "brick",
               "grass", "gravel", "cell")
INDEX = "media.json"


def real_photos() -> dict[str, np.ndarray]:
    """The real photos that ship with scikit-image and scikit-learn, RGB uint8."""
    photos = {k: v for k, v in vision.photos().items() if k in PHOTO_NAMES}
    sample = load_sample_images()
    for path, img in zip(sample.filenames, sample.images):
        photos[os.path.splitext(os.path.basename(path))[0]] = np.asarray(img)[..., :3]
    return photos


def _crop_box(rng: random.Random, h: int, w: int, aspect: float, cover: float):
    """A box (left, top, right, bottom) of aspect ``aspect`` (w/h) covering ``cover`` of the
    largest such box in an ``h x w`` picture, at a random place."""
    bh = min(h, w / aspect) * cover
    bw = bh * aspect
    top, left = rng.uniform(0, h - bh), rng.uniform(0, w - bw)
    return left, top, left + bw, top + bh


def photo_image(rng: random.Random, photo: np.ndarray, h: int, w: int) -> np.ndarray:
    """A random crop of aspect ``w/h`` of a photo, resized to ``h x w``, maybe mirrored."""
    box = _crop_box(rng, *photo.shape[:2], w / h, rng.uniform(0.7, 1.0))
    img = Image.fromarray(photo).resize((w, h), Image.Resampling.BICUBIC, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def digit_grid(rng: random.Random, bank: vision.DigitBank, h: int, w: int) -> np.ndarray:
    """Colored handwritten digits on a grid of cells of 56-128 px, some cells empty."""
    cell = rng.randint(56, 128)
    canvas = np.full((h, w, 3), rng.randint(0, 40), np.float32)
    for top in range(0, h - cell + 1, cell):
        for left in range(0, w - cell + 1, cell):
            if rng.random() < 0.3:
                continue
            pick = rng.randrange(len(bank.labels))
            color = vision.COLORS[rng.choice(sorted(vision.COLORS))]
            vision.paste(canvas, vision.render_digit(bank.images[pick], cell - 4, color),
                         top + 2, left + 2)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def pan_zoom(rng: random.Random, photo: np.ndarray, h: int, w: int, n: int) -> np.ndarray:
    """``n`` frames of a camera moving and zooming over a photo (from one box to another)."""
    ph, pw = photo.shape[:2]
    a = _crop_box(rng, ph, pw, w / h, rng.uniform(0.5, 1.0))
    b = _crop_box(rng, ph, pw, w / h, rng.uniform(0.5, 1.0))
    img = Image.fromarray(photo)
    out = np.empty((n, h, w, 3), np.uint8)
    for t in range(n):
        f = t / max(1, n - 1)
        box = tuple(x + f * (y - x) for x, y in zip(a, b))
        out[t] = np.asarray(img.resize((w, h), Image.Resampling.BILINEAR, box=box))
    return out


def bouncing_digits(rng: random.Random, bank: vision.DigitBank, h: int, w: int,
                    n: int) -> np.ndarray:
    """``n`` frames of 2-5 colored digits moving and bouncing off the frame's edges."""
    size = rng.randint(min(h, w) // 5, min(h, w) // 3)
    digits = []
    for _ in range(rng.randint(2, 5)):
        pick = rng.randrange(len(bank.labels))
        color = vision.COLORS[rng.choice(sorted(vision.COLORS))]
        pos = [rng.uniform(0, h - size), rng.uniform(0, w - size)]
        vel = [rng.uniform(-6, 6), rng.uniform(-6, 6)]
        digits.append((vision.render_digit(bank.images[pick], size, color), pos, vel))
    background = rng.randint(0, 40)
    out = np.empty((n, h, w, 3), np.uint8)
    for t in range(n):
        canvas = np.full((h, w, 3), background, np.float32)
        for sprite, pos, vel in digits:
            vision.paste(canvas, sprite, int(pos[0]), int(pos[1]))
            for axis, limit in ((0, h - size), (1, w - size)):
                pos[axis] += vel[axis]
                if not 0 <= pos[axis] <= limit:  # bounce
                    vel[axis] = -vel[axis]
                    pos[axis] = min(max(pos[axis], 0), limit)
        out[t] = np.clip(canvas, 0, 255).astype(np.uint8)
    return out


def speech_clip(rng: random.Random, clips_paths: list[str]) -> tuple[np.ndarray, int, float]:
    """Bundled speech clips joined by short silences, padded with silence to a length drawn
    from ``AUDIO_SECONDS``: (int16 waveform, rate, seconds)."""
    seconds = rng.uniform(*AUDIO_SECONDS)
    pieces, length, rate = [], 0, None
    while True:
        wave, r = sf.read(rng.choice(clips_paths), dtype="int16")
        rate = rate or r
        if r != rate:
            raise ValueError(f"speech clips of different rates ({r} and {rate} Hz)")
        gap = np.zeros(int(rng.uniform(*SILENCE_SECONDS) * rate), np.int16)
        if length + len(gap) + len(wave) > seconds * rate:
            break
        pieces += [gap, wave]
        length += len(gap) + len(wave)
    total = int(seconds * rate)
    pieces.append(np.zeros(total - length, np.int16))
    return np.concatenate(pieces), rate, total / rate


# ----------------------------------------------------------------- the cache
_SOURCES: dict = {}  # set before the worker processes fork (photos, digits, speech clips)


def _even(rng: random.Random, lo: int, hi: int) -> int:
    # yuv420p video needs even sides
    return 2 * rng.randint(math.ceil(lo / 2), hi // 2)


def _make(root: str, seed: int, kind: str, index: int) -> dict:
    """Write item ``index`` of ``kind`` under ``root``; returns its index entry."""
    rng = random.Random(f"{seed}-{kind}-{index}")
    photos, bank = _SOURCES["photos"], _SOURCES["digits"]
    if kind == "image":
        h, w = rng.randint(*IMAGE_SIDES), rng.randint(*IMAGE_SIDES)
        if rng.random() < 0.7:
            name = rng.choice(sorted(photos))
            pixels, ext, source = photo_image(rng, photos[name], h, w), "jpg", f"photo {name}"
        else:
            pixels, ext, source = digit_grid(rng, bank, h, w), "png", "digit grid"
        rel = os.path.join("image", f"{index:05d}.{ext}")
        Image.fromarray(pixels).save(os.path.join(root, rel), quality=90)
        return {"path": rel, "height": h, "width": w, "source": source}
    if kind == "video":
        h, w = _even(rng, *VIDEO_SIDES), _even(rng, *VIDEO_SIDES)
        sampled = _even(rng, *VIDEO_FRAMES)
        n = sampled * SOURCE_FPS // SAMPLE_FPS
        if rng.random() < 0.5:
            name = rng.choice(sorted(photos))
            frames, source = pan_zoom(rng, photos[name], h, w, n), f"pan/zoom {name}"
        else:
            frames, source = bouncing_digits(rng, bank, h, w, n), "bouncing digits"
        rel = os.path.join("video", f"{index:05d}.mp4")
        clips.write_mp4(os.path.join(root, rel), frames, SOURCE_FPS)
        return {"path": rel, "height": h, "width": w, "frames": n, "fps": SOURCE_FPS,
                "seconds": n / SOURCE_FPS, "source": source}
    if kind == "audio":
        wave, rate, seconds = speech_clip(rng, _SOURCES["speech"])
        rel = os.path.join("audio", f"{index:05d}.wav")
        sf.write(os.path.join(root, rel), wave, rate, subtype="PCM_16")
        return {"path": rel, "seconds": seconds, "rate": rate, "source": "eSpeak NG clips"}
    raise ValueError(f"unknown media kind {kind!r} (known: {', '.join(KINDS)})")


def _make_task(task: tuple) -> dict:
    return _make(*task)


@contextmanager
def _lock(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class MediaCache:
    """Realistic media under ``root/seed<seed>``, made on demand, shared by every build.

    ``speech_dir``: the bundled dataset's speech clips (``media/speech/train``)."""

    def __init__(self, root: str, seed: int, speech_dir: str) -> None:
        self.root = os.path.join(root, f"seed{seed}")
        self.seed = seed
        self.speech_dir = speech_dir
        self.made = 0  # files the last ensure() made

    def _read_index(self) -> dict:
        path = os.path.join(self.root, INDEX)
        try:
            with open(path) as f:
                index = json.load(f)
        except (OSError, ValueError):
            return {}
        return index if index.get("version") == VERSION else {}

    def _sources(self) -> dict:
        speech = sorted(os.path.join(self.speech_dir, n) for n in os.listdir(self.speech_dir)
                        if n.endswith(".wav")) if os.path.isdir(self.speech_dir) else []
        if not speech:
            raise FileNotFoundError(f"no speech clips in {self.speech_dir}: build the bundled "
                                    "dataset first (scripts/build_default_dataset.py)")
        return {"photos": real_photos(), "digits": vision.digit_bank("train"), "speech": speech}

    def ensure(self, counts: dict[str, int], jobs: int = 1) -> dict[str, list[dict]]:
        """The first ``counts[kind]`` items of each kind (index entries, paths relative to
        ``self.root``), making the missing ones with ``jobs`` processes."""
        with _lock(self.root + ".lock"):
            index = self._read_index()
            if not index:  # none yet, or of an older version
                shutil.rmtree(self.root, ignore_errors=True)
                index = {"version": VERSION, "seed": self.seed, **{k: [] for k in KINDS}}
            tasks = [(self.root, self.seed, kind, i) for kind, n in counts.items()
                     for i in range(len(index[kind]), n)]
            self.made = len(tasks)
            if tasks:
                for kind in KINDS:
                    os.makedirs(os.path.join(self.root, kind), exist_ok=True)
                _SOURCES.update(self._sources())
                if jobs > 1 and len(tasks) > 1:
                    with multiprocessing.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
                        made = pool.map(_make_task, tasks, chunksize=1)
                else:
                    made = [_make_task(t) for t in tasks]
                for (_, _, kind, i), entry in zip(tasks, made):
                    assert len(index[kind]) == i
                    index[kind].append(entry)
                tmp = os.path.join(self.root, f".{INDEX}.tmp")
                with open(tmp, "w") as f:
                    json.dump(index, f, indent=1)
                os.replace(tmp, os.path.join(self.root, INDEX))  # last: marks the files valid
        return {kind: index[kind][:n] for kind, n in counts.items()}
