"""Inductor settings for a benchmark's A/B, from the environment: no code change in the tree.

``scripts/gpu_benchmarks.sh`` puts this folder first on ``PYTHONPATH`` when ``INDUCTOR_KNOBS``
is set, and Python imports ``sitecustomize`` as it starts, in every process of the job (the
ranks and inductor's compile workers alike)::

    INDUCTOR_KNOBS="combo_kernels=True,cpp_wrapper=True,no_c_shim=aten._grouped_mm.default"

Each ``key=value`` sets ``torch._inductor.config.<key>`` (a dotted key reaches a sub-config,
e.g. ``triton.cudagraphs``) to the Python literal ``value``. ``no_c_shim=<op>`` (repeatable)
makes inductor's C++ wrapper call that aten op through the dispatcher instead of its C shim
(an op inductor's ``inductor_fallback_ops`` lists: torch 2.13 lists ``aten._grouped_mm.default``;
torch 2.11 does not, so there the knob is refused, forty-third session). ``fallback=<op>``
(repeatable) replaces inductor's lowering of that aten op with a plain call of the op: where
the C++ wrapper has no C shim of it (torch 2.11's grouped GEMM), the call then goes through the
dispatcher instead of naming a shim that does not exist, e.g.::

    INDUCTOR_KNOBS="cpp_wrapper=True,fallback=aten._grouped_mm.default"

A key inductor does not have, a ``no_c_shim`` op it does not list, a ``fallback`` op it has
no lowering of, or an item that is not ``key=value``, stops the process with one line naming
it.
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
        if key == "fallback":
            _fall_back(text)
        elif key == "no_c_shim":
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


def _fall_back(name: str) -> None:
    """Make inductor call the aten op ``name`` (``namespace.op.overload``) as it is, instead of
    lowering it (its choice of kernels, which in the C++ wrapper names the op's C shim)."""
    import torch
    from torch._inductor import lowering

    namespace, _, rest = name.partition(".")
    packet_name, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, namespace, None), packet_name, None), overload or
                 "default", None)
    if op is None or op not in lowering.lowerings:
        raise ValueError(f"{ENV}: fallback={name}: inductor has no lowering of that op")
    lowering.add_needs_realized_inputs(op)
    lowering.lowerings[op] = lowering.fallback_handler(op)
    # the compile caches do not key on the lowerings: a graph cached without the fallback
    # would come back unchanged
    import torch._functorch.config as functorch_config
    import torch._inductor.config as config

    config.fx_graph_cache = config.fx_graph_remote_cache = False
    functorch_config.enable_autograd_cache = False


if os.environ.get(ENV):
    try:
        apply(os.environ[ENV])
    except ValueError as error:  # one line, not site's "Error in sitecustomize" and a start-up
        print(error, file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
