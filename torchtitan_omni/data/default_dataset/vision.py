"""Real images for the bundled dataset: handwritten digits (scikit-learn), photos and faces
(scikit-image), composed into scenes whose captions and answers are grounded in the pixels."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image
import skimage.data as data
from sklearn.datasets import load_digits

COLORS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (70, 100, 245),
    "yellow": (235, 220, 40),
    "white": (240, 240, 240),
    "orange": (245, 140, 30),
    "purple": (170, 70, 210),
    "cyan": (40, 210, 220),
}
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

PHOTOS = {
    "astronaut": "a portrait of an astronaut in a white spacesuit in front of a flag",
    "camera": "a black and white photo of a man with a camera on a tripod",
    "coffee": "a cup of coffee on a saucer",
    "chelsea": "a tabby cat looking to the side",
    "rocket": "a rocket standing on its launch pad",
    "horse": "the black silhouette of a horse",
    "coins": "old coins on a gray background",
    "moon": "the cratered surface of the moon",
    "page": "a scanned page of printed text",
    "text": "a grayscale photo of large letters",
    "clock": "a clock on a wall",
    "hubble_deep_field": "a telescope image of many distant galaxies",
    "immunohistochemistry": "a stained tissue sample under a microscope",
    "retina": "a photo of the back of a human eye",
    "brick": "a wall of bricks",
    "grass": "a close view of grass",
    "gravel": "a close view of gravel",
    "cell": "a cell seen through a microscope",
    "colorwheel": "a wheel of rainbow colors",
    "logo": "the scikit-image logo",
    "checkerboard": "a black and white checkerboard",
    "shepp_logan_phantom": "the Shepp-Logan phantom, a test image of a head slice",
}


@dataclass
class DigitBank:
    """Handwritten digits (8x8, values 0..16) of one split, with labels."""

    images: np.ndarray
    labels: np.ndarray


def digit_bank(split: str) -> DigitBank:
    """scikit-learn's digits: rows ``i % 10 < 8`` train, ``== 8`` val, ``== 9`` test (disjoint
    writers' samples, so held-out splits show unseen handwriting)."""
    d = load_digits()
    idx = np.arange(len(d.target))
    keep = {"train": idx % 10 < 8, "val": idx % 10 == 8, "test": idx % 10 == 9}[split]
    return DigitBank(d.images[keep], d.target[keep])


def render_digit(img8: np.ndarray, size: int, color) -> tuple[np.ndarray, np.ndarray]:
    """A digit upscaled to ``size`` px: (RGB float image, alpha mask in [0, 1])."""
    gray = Image.fromarray((img8 / 16.0 * 255).astype(np.uint8)).resize(
        (size, size), Image.Resampling.BILINEAR
    )
    alpha = np.asarray(gray, dtype=np.float32) / 255.0
    return alpha[..., None] * np.asarray(color, np.float32), alpha


def paste(canvas: np.ndarray, digit: tuple[np.ndarray, np.ndarray], top: int, left: int) -> None:
    """Alpha-blend a rendered digit onto a float canvas in place."""
    rgb, alpha = digit
    h, w = alpha.shape
    region = canvas[top:top + h, left:left + w]
    region[:] = region * (1 - alpha[..., None]) + rgb


@dataclass
class Scene:
    """A rendered digit scene and what it shows: (digit, color name, place) per digit."""

    image: np.ndarray
    facts: list[tuple[int, str, str]]


def scene(rng: random.Random, bank: DigitBank, size: int = 48) -> Scene:
    """One or two colored digits on a dark background, left/right or top/bottom."""
    canvas = np.full((size, size, 3), rng.randint(0, 40), np.float32)
    n = rng.choice((1, 2, 2))
    colors = rng.sample(sorted(COLORS), n)
    picks = [rng.randrange(len(bank.labels)) for _ in range(n)]
    d = size // 2 - 2
    if n == 1:
        places, spots = (
            ["middle"],
            [((size - d) // 2 + rng.randint(-3, 3), (size - d) // 2 + rng.randint(-3, 3))],
        )
    elif rng.random() < 0.5:
        places = ["left", "right"]
        y = (size - d) // 2 + rng.randint(-4, 4)
        spots = [(y, rng.randint(0, 3)), (y, size - d - rng.randint(0, 3))]
    else:
        places = ["top", "bottom"]
        x = (size - d) // 2 + rng.randint(-4, 4)
        spots = [(rng.randint(0, 3), x), (size - d - rng.randint(0, 3), x)]
    facts = []
    for p, c, place, (top, left) in zip(picks, colors, places, spots):
        paste(canvas, render_digit(bank.images[p], d, COLORS[c]), top, left)
        facts.append((int(bank.labels[p]), c, place))
    return Scene(np.clip(canvas, 0, 255).astype(np.uint8), facts)


def describe(facts: list[tuple[int, str, str]]) -> str:
    """A caption of a scene."""
    if len(facts) == 1:
        d, c, _ = facts[0]
        return f"A {c} {d} in the middle of a dark square."
    (d0, c0, p0), (d1, c1, p1) = facts
    return f"A {c0} {d0} on the {p0} and a {c1} {d1} on the {p1}."


def questions(rng: random.Random, facts: list[tuple[int, str, str]]) -> list[tuple[str, str]]:
    """Question/answer pairs about a scene, in random order."""
    qa = [("How many digits are in the image?", WORDS[len(facts)].capitalize() + ".")]
    for d, c, place in facts:
        qa.append((f"What color is the {d}?", c.capitalize() + "."))
        if place != "middle":
            qa.append((f"Which digit is on the {place}?", f"The {c} {d}."))
    if len(facts) == 2:
        qa.append(
            (
                "What is the sum of the digits?",
                f"{facts[0][0]} + {facts[1][0]} = {facts[0][0] + facts[1][0]}.",
            )
        )
    rng.shuffle(qa)
    return qa


def photos() -> dict[str, np.ndarray]:
    """The scikit-image photos that load offline, as RGB uint8 arrays."""
    out = {}
    for name in PHOTOS:
        img = np.asarray(getattr(data, name)())
        if img.dtype == bool:
            img = img.astype(np.uint8) * 255
        elif img.dtype != np.uint8:
            img = (255 * (img - img.min()) / max(1e-9, float(img.max() - img.min()))).astype(
                np.uint8
            )
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        out[name] = img[..., :3]
    return out


def random_crop(rng: random.Random, img: np.ndarray, size: int) -> np.ndarray:
    """A random square crop covering 60-100% of the short side, maybe mirrored, resized."""
    h, w = img.shape[:2]
    side = int(min(h, w) * rng.uniform(0.6, 1.0))
    top, left = rng.randint(0, h - side), rng.randint(0, w - side)
    crop = Image.fromarray(img[top : top + side, left : left + side]).resize(
        (size, size), Image.Resampling.BICUBIC
    )
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(crop)


def faces() -> tuple[np.ndarray, np.ndarray]:
    """scikit-image's LFW subset: 200 25x25 gray images, the first 100 faces (label 1)."""
    imgs = data.lfw_subset()
    labels = np.r_[np.ones(100, np.int64), np.zeros(len(imgs) - 100, np.int64)]
    return (imgs * 255).clip(0, 255).astype(np.uint8), labels
