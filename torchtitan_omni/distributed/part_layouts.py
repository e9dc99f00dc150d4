"""Which layout each encoder or decoder gets: its ``[parallelism.parts."<part>"]`` table over
the global layout keys (``parallelism.encoder_fsdp_mesh``, ``parallelism.encoder_fsdp_unit``,
``parallelism.encoder_sequence_parallel``, ``omni.encoder_activation_checkpoint``).

The framework reads a part's layout here (:func:`part_settings`, and what a plan part gets of
it: :func:`part_mesh_choice`, :func:`part_is_one_unit`); the tables' shape and values are
checked at start-up by ``torchtitan_omni.config.parts``. This module reads the job config by
attribute only, so the distributed layer needs nothing from the config layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from torchtitan_omni.protocols.plan import PartLayout

#: the per-part key -> (section, global key) whose values and default it takes
GLOBAL_KEYS = {
    "fsdp_mesh": ("parallelism", "encoder_fsdp_mesh"),
    "fsdp_unit": ("parallelism", "encoder_fsdp_unit"),
    "sequence_parallel": ("parallelism", "encoder_sequence_parallel"),
    "activation_checkpoint": ("omni", "encoder_activation_checkpoint"),
}
#: the key of an encoder's table naming the ranks it runs on (non-colocated encoders,
#: ``torchtitan_omni.distributed.rank_sets``): a list of global ranks, not a layout choice
RANKS_KEY = "ranks"
#: keys that only encoders take, and why decoders do not
ENCODER_ONLY = {
    "sequence_parallel": "it chooses which ranks encode an encoder's media items",
    # a decoder runs through lm_embed / lm_head / encode_targets, never its own forward, so
    # only its blocks' own units are gathered when it runs
    "fsdp_unit": "a decoder is called through its heads, not its forward, so its blocks stay "
                 "units of their own",
}
ENCODERS, DECODERS = "encoders.", "decoders."


def key_name(part: str, key: str | None = None) -> str:
    """The TOML key of a part's table (or of one of its keys), as a user writes it."""
    name = f'parallelism.parts."{part}"'
    return f"{name}.{key}" if key else name


@dataclass(frozen=True)
class PartSettings:
    """The layout a part gets: its table's keys, else its closest ancestor's (a decoder's
    frozen sub-part takes the decoder's), else the global keys'."""

    fsdp_mesh: str
    fsdp_unit: str
    sequence_parallel: str
    activation_checkpoint: str
    #: keys set by a table named exactly after this part (not inherited, not global)
    own: frozenset[str] = frozenset()


def _global(job_config: Any, key: str) -> str:
    section, name = GLOBAL_KEYS[key]
    return getattr(getattr(job_config, section), name)


def part_settings(job_config: Any, root: str) -> PartSettings:
    """The layout of the part (or plan part) at module path ``root`` under ``job_config``."""
    parts = getattr(job_config.parallelism, "parts", None) or {}
    # tables of root and of its ancestors, closest first ("decoders.gen_image.vq" takes
    # "decoders.gen_image")
    segments = root.split(".")
    chain = [parts[name] for name in (".".join(segments[:n]) for n in
                                      range(len(segments), 0, -1)) if name in parts]
    values = {}
    for key in GLOBAL_KEYS:
        values[key] = next((t[key] for t in chain if key in t), None) or _global(job_config, key)
    return PartSettings(**values, own=frozenset(parts.get(root, {})))


def is_llm_part(part: PartLayout) -> bool:
    """The foundation (``[activation_checkpoint]``) vs. encoders and decoders."""
    return part.root == "llm" or part.root.startswith("llm.")


def part_mesh_choice(part: PartLayout, module: nn.Module, job_config: Any) -> str:
    """The FSDP mesh ("fsdp", "dp_shard", "none") of plan part ``part`` (``module``)."""
    if is_llm_part(part):
        return part.mesh
    settings = part_settings(job_config, part.root)
    # A wholly frozen part keeps the plan's mesh under a key that is not its own (the global
    # key, a decoder's table for its sub-part): the spec replicated it on purpose (e.g. a
    # frozen VQ tokenizer: sharding it would add an all-gather per step and save no optimizer
    # state). Its own table's fsdp_mesh is the user's choice for exactly this part.
    frozen = not any(p.requires_grad for p in module.parameters())
    if settings.fsdp_mesh == "plan" or (frozen and "fsdp_mesh" not in settings.own):
        return part.mesh
    return settings.fsdp_mesh


def part_is_one_unit(part: PartLayout, job_config: Any) -> bool:
    """Whether plan part ``part`` is FSDP-sharded as one unit (an encoder's ``fsdp_unit``
    "part") instead of one unit per listed block; the LLM and the decoders always take their
    plan's units (``ENCODER_ONLY``)."""
    return (part.root.startswith(ENCODERS)
            and part_settings(job_config, part.root).fsdp_unit == "part")
