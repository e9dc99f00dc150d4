"""Float8 training of the foundation through TorchTitan's converters (``[model] converters =
["quantize.linear.float8"]``, or its short name ``"float8"``; torchao).

TorchTitan's float8 converter swaps every ``nn.Linear`` whose dimensions are multiples of 16,
except those whose name contains one of ``quantize.linear.float8.filter_fqns``. In an omni
model that would also take the text head (a ``LinearHead`` computing its loss chunk by chunk),
the encoders' and decoders' projections, the frozen VQ and a MoE layer's router:
:func:`prepare_float8` adds their names to the filter, so float8 covers the foundation's
blocks' projections and feed-forwards, where the FLOPs are. ``omni.float8_encoders`` takes the
encoders' linears in too (the vision and audio towers' blocks and projectors: the media share
of the FLOPs on rows rich in media). The converter itself is
TorchTitan's, applied by its ``Trainer`` before parallelization; TorchTitan 0.2.2 looks
converters up by their registry key, so :func:`prepare_float8` writes the short name as that
key (and keeps one entry) before the ``Trainer`` reads the list.
"""

from __future__ import annotations

from torchtitan.config import JobConfig

#: TorchTitan 0.2.2's registry key of its float8 linear converter
FLOAT8_CONVERTER = "quantize.linear.float8"
#: the short name users write (older TorchTitan's): the same converter
FLOAT8_SHORT_NAME = "float8"
FLOAT8_NAMES = (FLOAT8_CONVERTER, FLOAT8_SHORT_NAME)

#: name fragments float8 leaves in bf16: the text head, every encoder and every decoder, and the
#: MoE routers (a top-k choice flips on rounding; TorchTitan's MoE configs leave theirs out too)
OMNI_FLOAT8_FILTERS = ("llm.output", "encoders.", "decoders.", "moe.gate")
#: the fragment ``omni.float8_encoders`` drops from them: the encoders' linears go float8 too
ENCODERS_FILTER = "encoders."


def uses_float8(converters: list[str]) -> bool:
    """Whether ``model.converters`` asks for float8 linears (by either name)."""
    return any(name in FLOAT8_NAMES for name in converters)


def float8_encoders(job_config: JobConfig) -> bool:
    """Whether the job puts the encoders' linears in float8 too (``omni.float8_encoders``)."""
    return bool(getattr(getattr(job_config, "omni", None), "float8_encoders", False))


def prepare_float8(job_config: JobConfig) -> list[str]:
    """Before TorchTitan's ``Trainer`` builds its converters: name float8 by TorchTitan's
    registry key (once) and extend ``quantize.linear.float8.filter_fqns`` with
    :data:`OMNI_FLOAT8_FILTERS` (without :data:`ENCODERS_FILTER` under
    ``omni.float8_encoders``); returns the filters in effect (empty without float8)."""
    converters = job_config.model.converters
    if not uses_float8(converters):
        return []
    rest = [name for name in converters if name not in FLOAT8_NAMES]
    converters[:] = [FLOAT8_CONVERTER, *rest]
    omni = [f for f in OMNI_FLOAT8_FILTERS
            if not (f == ENCODERS_FILTER and float8_encoders(job_config))]
    filters = job_config.quantize.linear.float8.filter_fqns
    filters.extend(f for f in omni if f not in filters)
    return list(filters)
