"""Applying a model spec's parallel plan: the ``parallelize_fn`` of every omni train spec.

Order (each step reads the spec's ``OmniParallelPlan``): seed and freeze, FSDP2 per part.
The model arrives on the meta device and leaves sharded, still on meta; the trainer then
materializes only the local shards (``to_empty``) and runs the layout-invariant init.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.tools.logging import logger

from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.platform import is_cpu
from torchtitan_omni.protocols.plan import OmniParallelPlan


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted segment: ``"layers.*"`` matches ``layers.3``, not ``layers.3.mlp``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def matching_modules(model: nn.Module, root: str, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Sub-modules of ``root`` whose relative names match any pattern, in model order."""
    prefix = f"{root}." if root else ""
    out = []
    for name, module in model.named_modules():
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        if any(name_matches(rel, pat) for pat in patterns):
            out.append((name, module))
    return out


def mixed_precision(job_config: JobConfig) -> MixedPrecisionPolicy:
    """bf16 (``training.mixed_precision_param``) params with fp32 reductions on GPU; fp32 on CPU."""
    if is_cpu():
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
    )


def _use_sum_reductions(model: nn.Module) -> None:
    # The loss is already divided by the global token count, so gradients must be summed over
    # ranks, not averaged; and gloo has no AVG/PREMUL_SUM, so the collectives use plain SUM.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model: nn.Module, plan: OmniParallelPlan, dims: OmniParallelDims, job_config: JobConfig) -> None:
    """FSDP2 over each part's mesh: its units first, then the part, then the whole model."""
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled):
        return
    mp = mixed_precision(job_config)
    policy = job_config.parallelism.fsdp_reshard_after_forward
    reshard = policy != "never"
    default_mesh = dims.get_mesh(["dp_replicate", "fsdp"]) if dims.dp_replicate_enabled else dims.get_mesh("fsdp")
    for part in plan.parts:
        for _, module in matching_modules(model, part.root, part.fsdp_units):
            fully_shard(module, mesh=default_mesh, mp_policy=mp, reshard_after_forward=reshard)
        part_module = model.get_submodule(part.root)
        fully_shard(part_module, mesh=default_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=default_mesh, mp_policy=mp, reshard_after_forward=False)
    _use_sum_reductions(model)
    logger.info(f"Applied FSDP2 over mesh {default_mesh.mesh_dim_names}")


def parallelize_omni(model: nn.Module, parallel_dims: OmniParallelDims, job_config: JobConfig) -> nn.Module:
    """``TrainSpec.parallelize_fn`` of every omni spec: apply the model's declared plan."""
    model.init_seed = job_config.omni.init_seed
    frozen = model.freeze(list(job_config.omni.freeze))
    if frozen:
        logger.info(f"Frozen modules: {', '.join(frozen)}")
    apply_fsdp(model, model.parallel_plan, parallel_dims, job_config)
    return model
