"""The held-out metric functions on inputs with known values."""

import math

import numpy as np
import pytest
import torch

from torchtitan_omni.eval import metrics as M


def test_normalized_answers():
    assert M.normalize_answer("  The Answer: 96. ") == "answer 96"
    assert M.normalize_answer("A blue 8 on the left, and a red 3!") == "blue 8 on left and red 3"


def test_answer_accuracy():
    refs = ["96.", "Left.", "A red 2 moves up.", "Yes, there is a face."]
    assert M.answer_accuracy(refs, refs) == 1.0
    preds = ["96", "left", "a red 2 moves down", "yes there is a face"]
    assert M.answer_accuracy(preds, refs) == 0.75  # one wrong word in the third
    assert M.answer_accuracy(preds, refs, normalize=False) == 0.0
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        M.answer_accuracy(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no references"):
        M.answer_accuracy([], [])


def test_edit_distance():
    assert M.edit_distance("kitten", "sitting") == 3
    assert M.edit_distance([], ["a", "b"]) == 2
    assert M.edit_distance(["a", "b"], ["a", "b"]) == 0


def test_token_accuracy():
    refs = ["A cyan eight on the left.", "Ninety six."]  # 4 + 2 words once normalized
    assert M.token_accuracy(refs, refs) == 1.0
    # one substitution in the first, one deletion in the second: 1 - 2/6
    assert M.token_accuracy(["cyan eight on right", "ninety"], refs) == pytest.approx(2 / 3)
    assert M.token_accuracy(["", ""], refs) == 0.0
    assert M.token_accuracy(["x " * 20, "y " * 20], refs) == 0.0  # floored, not negative


def test_perplexity():
    assert M.perplexity(10 * math.log(4.0), 10) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        M.perplexity(1.0, 0)


def test_code_accuracy():
    target = torch.tensor([[3, 1, 4, 1]])
    assert M.code_accuracy(target.clone(), target) == 1.0
    assert M.code_accuracy(torch.tensor([[3, 1, 4, 2]]), target) == 0.75
    with pytest.raises(ValueError, match="predicted"):
        M.code_accuracy(torch.tensor([3, 1]), target)


def test_image_grid_places_images_row_by_row():
    white, black, red = torch.ones(3, 2, 2), -torch.ones(3, 2, 2), -torch.ones(3, 2, 2)
    red[0] = 1.0
    grid = M.image_grid(torch.stack([white, red, black]), columns=2, gap=1)
    assert grid.shape == (5, 5, 3) and grid.dtype == np.uint8
    assert (grid[0:2, 0:2] == 255).all()
    assert (grid[0:2, 3:5] == [255, 0, 0]).all()
    assert (grid[3:5, 0:2] == 0).all() and (grid[2] == 0).all()  # black image and the gap
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        M.image_grid(torch.zeros(2, 2, 2))
