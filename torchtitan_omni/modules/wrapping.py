"""Changing how a module runs without replacing its ``forward``: a per-class subclass.

Activation checkpointing, ``torch.compile`` and the encoders' sequence-parallel split each
wrap a module's forward. Wrapper modules would add a level to every parameter name (and so
to checkpoints, weight maps and the layout-invariant init); patching ``forward`` on the
instance hides the change from readers and tools. :func:`extend_class` does what FSDP2's
``fully_shard`` does: the module's class becomes a subclass of itself with a mixin first in
the method order, and the mixin's ``forward`` calls ``super().forward``. Names, parameters,
hooks and ``isinstance`` checks are unchanged; the mixin's per-instance settings are plain
attributes.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

_SUBCLASSES: dict[tuple[type, type], type] = {}


def extend_class(module: nn.Module, mixin: type, **state: Any) -> None:
    """Put ``mixin`` first in ``module``'s class (one subclass per (mixin, class) pair, reused)
    and set ``state`` as attributes of the module."""
    if isinstance(module, mixin):
        raise ValueError(f"{type(module).__name__} already has {mixin.__name__}")
    cls = type(module)
    sub = _SUBCLASSES.get((mixin, cls))
    if sub is None:
        sub = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _SUBCLASSES[(mixin, cls)] = sub
    module.__class__ = sub
    for name, value in state.items():
        setattr(module, name, value)
