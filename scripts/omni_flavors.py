"""Benchmark flavors of the omni specs, registered by importing this module (the trainer
imports ``--experimental.custom_import scripts.omni_flavors`` before it looks the flavor up):

- ``30B-A3B_ep4_rank`` (``qwen3_moe_omni``): 30B-A3B with 32 experts instead of 128, top 8
  as before. It is what one rank of 30B-A3B holds and computes of the experts at EP4: 32
  experts' weights, and on average 8 expert copies of each of its own tokens. On one GPU it
  times that rank's step without the expert exchanges, its skew and the FSDP collectives, so
  that the step's parts that do not grow with tokens can be placed with one GPU (issue 12;
  docs/performance.md). Its router picks among 32 experts, so it is not 30B-A3B's model.
"""

from __future__ import annotations

import dataclasses

from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_omni.models  # noqa: F401  (registers the omni specs)

EP4_RANK = "30B-A3B_ep4_rank"


def register() -> None:
    """Add the benchmark flavors to their specs' flavors (idempotent)."""
    flavors = get_train_spec("qwen3_moe_omni").model_args
    if EP4_RANK not in flavors:
        base = flavors["30B-A3B"]
        flavors[EP4_RANK] = dataclasses.replace(
            base, llm=dataclasses.replace(base.llm, num_experts=base.llm.num_experts // 4))


register()
