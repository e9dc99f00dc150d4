"""LoRA fine-tuning of an omni model (``[lora]``): which modules get adapters, and what trains.

:func:`apply_lora` freezes every parameter, adds adapters (``torchtitan_omni.modules.lora``) to
the modules named by ``lora.target_modules`` and unfreezes the modules of
``lora.train_modules``. It runs on the model before anything else changes it:
``parallelize_omni`` calls it first (before Ulysses, expert parallel, activation
checkpointing, ``torch.compile`` and FSDP, so each of them sees the adapters as ordinary
parameters of their modules), and the start-up checks, the converter and generation call it on
their own copies of the model.

Patterns are ``fnmatch`` over module names matched per dotted segment (as the parallel plan's,
``torchtitan_omni.protocols.plan.name_matches``); an entry may hold alternatives separated by
``|``. Every entry must select at least one module LoRA can adapt (``nn.Linear``, grouped
experts); modules an entry matches that LoRA cannot adapt (norms, attention containers) are
passed over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from torchtitan_omni.modules.lora import add_lora, unsupported_reason
from torchtitan_omni.protocols.plan import name_matches

_SHOWN = 3


@dataclass
class LoraSummary:
    """What :func:`apply_lora` did."""

    #: adapted modules, in model order
    modules: list[str]
    #: modules trained in full (``lora.train_modules``)
    trained_in_full: list[str]
    adapter_params: int
    trainable_params: int
    total_params: int

    def describe(self) -> str:
        """One log line."""
        return (f"LoRA on {len(self.modules)} modules: {self.adapter_params:,} adapter "
                f"parameters; {self.trainable_params:,} of {self.total_params:,} parameters "
                f"train" + (f" (in full: {', '.join(self.trained_in_full)})"
                            if self.trained_in_full else ""))


def _entry_matches(name: str, entry: str) -> bool:
    return any(name_matches(name, pat.strip()) for pat in entry.split("|"))


def select(model: nn.Module, entries: list[str], key: str,
           adaptable: bool) -> list[tuple[str, nn.Module]]:
    """Modules named by ``entries`` (``key`` names the config key in errors). ``adaptable``:
    keep only modules LoRA can adapt, and say why an entry that selects none failed."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    chosen: dict[str, nn.Module] = {}
    for entry in entries:
        if not entry.strip():
            raise ValueError(f"{key} has an empty entry")
        matched = [(n, m) for n, m in modules if _entry_matches(n, entry)]
        kept = [(n, m) for n, m in matched if not adaptable or unsupported_reason(m) is None]
        if not kept:
            if not matched:
                raise ValueError(f"{key} entry {entry!r} matches no module of the model")
            shown = "; ".join(f"{n} ({type(m).__name__}: {unsupported_reason(m)})"
                              for n, m in matched[:_SHOWN])
            more = f"; and {len(matched) - _SHOWN} more" if len(matched) > _SHOWN else ""
            raise ValueError(f"{key} entry {entry!r} matches no module LoRA can adapt: "
                             f"{shown}{more}")
        chosen.update(kept)
    return [(n, m) for n, m in modules if n in chosen]


def _frozen_problem(name: str, module: nn.Module, key: str) -> str | None:
    params = list(module.parameters())
    if params and not all(p.requires_grad for p in params):
        return (f"{key} selects {name}, which is frozen (omni.freeze, or a part that never "
                "trains such as a VQ tokenizer)")
    return None


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float,
               target_modules: Sequence[str], train_modules: Sequence[str] = ()) -> LoraSummary:
    """Freeze ``model``, add adapters to ``target_modules`` and unfreeze ``train_modules``
    (see the module docstring); raises ``ValueError`` with one line for bad settings."""
    if rank < 1:
        raise ValueError(f"lora.rank must be >= 1, got {rank}")
    if not alpha > 0:
        raise ValueError(f"lora.alpha must be > 0, got {alpha}")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora.dropout must be in [0, 1), got {dropout}")
    targets = select(model, list(target_modules), "lora.target_modules", adaptable=True)
    full = select(model, list(train_modules), "lora.train_modules", adaptable=False)
    for key, chosen in (("lora.target_modules", targets), ("lora.train_modules", full)):
        for name, module in chosen:
            problem = _frozen_problem(name, module, key)
            if problem:
                raise ValueError(problem)
    adapted = {n for n, _ in targets}
    for name, _ in full:
        inside = [t for t in sorted(adapted) if t == name or t.startswith(name + ".")
                  or name.startswith(t + ".")]
        if inside:
            raise ValueError(f"lora.train_modules selects {name}, which overlaps the LoRA "
                             f"target {inside[0]}: a module either gets adapters or trains in full")
    for p in model.parameters():
        p.requires_grad_(False)
    adapter_params = 0
    for _, module in targets:
        for pname in add_lora(module, rank, alpha, dropout):
            adapter_params += getattr(module, pname).numel()
    for _, module in full:
        for p in module.parameters():
            p.requires_grad_(True)
    params = list(model.parameters())
    return LoraSummary(
        modules=[n for n, _ in targets], trained_in_full=[n for n, _ in full],
        adapter_params=adapter_params,
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        total_params=sum(p.numel() for p in params),
    )


def apply_lora_config(model: nn.Module, cfg) -> LoraSummary:
    """:func:`apply_lora` with the settings of a ``[lora]`` section."""
    return apply_lora(model, cfg.rank, cfg.alpha, cfg.dropout, list(cfg.target_modules),
                      list(cfg.train_modules))


def lora_settings(cfg) -> dict:
    """The ``[lora]`` settings a checkpoint records (what exports and resumes must agree on)."""
    return {"rank": cfg.rank, "alpha": cfg.alpha, "target_modules": list(cfg.target_modules),
            "train_modules": list(cfg.train_modules)}
