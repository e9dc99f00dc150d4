"""How the omni model's named losses combine into the training loss.

Each head's summed loss is divided by its *global* target count (over micro-batches,
data-parallel and sequence-parallel ranks), then weighted; auxiliary losses (per-rank means)
are divided by the number of contributions so that summing gradients over ranks averages them.
"""

from __future__ import annotations

import torch

from torchtitan.config import JobConfig


class OmniLoss:
    """Weighted sum of normalized named losses; built by the train spec's ``build_loss_fn``."""

    def __init__(self, weights: dict[str, float] | None = None, aux_weight: float = 1.0) -> None:
        self.weights = dict(weights or {})
        self.aux_weight = aux_weight

    def weight(self, name: str) -> float:
        return self.weights.get(name, 1.0)

    def __call__(
        self,
        loss_sums: dict[str, torch.Tensor],
        global_counts: dict[str, torch.Tensor],
        aux_losses: dict[str, torch.Tensor],
        aux_contributions: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total loss to backpropagate, and each part's (unweighted) contribution."""
        parts: dict[str, torch.Tensor] = {}
        for name, total in loss_sums.items():
            parts[name] = total / global_counts[name].clamp(min=1).to(total.device)
        for name, value in aux_losses.items():
            parts[name] = value / aux_contributions
        loss = None
        for name, value in parts.items():
            w = self.aux_weight if name in aux_losses else self.weight(name)
            term = w * value
            loss = term if loss is None else loss + term
        if loss is None:  # a model whose forward produced no loss term at all
            raise ValueError("the step has no loss to backpropagate: the model returned no loss "
                             "sums and no auxiliary losses")
        return loss, parts


def build_omni_loss(job_config: JobConfig, **kwargs) -> OmniLoss:
    """``TrainSpec.build_loss_fn``: weights from ``omni.loss_weights``."""
    del kwargs
    weights = {}
    for entry in job_config.omni.loss_weights:
        name, _, value = entry.partition("=")
        weights[name.strip()] = float(value)
    return OmniLoss(weights, aux_weight=job_config.omni.moe_aux_loss_weight)
