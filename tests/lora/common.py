"""Helpers of the LoRA tests: adapters with non-zero ``B`` (so every adapter gets a gradient),
and LoRA-adapted copies of the parity tests' tiny omni models."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan_omni.modules import init
from torchtitan_omni.modules.lora import adapter_names

#: the LLM's attention and feed-forward (or experts), and the tiny vision encoder's attention
TARGETS = ["llm.layers.*.attention.*", "llm.layers.*.feed_forward.*|llm.layers.*.moe.experts",
           "encoders.vision.attn.w?"]


def lora_overrides(**extra) -> dict:
    """``job_config`` overrides (``tests.distributed.common.job_config``) turning LoRA on."""
    return {"lora__enable": True, "lora__rank": 4, "lora__alpha": 8.0,
            "lora__target_modules": list(TARGETS), **extra}


@torch.no_grad()
def perturb_adapters(model: nn.Module, seed: int = 7) -> int:
    """Draw every adapter ``B`` (zero at init) layout-invariantly, so ``A`` gets gradients too;
    returns how many tensors were drawn."""
    names = {n for n in adapter_names(model) if n.endswith("lora_b")}
    with init.init_context(model, seed=seed):
        for name, p in model.named_parameters():
            if name in names:
                init.normal_(p, std=0.05)
    return len(names)


def lora_reference(spec, cfg, seed: int = 0) -> nn.Module:
    """The unsharded reference of ``tests.distributed.common``, frozen and adapted as
    ``parallelize_omni`` does, then initialized."""
    from tests.distributed import common as C
    from torchtitan_omni.lora import apply_lora_config

    with torch.device("cpu"):
        model = C.build_model(spec)
    model.freeze(list(cfg.omni.freeze))
    apply_lora_config(model, cfg.lora)
    model.init_seed = seed
    with torch.no_grad():
        model.init_weights()
    return model
