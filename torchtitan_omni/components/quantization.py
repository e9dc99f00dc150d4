"""Float8 training of the foundation through TorchTitan's converters (``[model] converters =
["float8"]``, torchao).

TorchTitan's float8 converter swaps every ``nn.Linear`` whose dimensions are multiples of 16,
except those whose name contains one of ``quantize.linear.float8.filter_fqns``. In an omni
model that would also take the text head (a ``LinearHead`` computing its loss chunk by chunk),
the encoders' and decoders' projections and the frozen VQ: :func:`add_omni_float8_filters`
adds their names to the filter, so float8 covers the foundation's blocks, where the FLOPs
are. The converter itself is TorchTitan's, applied by its ``Trainer`` before parallelization.
"""

from __future__ import annotations

from torchtitan.config import JobConfig

#: name fragments float8 leaves in bf16: the text head, every encoder and every decoder
OMNI_FLOAT8_FILTERS = ("llm.output", "encoders.", "decoders.")


def add_omni_float8_filters(job_config: JobConfig) -> list[str]:
    """Extend ``quantize.linear.float8.filter_fqns`` with :data:`OMNI_FLOAT8_FILTERS` when the
    job converts to float8; returns the filters in effect (empty without float8)."""
    if "float8" not in job_config.model.converters:
        return []
    filters = job_config.quantize.linear.float8.filter_fqns
    filters.extend(f for f in OMNI_FLOAT8_FILTERS if f not in filters)
    return list(filters)
