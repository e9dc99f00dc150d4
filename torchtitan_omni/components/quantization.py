"""Float8 training of the foundation through TorchTitan's converters (``[model] converters =
["quantize.linear.float8"]``, or its short name ``"float8"``; torchao).

TorchTitan's float8 converter swaps every ``nn.Linear`` whose dimensions are multiples of 16,
except those whose name contains one of ``quantize.linear.float8.filter_fqns``. In an omni
model that would also take the text head (a ``LinearHead`` computing its loss chunk by chunk),
the encoders' and decoders' projections, the frozen VQ and a MoE layer's router:
:func:`prepare_float8` adds their names to the filter, so float8 covers the foundation's
blocks' projections and feed-forwards, where the FLOPs are. The converter itself is
TorchTitan's, applied by its ``Trainer`` before parallelization; TorchTitan 0.2.2 looks
converters up by their registry key, so :func:`prepare_float8` writes the short name as that
key (and keeps one entry) before the ``Trainer`` reads the list.

``omni.float8_encoders`` takes the encoders' linears in too (the vision and audio towers'
blocks and projectors: the media share of the FLOPs on rows rich in media), through
:class:`Float8EncodersConverter`, which :func:`prepare_float8` lists after TorchTitan's.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import register_model_converter

#: TorchTitan 0.2.2's registry key of its float8 linear converter
FLOAT8_CONVERTER = "quantize.linear.float8"
#: the short name users write (older TorchTitan's): the same converter
FLOAT8_SHORT_NAME = "float8"
FLOAT8_NAMES = (FLOAT8_CONVERTER, FLOAT8_SHORT_NAME)

#: name fragments float8 leaves in bf16: the text head, every encoder and every decoder, and the
#: MoE routers (a top-k choice flips on rounding; TorchTitan's MoE configs leave theirs out too)
OMNI_FLOAT8_FILTERS = ("llm.output", "encoders.", "decoders.", "moe.gate")
#: the encoders' name fragment: TorchTitan's converter always leaves them out;
#: :class:`Float8EncodersConverter` takes them under ``omni.float8_encoders``
ENCODERS_FILTER = "encoders."
#: the registry key of :class:`Float8EncodersConverter` (listed by :func:`prepare_float8`, not
#: by users)
FLOAT8_ENCODERS_CONVERTER = "omni.float8_encoders"


def uses_float8(converters: list[str]) -> bool:
    """Whether ``model.converters`` asks for float8 linears (by either name)."""
    return any(name in FLOAT8_NAMES for name in converters)


def float8_encoders(job_config: JobConfig) -> bool:
    """Whether the job puts the encoders' linears in float8 too (``omni.float8_encoders``)."""
    return bool(getattr(getattr(job_config, "omni", None), "float8_encoders", False))


def prepare_float8(job_config: JobConfig) -> list[str]:
    """Before TorchTitan's ``Trainer`` builds its converters: name float8 by TorchTitan's
    registry key (once), extend ``quantize.linear.float8.filter_fqns`` with
    :data:`OMNI_FLOAT8_FILTERS` and, under ``omni.float8_encoders``, list
    :data:`FLOAT8_ENCODERS_CONVERTER` after it; returns the names left in bf16 (empty without
    float8)."""
    converters = job_config.model.converters
    if not uses_float8(converters):
        return []
    encoders = float8_encoders(job_config)
    rest = [name for name in converters
            if name not in FLOAT8_NAMES and name != FLOAT8_ENCODERS_CONVERTER]
    converters[:] = [FLOAT8_CONVERTER, *([FLOAT8_ENCODERS_CONVERTER] if encoders else []), *rest]
    filters = job_config.quantize.linear.float8.filter_fqns
    filters.extend(f for f in OMNI_FLOAT8_FILTERS if f not in filters)
    return [f for f in filters if not (encoders and f == ENCODERS_FILTER)]


class Float8EncodersConverter:
    """The encoders' linears in float8 (``omni.float8_encoders``): TorchTitan's float8
    converter's tensorwise recipe, its rule (dimensions divisible by 16) and its name filters,
    applied under ``encoders.``, with two differences.

    - Each matmul's inner dimension is padded to a multiple of 16 (torchao's
      ``pad_inner_dim``). An encoder's row count follows the batch's media (11,048 patches, say),
      and the weight gradient's matmul runs over rows, where ``torch._scaled_mm`` takes only
      multiples of 16. The foundation's rows (the sequence length) need no padding.
    - The weights are gathered in bf16, not float8: the encoders may be replicated rather than
      sharded, and they hold a small share of the parameters.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        float8 = job_config.quantize.linear.float8
        self.emulate = float8.emulate
        self.filters = [f for f in float8.filter_fqns if f != ENCODERS_FILTER]

    def takes(self, module: nn.Module, fqn: str) -> bool:
        """Whether the linear ``module`` at ``fqn`` goes float8."""
        return fqn.startswith(ENCODERS_FILTER) and module_filter_fn(module, fqn, self.filters)

    def convert(self, model: nn.Module) -> None:
        # torchao is optional: imported only when float8 is asked for (checked at start-up)
        from torchao.float8 import (  # noqa: PLC0415
            Float8LinearConfig, convert_to_float8_training,
        )

        config = Float8LinearConfig(pad_inner_dim=True, emulate=self.emulate)
        convert_to_float8_training(model, config=config, module_filter_fn=self.takes)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing: the weights' scales are computed as they are cast (no float8 gather)."""


register_model_converter(Float8EncodersConverter, FLOAT8_ENCODERS_CONVERTER)
