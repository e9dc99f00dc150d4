"""Complete Adam/AdamW state before a save, for parameters that never had a gradient.

Torch's Adam creates a parameter's state (``step``, ``exp_avg``, ``exp_avg_sq``) at its first
gradient. A part that saw none before a save (an encoder whose modality was absent, a decoder
without targets yet) has no state in the checkpoint, while the resuming job's optimizer, built
for every parameter, expects it: the resume stopped with "N missing tensors". Saving zeros for
those parameters fixes it without changing training: zeros and step 0 are exactly the state
Adam would create at the first gradient, and a parameter without a gradient is skipped by the
update (weight decay included) either way. An optimizer with no state at all (the encoder
ranks' of non-colocated encoders before any encoder had media) gets that state for every
parameter that trains: torch's state-dict helpers would otherwise create it by stepping once
with zero gradients, which counts a step in Adam's bias correction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

#: optimizers whose lazily created state is all zeros (so pre-creating it changes nothing)
ZERO_INITIALIZED = (torch.optim.Adam, torch.optim.AdamW)


def complete_optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Give every parameter without state the zero state of its optimizer; returns how many.

    The structure is copied from a parameter that has state (tensors of the parameter's
    shape become zeros like the new parameter, other tensors zeros like themselves), so
    options such as ``amsgrad`` or a fused optimizer's device-side ``step`` are kept."""
    added = 0
    for opt in optimizers:
        if not isinstance(opt, ZERO_INITIALIZED):
            continue
        params = [p for group in opt.param_groups for p in group["params"]]
        template = next(((p, opt.state[p]) for p in params if opt.state.get(p)), None)
        if template is None:
            # No parameter has stepped yet (an optimizer of non-colocated encoders whose
            # modalities were all absent so far): without state, torch's state-dict helpers
            # would make one by stepping with zero gradients, which counts an Adam step.
            added += _zero_states(opt)
            continue
        shape = template[0].shape
        for p in params:
            if opt.state.get(p):
                continue
            opt.state[p] = {
                key: (torch.zeros_like(p, dtype=value.dtype) if value.shape == shape
                      else torch.zeros_like(value)) if isinstance(value, torch.Tensor) else value
                for key, value in template[1].items()
            }
            added += 1
    return added


def _zero_states(opt: torch.optim.Optimizer) -> int:
    """Adam's state at step 0 for every parameter that trains (what its first step creates:
    ``torch.optim.adam``'s initialization), with no state to copy from."""
    added = 0
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in opt.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = {"step": torch.zeros((), dtype=scalar,
                                         device=p.device if on_device else None),
                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            opt.state[p] = state
            added += 1
    return added


class CompleteOptimizerState(Stateful):
    """The checkpoint's optimizer entry: TorchTitan's optimizers container, whose state is
    completed (:func:`complete_optimizer_state`) whenever its state dict is taken."""

    def __init__(self, optimizers: Any) -> None:
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        complete_optimizer_state(self.optimizers)
        return self.optimizers.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers.load_state_dict(state_dict)
