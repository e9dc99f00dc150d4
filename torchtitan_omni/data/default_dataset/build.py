"""Builds the bundled dataset: every task the omni models train, with train/val/test splits.

Tasks (one JSONL file per task and split, ``{split}-{task}.jsonl``, media under ``media/``):

- ``text``: language modelling on paragraphs of the Python reference (``pydoc_data``);
- ``digits``: captions and questions about scenes of colored handwritten digits (sklearn);
- ``photos``: captions of real photos (scikit-image), random crops;
- ``faces``: "is there a face?" on real LFW crops (scikit-image);
- ``video``: captions and questions about a moving digit (mp4 clips);
- ``speech``: spoken numbers and sentences (eSpeak NG) to recognize or transcribe; the test
  split uses a voice never heard in training;
- ``generate``: image generation of a colored digit from its description.

Held-out digits come from disjoint samples of the digits set. Everything comes from installed
packages only (no network) and is reproducible for a seed: two builds with the same seed and the
same package versions write the same bytes in every file but ``manifest.json`` (its
``build_seconds``), whatever else their processes did before. The mp4s are also the same with
FFmpeg's and x264's CPU-specific (SIMD) code off, as on another CPU; the other files were not
compared across CPUs. eSpeak NG and x264 needed care for this (see ``speech`` and ``clips``);
tests/data/test_reproducible_build.py pins it. Other package versions (PyAV's FFmpeg/x264,
espeakng-loader, Pillow, scikit-learn, scikit-image, tokenizers) may write other bytes.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict

import numpy as np
from PIL import Image
import soundfile as sf

from torchtitan_omni.data.default_dataset.manifest import MANIFEST, VERSION
from torchtitan_omni.data.default_dataset import clips, speech, text, vision
from torchtitan_omni.data.default_dataset.bpe import train_tokenizer

SPLITS = ("train", "val", "test")
SIZES = {  # rows per split
    "digits": {"train": 3000, "val": 150, "test": 150},
    "video": {"train": 600, "val": 50, "test": 50},
    "speech": {"train": 900, "val": 60, "test": 60},
    "generate": {"train": 1500, "val": 100, "test": 100},
}
PHOTO_CROPS = {"train": 12, "val": 1, "test": 1}
VOICES = {
    "train": ("en-us", "en", "en-us+f3", "en+m3"),
    "val": ("en-us+f2",),
    "test": ("en-gb-scotland",),
}
VIDEO_FPS = 4


class _Writer:
    """Collects rows per (split, task) and media files under one folder."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.rows: dict[tuple[str, str], list[dict]] = defaultdict(list)

    def media_path(self, task: str, split: str, index: int, ext: str) -> str:
        rel = os.path.join("media", task, split, f"{index:05d}.{ext}")
        os.makedirs(os.path.join(self.root, os.path.dirname(rel)), exist_ok=True)
        return rel

    def image(self, task: str, split: str, index: int, pixels: np.ndarray) -> str:
        rel = self.media_path(task, split, index, "png")
        Image.fromarray(pixels).save(os.path.join(self.root, rel))
        return rel

    def add(self, task: str, split: str, row: dict) -> None:
        self.rows[(split, task)].append(row)

    def texts(self) -> list[str]:
        out = []
        for rows in self.rows.values():
            for row in rows:
                if row.get("text"):
                    out.append(row["text"])
                for m in row.get("messages", []):
                    out.append(m["content"].replace("<image>", "").replace("<video>", "")
                               .replace("<audio>", "").replace("<gen_image>", ""))
        return out

    def flush(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = defaultdict(dict)
        for (split, task), rows in sorted(self.rows.items()):
            with open(os.path.join(self.root, f"{split}-{task}.jsonl"), "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            counts[split][task] = len(rows)
        return counts


def _chat(*turns: str) -> list[dict]:
    """Alternating user/assistant messages."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]


def _text_rows(w: _Writer) -> None:
    for i, para in enumerate(text.paragraphs()):
        split = "val" if i % 20 == 18 else "test" if i % 20 == 19 else "train"
        w.add("text", split, {"text": para})


def _digit_rows(w: _Writer, seed: int) -> None:
    for split in SPLITS:
        rng = random.Random(f"{seed}-digits-{split}")
        bank = vision.digit_bank(split)
        for i in range(SIZES["digits"][split]):
            sc = vision.scene(rng, bank)
            path = w.image("digits", split, i, sc.image)
            if rng.random() < 0.4:
                prompt = rng.choice(("Describe the image.", "What does this picture show?",
                                     "Write a short caption for this image."))
                turns = [f"<image>\n{prompt}", vision.describe(sc.facts)]
            else:
                qa = vision.questions(rng, sc.facts)[: rng.choice((1, 2))]
                turns = [f"<image>\n{qa[0][0]}", qa[0][1]]
                for q, a in qa[1:]:
                    turns += [q, a]
            w.add("digits", split, {"messages": _chat(*turns), "images": [path]})


def _photo_rows(w: _Writer, seed: int) -> None:
    rng = random.Random(f"{seed}-photos")
    index: defaultdict[str, int] = defaultdict(int)
    for name, img in vision.photos().items():
        for split in SPLITS:
            for _ in range(PHOTO_CROPS[split]):
                path = w.image("photos", split, index[split], vision.random_crop(rng, img, 48))
                index[split] += 1
                prompt = rng.choice(("Describe the image.", "What is in this photo?"))
                caption = vision.PHOTOS[name][0].upper() + vision.PHOTOS[name][1:] + "."
                w.add(
                    "photos",
                    split,
                    {"messages": _chat(f"<image>\n{prompt}", caption), "images": [path]},
                )


def _face_rows(w: _Writer) -> None:
    imgs, labels = vision.faces()
    for i, (img, label) in enumerate(zip(imgs, labels)):
        split = "val" if i % 10 == 8 else "test" if i % 10 == 9 else "train"
        small = Image.fromarray(img).resize((32, 32), Image.Resampling.BICUBIC)
        rgb = np.repeat(np.asarray(small)[..., None], 3, axis=2)
        path = w.image("faces", split, i, rgb)
        answer = "Yes, there is a face." if label else "No, there is no face."
        w.add(
            "faces",
            split,
            {
                "messages": _chat("<image>\nIs there a face in this picture?", answer),
                "images": [path],
            },
        )


def _video_rows(w: _Writer, seed: int) -> None:
    for split in SPLITS:
        rng = random.Random(f"{seed}-video-{split}")
        bank = vision.digit_bank(split)
        for i in range(SIZES["video"][split]):
            frames, digit, color, direction = clips.moving_digit(rng, bank)
            rel = w.media_path("video", split, i, "mp4")
            clips.write_mp4(os.path.join(w.root, rel), frames, VIDEO_FPS)
            caption = f"A {color} {digit} moves {direction}."
            turns = rng.choice((
                ("<video>\nDescribe the video.", caption),
                ("<video>\nWhich way does the digit move?", direction.capitalize() + "."),
                ("<video>\nWhich digit is moving?", f"The {color} {digit}."),
            ))
            w.add("video", split, {"messages": _chat(*turns), "videos": [rel]})


def speech_utterances(seed: int):
    """The speech rows' utterances in the order the build says them: (split, index, text,
    voice, rate, turns). One speaker says them all, so a clip depends on those before it."""
    for split in SPLITS:
        rng = random.Random(f"{seed}-speech-{split}")
        for i in range(SIZES["speech"][split]):
            voice = rng.choice(VOICES[split])
            rate = rng.randint(150, 200)
            if rng.random() < 0.5:
                n = rng.randrange(100)
                said, turns = speech.number_words(n), ("<audio>\nWhich number is spoken?", f"{n}.")
            else:
                color, digit = rng.choice(sorted(vision.COLORS)), rng.choice(vision.WORDS)
                place = rng.choice(
                    ("on the left", "on the right", "at the top", "moving up", "moving down")
                )
                said = f"a {color} {digit} {place}"
                turns = ("<audio>\nTranscribe the audio.", said[0].upper() + said[1:] + ".")
            yield split, i, said, voice, rate, turns


def _speech_rows(w: _Writer, seed: int) -> None:
    speaker = speech.Speaker()
    for split, i, said, voice, rate, turns in speech_utterances(seed):
        wave = speaker.say(said, voice, rate)
        rel = w.media_path("speech", split, i, "wav")
        sf.write(os.path.join(w.root, rel), wave, speaker.sample_rate, subtype="PCM_16")
        w.add("speech", split, {"messages": _chat(*turns), "audios": [rel]})


def _generate_rows(w: _Writer, seed: int) -> None:
    for split in SPLITS:
        rng = random.Random(f"{seed}-generate-{split}")
        bank = vision.digit_bank(split)
        for i in range(SIZES["generate"][split]):
            pick = rng.randrange(len(bank.labels))
            digit = int(bank.labels[pick])
            color = rng.choice(sorted(vision.COLORS))
            canvas = np.zeros((32, 32, 3), np.float32)
            vision.paste(
                canvas, vision.render_digit(bank.images[pick], 28, vision.COLORS[color]), 2, 2
            )
            path = w.image("generate", split, i, np.clip(canvas, 0, 255).astype(np.uint8))
            prompt = rng.choice(
                (
                    f"Draw a {color} {digit}.",
                    f"Generate an image of a {color} handwritten {digit}.",
                    f"A {color} {vision.WORDS[digit]} on black.",
                )
            )
            w.add(
                "generate", split, {"messages": _chat(prompt, "<gen_image>"), "gen_images": [path]}
            )


def build_default_dataset(out_dir, seed: int = 0, vocab_size: int = 4096) -> dict:
    """Write the dataset, its tokenizer (``tokenizer/``) and ``manifest.json`` into ``out_dir``."""
    start = time.time()
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    w = _Writer(out_dir)
    _text_rows(w)
    _digit_rows(w, seed)
    _photo_rows(w, seed)
    _face_rows(w)
    _video_rows(w, seed)
    _speech_rows(w, seed)
    _generate_rows(w, seed)
    train_tokenizer(w.texts(), os.path.join(out_dir, "tokenizer"), vocab_size)
    counts = w.flush()
    manifest = {
        "name": "omni_default", "version": VERSION, "seed": seed, "splits": counts,
        "build_seconds": round(time.time() - start, 1),
        "sources": {
            "text": "pydoc_data.topics (CPython)", "digits": "sklearn.datasets.load_digits",
            "photos": "skimage.data", "faces": "skimage.data.lfw_subset",
            "speech": "eSpeak NG (espeakng-loader)", "video": "digits moving, PyAV mp4",
        },
    }
    with open(os.path.join(out_dir, MANIFEST), "w") as f:  # written last: marks completion
        json.dump(manifest, f, indent=1)
    return manifest
