"""Parsing TOML + CLI into a ``JobConfig`` with one-line errors.

``OmniConfigManager`` is TorchTitan's ``ConfigManager`` (its public constructor and
``parse_args``) with these differences:

- torchtitan-omni's ``JobConfig`` extension is merged in even when a config does not name it
  in ``job.custom_config_module`` (``torchtitan_omni.config.merge``);
- a missing or malformed config file, an unknown key (TOML or ``--section.key``) and a value of
  the wrong type raise :class:`ConfigError`, whose message names the file, section and key;
- TorchTitan's warning about a missing ``model.hf_assets_path`` is left out when the job builds
  that folder itself (``torchtitan_omni.config.first_use``);
- ``parallelism.parts`` (per-part layouts, a table of tables) is checked in the TOML
  (``torchtitan_omni.config.parts``); on the command line only a key the TOML already sets can
  be overridden (``--parallelism.parts.encoders.vision.fsdp_mesh fsdp``: tyro's parse of a
  table it knows), anything else there is refused with one line (tyro would guess the nesting
  of a new table);
- the parsed config is checked by ``torchtitan_omni.config.validate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager, JobConfig

from torchtitan_omni.config.first_use import built_on_first_use, held_assets_warning
from torchtitan_omni.config.merge import OMNI_CONFIG_MODULE, omni_config_class
from torchtitan_omni.config.parts import table_problem
from torchtitan_omni.config.validate import validate_job_config
from torchtitan_omni.errors import ConfigError

__all__ = ["OMNI_CONFIG_MODULE", "ConfigError", "OmniConfigManager", "parse_config",
           "parse_job_config", "parse_job_config_or_exit"]


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a dataclass field annotation."""
    if tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return value in get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        args = get_args(tp)
        if not isinstance(value, list):
            return False
        inner = args[0] if args else Any
        return all(_matches(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


class OmniConfigManager(ConfigManager):
    """TorchTitan's config manager with torchtitan-omni's sections and clear errors."""

    def __init__(self) -> None:
        super().__init__(omni_config_class())
        self.config_path: str | None = None

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Parse ``args`` (default ``sys.argv[1:]``) into a validated ``JobConfig``."""
        args = list(sys.argv[1:] if args is None else args)
        # TorchTitan's parse reads the first of these keys, tyro the last: only the last is kept
        args = last_only(args, _CONFIG_FILE_KEYS)
        args = last_only(args, _CUSTOM_MODULE_KEYS)
        self.config_path = config_path(args)
        toml_values = load_toml(self.config_path)
        config_cls = omni_config_class(custom_config_module(args, toml_values))
        if toml_values:
            self._check_toml(config_cls, toml_values)
        check_cli_keys(config_cls, args, toml_values)
        config = self._parse_cli_values(args)
        validate_job_config(config)
        return config

    def _check_toml(self, cls: type, values: dict[str, Any], where: str = "") -> None:
        """Unknown keys and wrongly typed values, named with section and file."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        src = f" in {self.config_path}" if self.config_path else ""
        for key, value in values.items():
            full = f"{where}.{key}" if where else key
            if key not in fields:
                section = f"[{where}] " if where else ""
                kind = "key" if where else "section"
                raise ConfigError(
                    f"unknown {kind} {section}'{key}'{src}{_suggest(key, list(fields))}"
                )
            tp = hints.get(key, fields[key].type)
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, dict):
                    raise ConfigError(f"'{full}'{src} must be a table [{full}], got {value!r}")
                self._check_toml(tp, value, full)  # type: ignore[arg-type]
            elif full in _TABLE_CHECKS:
                problem = _TABLE_CHECKS[full](value)
                if problem:
                    raise ConfigError(f"{problem}{src}")
            elif not _matches(value, tp):
                raise ConfigError(
                    f"'{full}'{src} must be {_type_name(tp)}, got {value!r} "
                    f"({type(value).__name__})"
                )

    def _parse_cli_values(self, args: list[str]) -> JobConfig:
        """TorchTitan's parse (its public ``parse_args``, which merges a named
        ``job.custom_config_module`` over our sections as it does over its own); a value the
        command line cannot convert (``--training.steps abc``) becomes one
        :class:`ConfigError` line instead of tyro's framed message."""
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured), held_assets_warning() as held:
                config = super().parse_args(args)
        except SystemExit as e:
            if not e.code:
                raise  # --help: tyro printed it to standard output
            raise ConfigError(_first_message(captured.getvalue())) from None
        except AssertionError as e:
            # TorchTitan's own dataclasses assert some values when built (e.g. validation.steps)
            raise ConfigError(str(e) or "a value failed TorchTitan's own check") from None
        if not built_on_first_use(config):
            held.release()
        return config


