"""Which layout each encoder or decoder gets: its ``[parallelism.parts."<part>"]`` table over
the global layout keys (``parallelism.encoder_fsdp_mesh``,
``parallelism.encoder_sequence_parallel``, ``omni.encoder_activation_checkpoint``).

The framework reads a part's layout here (:func:`part_settings`); the tables' shape and values
are checked at start-up by ``torchtitan_omni.config.parts``. This module reads the job config
by attribute only, so the distributed layer needs nothing from the config layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the per-part key -> (section, global key) whose values and default it takes
GLOBAL_KEYS = {
    "fsdp_mesh": ("parallelism", "encoder_fsdp_mesh"),
    "sequence_parallel": ("parallelism", "encoder_sequence_parallel"),
    "activation_checkpoint": ("omni", "encoder_activation_checkpoint"),
}
#: the key of an encoder's table naming the ranks it runs on (non-colocated encoders,
#: ``torchtitan_omni.distributed.rank_sets``): a list of global ranks, not a layout choice
RANKS_KEY = "ranks"
#: keys that only encoders take
ENCODER_ONLY = ("sequence_parallel",)
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
