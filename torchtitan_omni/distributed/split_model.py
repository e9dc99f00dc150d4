"""Each rank set's share of the omni model under non-colocated encoders.

``parallelize_omni`` calls :func:`split_model` on the model built on the meta device (after
``omni.freeze``, before anything is sharded): LLM ranks keep the ``OmniModel`` with its
encoders replaced by ``RemoteEncoder`` stubs (no parameters; fed by an ``EncoderClient``),
encoder ranks keep only the encoders, in an :class:`EncoderRanksModel`. Both keep the
parameters' names of the whole model (``llm.*``, ``decoders.*`` on one side, ``encoders.*``
on the other), so the layout-invariant init, checkpoints and ``weights`` see the same names
as with colocated encoders, and each side's parallel plan is the whole plan's parts it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn as nn

from torchtitan_omni.distributed.noncolocated import RankSets, install_remote_encoders
from torchtitan_omni.distributed.part_layouts import ENCODERS
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.protocols.plan import OmniParallelPlan


def _is_encoder_path(name: str) -> bool:
    return name == "encoders" or name.startswith(ENCODERS)


def _plan_share(plan: OmniParallelPlan, encoders: bool) -> OmniParallelPlan:
    """The plan's parts (and fp32 modules) on one side; experts and SP attention stay with
    the LLM side."""
    return dataclasses.replace(
        plan,
        parts=tuple(p for p in plan.parts if _is_encoder_path(p.root) == encoders),
        fp32_modules=tuple(m for m in plan.fp32_modules if _is_encoder_path(m) == encoders),
        sequence_parallel_attention=() if encoders else plan.sequence_parallel_attention,
        experts=() if encoders else plan.experts,
    )


class EncoderRanksModel(nn.Module):
    """The model of an encoder rank: the omni model's encoders under their names
    (``encoders.<name>``), called one pass at a time by ``EncoderServer`` through
    :meth:`forward` (so FSDP's root hooks run around every pass)."""

    def __init__(self, encoders: nn.ModuleDict, plan: OmniParallelPlan, init_seed: int = 0
                 ) -> None:
        super().__init__()
        self.encoders = encoders
        self.parallel_plan = plan
        self.init_seed = init_seed

    def forward(self, name: str, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        """Encoder ``name``'s embedding rows of ``media``."""
        return cast(OmniEncoder, self.encoders[name])(media, modality)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """The encoders' layout-invariant init, under their names in the whole model."""
        with init_context(self, seed=self.init_seed):
            for encoder in self.encoders.values():
                cast(OmniEncoder, encoder).init_weights(buffer_device)

    def freeze(self, prefixes: list[str]) -> list[str]:
        """``OmniModel.freeze`` for the encoders' paths; others are the LLM ranks' (done
        before the split, so nothing is left to do here for them)."""
        modules = dict(self.named_modules())
        frozen = [p for p in prefixes if p in modules]
        for prefix in frozen:
            for param in modules[prefix].parameters():
                param.requires_grad_(False)
        return frozen


def split_model(model: nn.Module, ranks: RankSets) -> nn.Module:
    """This rank set's share of ``model`` (an ``OmniModel``; see the module docstring)."""
    omni: Any = model  # an OmniModel: its plan and seed are plain attributes
    plan: OmniParallelPlan = omni.parallel_plan
    if ranks.on_encoders:
        return EncoderRanksModel(omni.encoders, _plan_share(plan, encoders=True),
                                 int(omni.init_seed))
    install_remote_encoders(model, ranks)
    omni.parallel_plan = _plan_share(plan, encoders=False)
    return model