#: keys whose value is a table of tables, checked by their own function (not by annotation)
_TABLE_CHECKS = {"parallelism.parts": table_problem}
_CONFIG_FILE_KEYS = ("--job.config_file", "--job.config-file")
_CUSTOM_MODULE_KEYS = ("--job.custom_config_module", "--job.custom-config-module")


def last_only(args: list[str], keys: tuple[str, ...]) -> list[str]:
    """``args`` without the earlier occurrences of one key (spelled as any of ``keys``, with
    its value as ``=value`` or as the next argument)."""
    spans = []
    for i, arg in enumerate(args):
        key, eq, _ = arg.partition("=")
        if key in keys:
            spans.append((i, i + 1 if eq or i + 1 == len(args) else i + 2))
    drop = {j for start, end in spans[:-1] for j in range(start, end)}
    return [arg for j, arg in enumerate(args) if j not in drop]


def config_path(args: list[str]) -> str | None:
    """The config file named on the command line (the last one wins, as for any key)."""
    path = None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in _CONFIG_FILE_KEYS:
            if eq:
                path = value
            elif i + 1 < len(args):
                path = args[i + 1]
            else:
                raise ConfigError(f"{key} needs a file path")
    return path


def load_toml(path: str | None) -> dict[str, Any] | None:
    """The TOML file's values (None without a file); a missing or malformed file is a
    :class:`ConfigError`."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def custom_config_module(args: list[str], toml_values: dict[str, Any] | None) -> str | None:
    """``job.custom_config_module`` as TorchTitan finds it: the command line, else the TOML."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in _CUSTOM_MODULE_KEYS:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    job = (toml_values or {}).get("job", {})
    return job.get("custom_config_module") if isinstance(job, dict) else None


def check_cli_keys(cls: type, args: list[str], toml_values: dict[str, Any] | None = None
                   ) -> None:
    """Every ``--section.key`` must name a field (tyro's own error is a page long); in a table
    of tables (``parallelism.parts``) only a key that ``toml_values`` sets."""
    for arg in args:
        if not arg.startswith("--") or arg in ("--help", "-h"):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        parts = name.split(".")
        tp: Any = cls
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(tp):
                break
            names = {f.name: f.type for f in dataclasses.fields(tp)}
            if part not in names and part.startswith("no_") and depth == len(parts) - 1:
                part = part[3:]  # tyro's --section.no-flag form for booleans
            if part not in names:
                where = ".".join(parts[:depth]) or "the config"
                raise ConfigError(
                    f"unknown option --{name}: {where} has no key '{part}'"
                    f"{_suggest(part, list(names))}"
                )
            tp = names[part]
            key = ".".join(parts[:depth + 1])
            if key in _TABLE_CHECKS:
                _check_table_override(key, ".".join(parts[depth + 1:]), name, toml_values)
                break


def _check_table_override(key: str, rest: str, name: str,
                          toml_values: dict[str, Any] | None) -> None:
    """``--<key>.<entry>.<leaf>`` overrides a leaf the TOML sets; anything else is refused."""
    table: Any = toml_values or {}
    for part in key.split("."):
        table = table.get(part, {}) if isinstance(table, dict) else {}
    known = {f"{entry}.{leaf}" for entry, values in table.items() if isinstance(values, dict)
             for leaf in values}
    if rest in known:
        return
    raise ConfigError(
        f"--{name}: {key} tables are set in the TOML config, e.g. "
        f'[{key}."encoders.vision"] fsdp_mesh = "none"; the command line can only change a key '
        "the TOML sets")


def _first_message(text: str) -> str:
    """The error of a framed command-line message (tyro's box), on one line."""
    lines = []
    for raw in text.splitlines():
        if raw.lstrip().startswith("╭"):
            continue  # the frame's top edge carries its title ("Value error")
        line = raw.strip().strip("│╮╰╯─ ").strip()
        if line.startswith(("Argument helptext", "For full helptext", "Usage")):
            break
        if line and not set(line) <= set("─"):
            lines.append(line)
        elif lines:
            break  # the frame's separator after the message
    return " ".join(lines) or "the command line could not be parsed"


def parse_config(config_file: str, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """A validated job config from a TOML file and ``--section.key value`` overrides."""
    return OmniConfigManager().parse_args(["--job.config_file", config_file, *overrides])


def parse_job_config(args: list[str] | None = None) -> JobConfig:
    """Parse and validate a job config from TOML + CLI arguments."""
    return OmniConfigManager().parse_args(args)


def parse_job_config_or_exit(args: list[str] | None = None,
                             report: Callable[[str], None] | None = None) -> JobConfig:
    """:func:`parse_job_config` for entry points: a ``ConfigError`` is printed on one line (and
    handed to ``report``, e.g. for the launcher's failure summary) and the process exits with
    status 2."""
    try:
        return parse_job_config(args)
    except ConfigError as e:
        line = f"torchtitan-omni: config error: {e}"
        print(line, file=sys.stderr)
        if report is not None:
            report(line)
        sys.exit(2)
