"""``OmniLoss``: each head's sum over its global target count, weighted, plus the auxiliary
losses averaged over their contributions; a step without any loss term is refused."""

from __future__ import annotations

import pytest
import torch

from torchtitan_omni.components.loss import OmniLoss


def test_named_losses_are_normalized_weighted_and_summed():
    loss_fn = OmniLoss({"gen_image": 0.5}, aux_weight=0.01)
    sums = {"text": torch.tensor(12.0), "gen_image": torch.tensor(9.0)}
    counts = {"text": torch.tensor(4), "gen_image": torch.tensor(0)}  # no image targets: / 1
    total, parts = loss_fn(sums, counts, {"moe_aux": torch.tensor(6.0)}, aux_contributions=3)
    assert parts["text"].item() == 3.0
    assert parts["gen_image"].item() == 9.0
    assert parts["moe_aux"].item() == 2.0
    assert total.item() == pytest.approx(3.0 + 0.5 * 9.0 + 0.01 * 2.0)


def test_a_step_without_any_loss_term_is_refused():
    with pytest.raises(ValueError, match="no loss to backpropagate"):
        OmniLoss()({}, {}, {}, aux_contributions=1)
