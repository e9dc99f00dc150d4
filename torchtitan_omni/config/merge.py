"""TorchTitan's ``JobConfig`` class with torchtitan-omni's sections merged in.

TorchTitan merges one ``job.custom_config_module`` into its ``JobConfig`` when a config names
it; torchtitan-omni's sections are merged even when a config does not, and a user's own
extension module goes on top of them. Merging follows TorchTitan's documented rule: a section
(dataclass) present in both is merged key by key, any other field of the extension replaces
the base's.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from typing import Any

from torchtitan.config import JobConfig

from torchtitan_omni.config import job_config as omni_sections
from torchtitan_omni.errors import ConfigError

#: the module of torchtitan-omni's sections (every bundled TOML names it)
OMNI_CONFIG_MODULE = omni_sections.__name__


def merge_config_classes(base: type, extension: type) -> type:
    """A dataclass with ``base``'s fields and ``extension``'s, sections merged recursively."""
    ext_fields = {f.name: f for f in dataclasses.fields(extension)}
    spec: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(base):
        other = ext_fields.pop(f.name, None)
        if other is not None and dataclasses.is_dataclass(f.type) and dataclasses.is_dataclass(
                other.type):
            merged = merge_config_classes(f.type, other.type)  # type: ignore[arg-type]
            spec.append((f.name, merged, dataclasses.field(default_factory=merged)))
        else:
            chosen = other if other is not None else f
            # a copy: make_dataclass takes ownership of the Field it is given
            spec.append((f.name, chosen.type, copy.copy(chosen)))
    spec += [(name, f.type, copy.copy(f)) for name, f in ext_fields.items()]
    return dataclasses.make_dataclass(f"Merged{base.__name__}", spec, bases=(base,))


def omni_config_class(extension_module: str | None = None) -> type:
    """TorchTitan's ``JobConfig`` + torchtitan-omni's sections (+ ``extension_module``'s
    ``JobConfig`` when it names another module; :class:`ConfigError` if it cannot be used)."""
    merged = merge_config_classes(JobConfig, omni_sections.JobConfig)
    if not extension_module or extension_module == OMNI_CONFIG_MODULE:
        return merged
    try:
        extension = importlib.import_module(extension_module).JobConfig
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"job.custom_config_module {extension_module!r} cannot be used: {e}") from None
    return merge_config_classes(merged, extension)


def default_job_config() -> Any:
    """A ``JobConfig`` with every TorchTitan and torchtitan-omni default (not validated)."""
    return omni_config_class()()
