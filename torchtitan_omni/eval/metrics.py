"""Held-out task metrics as plain functions of predictions and references.

- :func:`answer_accuracy`: share of answers that match the reference after
  :func:`normalize_answer` (case, punctuation, articles and spacing ignored), or exactly;
- :func:`token_accuracy`: transcription accuracy over normalized words, ``1 - edits /
  reference words`` summed over the corpus (1 - word error rate, floored at 0);
- :func:`perplexity`: ``exp`` of the mean negative log-likelihood per text target;
- :func:`code_accuracy`: share of image-decoder codes whose teacher-forced argmax is the
  target code;
- :func:`image_grid`: images side by side in a grid, as 8-bit pixels for a PNG.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the dropped, spaces collapsed."""
    text = _PUNCT.sub(" ", text.lower())
    return " ".join(_ARTICLES.sub(" ", text).split())


def _paired(predictions: Sequence, references: Sequence, what: str) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{what}: {len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError(f"{what}: no references")


def answer_accuracy(predictions: Sequence[str], references: Sequence[str],
                    normalize: bool = True) -> float:
    """Share of ``predictions`` equal to their reference (normalized, or exactly)."""
    _paired(predictions, references, "answer_accuracy")
    prep = normalize_answer if normalize else (lambda s: s)
    return sum(prep(p) == prep(r) for p, r in zip(predictions, references)) / len(references)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance between two sequences (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def token_accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Word accuracy of transcriptions: ``1 - sum(edit distance) / sum(reference words)``
    over normalized words, at least 0."""
    _paired(predictions, references, "token_accuracy")
    edits = words = 0
    for p, r in zip(predictions, references):
        ref = normalize_answer(r).split()
        edits += edit_distance(normalize_answer(p).split(), ref)
        words += len(ref)
    if words == 0:
        raise ValueError("token_accuracy: the references have no words")
    return max(0.0, 1.0 - edits / words)


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(nll_sum / count)``: the perplexity of ``count`` targets of summed NLL."""
    if count <= 0:
        raise ValueError("perplexity: no targets")
    return math.exp(nll_sum / count)


def code_accuracy(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Share of positions where ``predicted`` (argmax codes) equals ``target``."""
    if predicted.shape != target.shape:
        raise ValueError(f"code_accuracy: predicted {tuple(predicted.shape)} vs target "
                         f"{tuple(target.shape)}")
    if target.numel() == 0:
        raise ValueError("code_accuracy: no codes")
    return float((predicted == target).float().mean())


def image_grid(images: torch.Tensor, columns: int = 4, gap: int = 2) -> np.ndarray:
    """Images ``[N, 3, H, W]`` in ``[-1, 1]`` as one ``[rows*(H+gap)-gap, cols*(W+gap)-gap, 3]``
    uint8 array, row by row, black between them."""
    if images.dim() != 4 or images.shape[1] != 3 or images.shape[0] == 0:
        raise ValueError(f"image_grid wants [N, 3, H, W] with N > 0, got {tuple(images.shape)}")
    n, _, h, w = images.shape
    cols = max(1, min(columns, n))
    rows = math.ceil(n / cols)
    pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    grid = np.zeros((rows * (h + gap) - gap, cols * (w + gap) - gap, 3), dtype=np.uint8)
    for i, image in enumerate(pixels):
        r, c = divmod(i, cols)
        grid[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = (
            image.permute(1, 2, 0).cpu().numpy())
    return grid
