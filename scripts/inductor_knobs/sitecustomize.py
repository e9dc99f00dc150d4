"""Inductor settings for a benchmark's A/B, from the environment: no code change in the tree.

``scripts/gpu_benchmarks.sh`` puts this folder first on ``PYTHONPATH`` when ``INDUCTOR_KNOBS``
is set, and Python imports ``sitecustomize`` as it starts, in every process of the job (the
ranks and inductor's compile workers alike)::

    INDUCTOR_KNOBS="combo_kernels=True,cpp_wrapper=True,no_c_shim=aten._grouped_mm.default"

Each ``key=value`` sets ``torch._inductor.config.<key>`` (a dotted key reaches a sub-config,
e.g. ``triton.cudagraphs``) to the Python literal ``value``. ``no_c_shim=<op>`` (repeatable)
makes inductor's C++ wrapper call that aten op through the dispatcher instead of its C shim
(an op inductor's ``inductor_fallback_ops`` lists: torch 2.13 lists ``aten._grouped_mm.default``;
torch 2.11 does not, so there the knob is refused, forty-third session). A key inductor does
not have, a ``no_c_shim`` op it does not list, or an item that is not ``key=value``, stops the
process with one line naming it.
"""

from __future__ import annotations

import ast
import os
import sys

ENV = "INDUCTOR_KNOBS"


def apply(spec: str) -> None:
    """Apply ``spec`` (see the module docstring)."""
    import torch._inductor.config as config
    from torchgen.aoti.fallback_ops import inductor_fallback_ops

    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise ValueError(f"{ENV}: {item!r} is not key=value")
        if key == "no_c_shim":
            if text not in inductor_fallback_ops:
                raise ValueError(f"{ENV}: no_c_shim={text}: inductor has no C shim of that op")
            del inductor_fallback_ops[text]
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ValueError(f"{ENV}: {key}={text}: the value is not a Python "
                                 "literal") from None
            *path, name = key.split(".")
            target = config
            for part in path:
                target = getattr(target, part, None)
            if target is None or not hasattr(target, name):
                raise ValueError(f"{ENV}: torch._inductor.config has no {key}")
            setattr(target, name, value)


if os.environ.get(ENV):
    try:
        apply(os.environ[ENV])
    except ValueError as error:  # one line, not site's "Error in sitecustomize" and a start-up
        print(error, file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
