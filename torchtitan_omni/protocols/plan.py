"""What a model spec declares about its sharding; ``torchtitan_omni.distributed`` applies it.

Module paths are ``fnmatch`` patterns over ``named_modules()`` names of the omni model, matched
segment by segment (``*`` never crosses a dot), e.g. ``"llm.layers.*"`` or
``"encoders.vision.blocks.*"``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted segment: ``"layers.*"`` matches ``layers.3``, not ``layers.3.mlp``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))

# Which mesh a part is FSDP-sharded over:
#   "fsdp":     dp_shard x sp (sequence-parallel ranks co-shard parameters; the default)
#   "dp_shard": dp_shard only (replicated over sp), for parts that do not see the SP split
#   "none":     not sharded; gradients all-reduced over all data and sequence ranks
MeshChoice = Literal["fsdp", "dp_shard", "none"]


@dataclass(frozen=True)
class PartLayout:
    """How one part of the omni model (the LLM, an encoder, a decoder) is laid out."""

    #: the part's module path, e.g. "llm", "encoders.vision", "decoders.gen_image"
    root: str
    #: sub-modules (patterns relative to ``root``) wrapped by their own ``fully_shard``,
    #: in wrapping order; the part itself is wrapped last
    fsdp_units: tuple[str, ...] = ()
    mesh: MeshChoice = "fsdp"
    #: sub-modules (patterns relative to ``root``) that activation checkpointing may wrap
    ac_units: tuple[str, ...] = ()
    #: groups of sub-modules (patterns relative to ``root``) wrapped together by one
    #: ``fully_shard``, before ``fsdp_units``: modules sharing a parameter (a head tied to the
    #: embedding) must be in one unit, which stays gathered from the first one's forward to
    #: the last one's
    fsdp_groups: tuple[tuple[str, ...], ...] = ()
    #: FSDP units or groups (patterns relative to ``root``; a group matches if a member does)
    #: left gathered after their forward under ``parallelism.fsdp_reshard_after_forward =
    #: "default"``: the backward needs them first, so resharding would only gather them again
    #: at once (TorchTitan's default leaves its norm and head gathered for the same reason)
    gathered_after_forward: tuple[str, ...] = ()


@dataclass(frozen=True)
class OmniParallelPlan:
    """A model spec's declaration of what is sharded how."""

    parts: tuple[PartLayout, ...] = ()
    #: attention modules (patterns) that run Ulysses sequence parallel
    sequence_parallel_attention: tuple[str, ...] = ()
    #: grouped-experts modules (patterns) whose experts are split by expert parallel
    experts: tuple[str, ...] = ()
    #: modules (patterns) whose parameters stay in float32 under mixed precision
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)

    def part(self, root: str) -> PartLayout:
        """The layout of the part rooted at ``root``."""
        for p in self.parts:
            if p.root == root:
                return p
        raise KeyError(f"the parallel plan has no part {root!r}")
