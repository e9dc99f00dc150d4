"""Per-part layouts: ``[parallelism.parts."<part>"]`` tables over the global layout keys.

A table is keyed by a part's qualified name as the model names it (``"encoders.vision"``,
``"decoders.gen_image"``: the names ``omni.freeze`` and ``weights.sources`` take) and may set

- ``fsdp_mesh``: as ``parallelism.encoder_fsdp_mesh`` ("plan", "fsdp", "dp_shard", "none");
- ``fsdp_unit``: as ``parallelism.encoder_fsdp_unit`` ("block", "part");
- ``sequence_parallel`` (encoders only): as ``parallelism.encoder_sequence_parallel``
  ("replicate", "split", "balance");
- ``activation_checkpoint``: as ``omni.encoder_activation_checkpoint`` ("none", "full", "op",
  "attention").

- ``ranks`` (encoders only): the global ranks the encoder runs on, apart from the LLM
  (non-colocated encoders; what goes with it is checked by
  ``torchtitan_omni.config.noncolocated``).

A key a table leaves out takes the global key's value. The allowed values are read from the
global keys' annotations, so the two cannot drift apart.

TorchTitan 0.2.2's parser turns TOML tables into dataclasses only for dataclass-typed fields
(``ConfigManager._dict_to_dataclass``): a ``dict[str, SomeDataclass]`` field keeps plain
dicts, and tyro warns about the mismatch. ``parallelism.parts`` is therefore a dict of plain
tables, checked here (:func:`table_problem`) and read by the framework through
``torchtitan_omni.distributed.part_layouts.part_settings``.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from torchtitan_omni.config.job_config import Omni, Parallelism
from torchtitan_omni.distributed.part_layouts import GLOBAL_KEYS, RANKS_KEY, key_name

def _choices(section: type, key: str) -> tuple[str, ...]:
    return typing.get_args(typing.get_type_hints(section)[key])


#: the values each per-part key takes (those of its global key)
CHOICES: dict[str, tuple[str, ...]] = {
    key: _choices(Parallelism if section == "parallelism" else Omni, name)
    for key, (section, name) in GLOBAL_KEYS.items()
}


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
            if key == RANKS_KEY:
                if not (isinstance(value, list)
                        and all(isinstance(r, int) and not isinstance(r, bool) for r in value)):
                    return (f"{key_name(part, key)} must be a list of rank numbers "
                            f"(e.g. [0]), got {value!r}")
                continue
            if key not in CHOICES:
                keys = [*GLOBAL_KEYS, RANKS_KEY]
                return (f"unknown key {key_name(part, key)} (keys: {', '.join(keys)})"
                        f"{_suggest(key, keys)}")
            if not isinstance(value, str) or value not in CHOICES[key]:
                return (f"{key_name(part, key)} must be one of "
                        f"{', '.join(repr(c) for c in CHOICES[key])}, got {value!r}")
    return None
