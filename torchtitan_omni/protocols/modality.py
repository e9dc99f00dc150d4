"""The modality registry: every modality describes itself once, here.

A :class:`Modality` says how a modality appears in data (the row keys holding its media, the
placeholder written in text), which special tokens surround its items, whether it is an
understanding input (an encoder consumes it) or a generation target (a decoder predicts it),
and which processor turns its media into tensors. The data pipeline, the tokenizer and the
config checks read the registry; nothing else lists modalities.

The built-in modalities are registered in ``torchtitan_omni.data.processors`` (where their
processors live). Registration order fixes the order of the special tokens: the built-ins come
first so the ids of existing tokenizers never change, and later modalities are appended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

#: ``data.modalities = ["all"]`` (the default): every modality the model's encoders and
#: decoders declare, registered ones included; no modality may take this name
ALL_MODALITIES = "all"

#: an understanding input (an encoder's ``modalities``) or a generation target (a decoder's)
Role = Literal["input", "target"]


@dataclass(frozen=True)
class Modality:
    """How one modality appears in data, tokens and processing.

    ``role`` "input": an encoder reads the items, whose pads take its ``lm_encode`` rows
    (``<name>_embed_index``). ``role`` "target": a decoder generates the items; only assistant
    turns may hold them, the start token is a text target, the pads take the decoder's
    ``lm_embed`` rows (teacher forcing) and ``<name>_target_index`` marks, at the position
    before each pad, the row that position predicts.

    ``processing`` is the processor config class (``torchtitan_omni.protocols.processing`` or
    the modality's own) that an encoder's or decoder's ``processing()`` returns;
    ``processor`` builds the data processor from such a config (typed loosely: processors
    live in the data layer, above this one).
    """

    name: str
    role: Role = "input"
    processing: type | None = None
    processor: Callable[[Any], Any] | None = None
    #: row keys holding the media, plural first ("images", "image"); default from ``name``
    keys: tuple[str, ...] = ()
    #: placeholder written in sample text; default ``<name>``
    placeholder: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"modality name {self.name!r} must be an identifier")
        if self.name == ALL_MODALITIES:
            raise ValueError(f"modality name {self.name!r} is reserved: data.modalities = "
                             f"[{self.name!r}] means every modality the model declares")
        if self.role not in ("input", "target"):
            raise ValueError(f"modality role must be 'input' or 'target', got {self.role!r}")
        # frozen: defaults derived from the name are set through object.__setattr__
        if not self.keys:
            object.__setattr__(self, "keys", (self.name + "s", self.name))
        if not self.placeholder:
            object.__setattr__(self, "placeholder", f"<{self.name}>")

    @property
    def is_target(self) -> bool:
        """Whether a decoder generates this modality (its items are predicted, not read)."""
        return self.role == "target"

    @property
    def tokens(self) -> tuple[str, str, str]:
        """The (start, pad, end) special token strings, e.g. ``<|image_start|>``."""
        name = self.name
        return media_token(name, "start"), media_token(name, "pad"), media_token(name, "end")


def media_token(modality: str, part: str) -> str:
    """A modality's special token: ``part`` is start, pad (its placeholder) or end."""
    return f"<|{modality}_{part}|>"


_REGISTRY: dict[str, Modality] = {}
_version = 0


def register_modality(modality: Modality, replace: bool = False) -> Modality:
    """Add ``modality`` (after those already registered); ``replace`` swaps an existing one of
    the same name in place (its token order is kept)."""
    global _version
    old = _REGISTRY.get(modality.name)
    if old is not None and not replace:
        if old == modality:
            return old  # re-importing a module that registers is harmless
        raise ValueError(f"modality {modality.name!r} is already registered")
    clash = [m.name for m in _REGISTRY.values() if m.name != modality.name and (
        m.placeholder == modality.placeholder or set(m.keys) & set(modality.keys))]
    if clash:
        raise ValueError(f"modality {modality.name!r} shares a placeholder or row key with "
                         f"{clash}")
    _REGISTRY[modality.name] = modality
    _version += 1
    return modality


def unregister_modality(name: str) -> None:
    """Remove a registered modality (tests)."""
    global _version
    del _REGISTRY[name]
    _version += 1


@contextmanager
def registered(modality: Modality, replace: bool = False) -> Iterator[Modality]:
    """``modality`` registered for the duration of the block (tests); a modality it replaced
    comes back afterwards, in its place."""
    global _version
    old = _REGISTRY.get(modality.name)
    register_modality(modality, replace=replace)
    try:
        yield modality
    finally:
        if old is None:
            unregister_modality(modality.name)
        else:
            _REGISTRY[modality.name] = old  # same key: its place (token order) is kept
            _version += 1


def get_modality(name: str) -> Modality:
    """The registered modality ``name`` (KeyError naming those known)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown modality {name!r} (registered: "
                       f"{', '.join(_REGISTRY) or 'none'})") from None


def modalities() -> tuple[Modality, ...]:
    """Every registered modality, in registration order."""
    return tuple(_REGISTRY.values())


def modality_names() -> tuple[str, ...]:
    """Names of the registered modalities, in registration order."""
    return tuple(_REGISTRY)


def registry_version() -> int:
    """Changes whenever the registry does (for caches derived from it)."""
    return _version
