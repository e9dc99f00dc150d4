"""Per-part layouts: ``[parallelism.parts."<part>"]`` tables over the global layout keys.

A table is keyed by a part's qualified name as the model names it (``"encoders.vision"``,
``"decoders.gen_image"``: the names ``omni.freeze`` and ``weights.sources`` take) and may set

- ``fsdp_mesh``: as ``parallelism.encoder_fsdp_mesh`` ("plan", "fsdp", "dp_shard", "none");
- ``sequence_parallel`` (encoders only): as ``parallelism.encoder_sequence_parallel``
  ("replicate", "split", "balance");
- ``activation_checkpoint``: as ``omni.encoder_activation_checkpoint`` ("none", "full", "op").

``ranks`` (non-colocated encoders, ``torchtitan_omni.distributed.noncolocated``) is refused
with one line: the trainer does not run that layout yet.

A key a table leaves out takes the global key's value. The allowed values are read from the
global keys' annotations, so the two cannot drift apart.

TorchTitan 0.2.2's parser turns TOML tables into dataclasses only for dataclass-typed fields
(``ConfigManager._dict_to_dataclass``): a ``dict[str, SomeDataclass]`` field keeps plain
dicts, and tyro warns about the mismatch. ``parallelism.parts`` is therefore a dict of plain
tables, checked here (:func:`table_problem`) and read through :func:`part_settings`.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from typing import Any

from torchtitan_omni.config.job_config import Omni, Parallelism

#: the per-part key -> (section, global key) whose values and default it takes
GLOBAL_KEYS = {
    "fsdp_mesh": ("parallelism", "encoder_fsdp_mesh"),
    "sequence_parallel": ("parallelism", "encoder_sequence_parallel"),
    "activation_checkpoint": ("omni", "encoder_activation_checkpoint"),
}
#: keys designed but not yet taken by the trainer -> why they are refused
PLANNED = {
    "ranks": "non-colocated encoders (a disjoint rank set) are not yet supported by the "
             "trainer (torchtitan_omni.distributed.noncolocated; docs/parallelism.md)",
}
#: keys that only encoders take
ENCODER_ONLY = ("sequence_parallel",)
ENCODERS, DECODERS = "encoders.", "decoders."


def _choices(section: type, key: str) -> tuple[str, ...]:
    return typing.get_args(typing.get_type_hints(section)[key])


#: the values each per-part key takes (those of its global key)
CHOICES: dict[str, tuple[str, ...]] = {
    key: _choices(Parallelism if section == "parallelism" else Omni, name)
    for key, (section, name) in GLOBAL_KEYS.items()
}


def key_name(part: str, key: str | None = None) -> str:
    """The TOML key of a part's table (or of one of its keys), as a user writes it."""
    name = f'parallelism.parts."{part}"'
    return f"{name}.{key}" if key else name


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def table_problem(parts: Any) -> str | None:
    """What is wrong with the shape of ``parallelism.parts`` (a table of tables of known keys
    and values), or None. Which parts exist is the model's to say
    (``torchtitan_omni.distributed.checks.parts_problem``)."""
    if not isinstance(parts, dict):
        return (f'parallelism.parts must be a table of per-part tables '
                f'([parallelism.parts."encoders.vision"]), got {parts!r}')
    for part, table in parts.items():
        if not isinstance(table, dict):
            return (f"{key_name(part)} must be a table ([{key_name(part)}] with keys "
                    f"{', '.join(GLOBAL_KEYS)}), got {table!r}")
        for key, value in table.items():
            if key in PLANNED:
                return f"{key_name(part, key)}: {PLANNED[key]}"
            if key not in CHOICES:
                return (f"unknown key {key_name(part, key)} (keys: {', '.join(GLOBAL_KEYS)})"
                        f"{_suggest(key, list(GLOBAL_KEYS))}")
            if not isinstance(value, str) or value not in CHOICES[key]:
                return (f"{key_name(part, key)} must be one of "
                        f"{', '.join(repr(c) for c in CHOICES[key])}, got {value!r}")
    return None


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
