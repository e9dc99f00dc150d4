"""Applying a model spec's parallel plan: the ``parallelize_fn`` of every omni train spec.

Order (each step reads the spec's ``OmniParallelPlan``):

1. seed and freeze (``omni.init_seed``, ``omni.freeze``); with non-colocated encoders, this
   rank set's share of the model (``split_model``); then LoRA (``[lora]``,
   ``torchtitan_omni.lora``: adapters become parameters of their modules, everything else
   but ``lora.train_modules`` is frozen);
2. Ulysses runners on the plan's ``sequence_parallel_attention`` modules (sync or async), and
   each encoder's SP mode (its ``sequence_parallel``: "split" over the SP ranks, "balance"
   over every data and SP rank, ``distributed/boundary.py``);
3. expert parallel on the plan's ``experts`` modules (``ep`` mesh, all-to-all dispatcher), or
   the capacity-padded local dispatcher (``parallelism.expert_capacity_factor`` without EP);
4. activation checkpointing of each part's ``ac_units`` (its ``activation_checkpoint``);
5. ``torch.compile`` of the same blocks and of the loss kernel (``[compile]``,
   ``torchtitan_omni.distributed.compile``); blocks that break the graph are compiled before
   step 4, so their checkpoint wraps the compiled pieces (not under per-op selective AC); then
   activation offload of the LLM's blocks (``omni.activation_offload``);
6. FSDP2: experts over the expert mesh (none where that mesh is one rank and every LLM block
   is checkpointed: :func:`experts_outside_fsdp`), then each part's groups (modules sharing
   a parameter, one ``fully_shard`` of a list; the LLM's blocks in groups of
   ``parallelism.llm_blocks_per_fsdp_unit``), units and the part over the part's mesh (its
   ``fsdp_mesh``; with ``fsdp_unit`` "part" the part alone), then the root. Each unit is
   resharded after its forward (``parallelism.fsdp_reshard_after_forward``: "always", or
   "default" except the plan's ``gathered_after_forward`` units) or not ("never"). Every reduction
   is a plain sum (the loss is already divided by the global target count; gloo has no
   AVG/PREMUL_SUM).

An encoder's or decoder's layout keys (``fsdp_mesh``, ``fsdp_unit``, ``sequence_parallel``,
``activation_checkpoint``) come from its ``[parallelism.parts."<part>"]`` table, else from the
global keys (``torchtitan_omni.distributed.part_layouts.part_settings``); the model code stays
layout-free.

The model arrives on the meta device and leaves sharded, still on meta; the trainer then
materializes only the local shards (``to_empty``) and runs the layout-invariant init.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
)
from torch.distributed.tensor import Shard

from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.tools.logging import logger

from torchtitan_omni.distributed.part_layouts import (
    is_llm_part, part_is_one_unit, part_mesh_choice, part_settings,
)
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.distributed.activation_checkpoint import PER_OP_OPTIONS, checkpoint_units
from torchtitan_omni.distributed.activation_offload import offload_activations
from torchtitan_omni.distributed.compile import compile_loss_heads, compile_units
from torchtitan_omni.distributed.boundary import BalanceLedger, install_balanced_encoders
from torchtitan_omni.distributed.encoder_sp import install_split_encoders
from torchtitan_omni.distributed.expert_parallel import apply_expert_parallel
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.rank_sets import RankSetDims
from torchtitan_omni.distributed.split_model import split_model
from torchtitan_omni.modules.moe import GroupedExperts
from torchtitan_omni.distributed.ulysses import kv_replication, make_runner
from torchtitan_omni.lora import apply_lora_config
from torchtitan_omni.platform import is_cpu
from torchtitan_omni.protocols.plan import OmniParallelPlan, PartLayout, name_matches


def matching_modules(
    model: nn.Module, root: str, patterns: tuple[str, ...]
) -> list[tuple[str, nn.Module]]:
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


# ----------------------------------------------------------------- mixed precision
def mixed_precision(job_config: JobConfig) -> MixedPrecisionPolicy:
    """bf16 (``training.mixed_precision_param``) params with fp32 reductions on GPU; fp32 on CPU."""
    if is_cpu():
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
    )


def _fp32_policy(mp: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                output_dtype=mp.param_dtype)


# ----------------------------------------------------------------- Ulysses
def apply_ulysses(model: nn.Module, plan: OmniParallelPlan, dims: OmniParallelDims,
                  async_op: bool, head_chunks: int = 0) -> list[str]:
    """Install Ulysses runners on the plan's attention modules (async: heads pipelined in
    ``head_chunks`` groups, 0: as many as fit); returns their names."""
    modules = matching_modules(model, "", plan.sequence_parallel_attention)
    if not modules:
        raise ValueError(
            "parallelism.ulysses_degree > 1 but the model's plan lists no "
            "sequence_parallel_attention modules (or none matches): this model cannot run "
            "Ulysses sequence parallel"
        )
    group = dims.get_mesh("sp").get_group()
    for name, attn in modules:
        if not all(hasattr(attn, a) for a in ("project", "core", "wo", "runner")):
            raise TypeError(
                f"{name} ({type(attn).__name__}) is listed for sequence parallel but is not a "
                "torchtitan_omni.modules.attention.SelfAttention (project/core/wo/runner)"
            )
        try:
            kv_replication(attn.n_heads, attn.n_kv_heads, dims.sp)
            attn.runner = make_runner(attn, group, async_op, head_chunks)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return [n for n, _ in modules]


# ----------------------------------------------------------------- FSDP
def _expert_shard_placement(local_experts: int, efsdp: int, params: list[nn.Parameter]):
    # Shard experts on dim 0 when each efsdp rank gets whole experts, else on dim 1 (even).
    if local_experts % efsdp == 0:
        return None
    if all(p.shape[1] % efsdp == 0 for p in params):
        return lambda p: Shard(1)
    return None  # uneven dim-0 shards; FSDP pads


def _sum_reductions(model: nn.Module) -> None:
    # The loss is already divided by the global target count, so gradients must be summed over
    # ranks, not averaged; and gloo has no AVG/PREMUL_SUM, so the collectives use plain SUM.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def _prefetch_next_block(block_groups: list[list[nn.Module]]) -> None:
    # Each unit of blocks starts the all-gather of the next one as its own forward begins, so
    # the gather overlaps compute even when the host is not far ahead of the GPU (short
    # encoder blocks). A group's blocks share one unit: its first block stands for it.
    # Backward prefetch is FSDP2's default.
    units = [group[0] for group in block_groups if isinstance(group[0], FSDPModule)]
    for unit, following in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([following])


def _block_groups(model: nn.Module, part: PartLayout,
                  job_config: JobConfig) -> list[list[nn.Module]]:
    """The part's blocks (its checkpointed units) in consecutive groups, one FSDP unit each:
    ``parallelism.llm_blocks_per_fsdp_unit`` blocks in the LLM, one elsewhere."""
    per_unit = job_config.parallelism.llm_blocks_per_fsdp_unit if is_llm_part(part) else 1
    blocks = [m for _, m in matching_modules(model, part.root, part.ac_units)]
    return [blocks[i:i + per_unit] for i in range(0, len(blocks), per_unit)]


def experts_outside_fsdp(dims: OmniParallelDims, job_config: JobConfig) -> bool:
    """Whether expert-parallel experts skip FSDP: when their FSDP mesh (dp_replicate x efsdp)
    is one rank, each expert lives on one rank only, so there is nothing to gather and its
    gradient is complete where it is computed. A one-rank unit would still copy its
    parameters in and out of a gather and a reduce-scatter per layer and pass. Only where every
    LLM block is checkpointed (full, or a per-op selective AC, or every block's): the experts
    then cast their parameters to the compute dtype inside the checkpoint, and autograd keeps
    no cast copy until the backward. Not with CPU offload, which must move them."""
    emesh = dims.expert_mesh()
    ac = job_config.activation_checkpoint
    every_block = ac.mode == "full" or (
        ac.mode == "selective" and str(ac.selective_ac_option) in (*PER_OP_OPTIONS, "1"))
    return (emesh is not None and emesh.size() == 1 and every_block
            and not job_config.training.enable_cpu_offload)


def apply_fsdp(model: nn.Module, plan: OmniParallelPlan, dims: OmniParallelDims,
               job_config: JobConfig, expert_names: Sequence[str] = ()) -> dict[str, str]:
    """FSDP2 per part (see the module docstring); returns each part's mesh choice."""
    default_mesh = dims.part_mesh("fsdp")
    if default_mesh is None:
        return {}
    mp = mixed_precision(job_config)
    reshard_policy = job_config.parallelism.fsdp_reshard_after_forward
    # "default": every unit resharded after its forward except those the plan leaves gathered
    # (the head: the backward's first unit); "always" and "never" apply to every unit
    kept_gathered = {id(m) for part in plan.parts
                     for _, m in matching_modules(model, part.root, part.gathered_after_forward)
                     } if reshard_policy == "default" else set()
    fp32 = matching_modules(model, "", plan.fp32_modules)
    # training.enable_cpu_offload: sharded parameters, gradients and optimizer state live in
    # host memory; each unit's parameters come to the GPU for its forward and backward only
    offload = CPUOffloadPolicy() if job_config.training.enable_cpu_offload else OffloadPolicy()
    # experts left out of FSDP: every unit that encloses them must ignore their parameters
    ignored: set[nn.Parameter] = set()

    def shard(module: nn.Module | list[nn.Module], mesh, **kwargs) -> None:
        group = module if isinstance(module, list) else [module]
        if any(isinstance(m, FSDPModule) for m in group):
            return  # already a unit (e.g. an fp32 module that is also listed as a unit)
        policy = _fp32_policy(mp) if any(m is f for m in group for _, f in fp32) else mp
        reshard = reshard_policy != "never" and not any(id(m) in kept_gathered for m in group)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard,
                    offload_policy=offload, ignored_params=ignored or None, **kwargs)

    # parallelize_omni marks them (GroupedExperts.outside_fsdp) before compiling
    all_experts = [cast(GroupedExperts, model.get_submodule(name)) for name in expert_names]
    if all_experts and all(experts.outside_fsdp for experts in all_experts):
        for experts in all_experts:
            experts.compute_dtype = mp.param_dtype
            ignored.update(experts.parameters())
        logger.info(f"Experts outside FSDP (EP{dims.ep} over every data and SP rank: each "
                    f"expert on one rank), computing in {mp.param_dtype}")
    elif all_experts:
        emesh = dims.expert_mesh()
        efsdp = dims.get_mesh("efsdp").size()
        for experts in all_experts:
            params = list(experts.parameters(recurse=False))
            local = params[0].shape[0] // dims.ep
            shard(experts, emesh, shard_placement_fn=_expert_shard_placement(local, efsdp, params))

    choices = {}
    for part in plan.parts:
        root = model.get_submodule(part.root)
        choice = part_mesh_choice(part, root, job_config)
        mesh = dims.part_mesh(choice)
        prefix = part.root + "."
        # fp32 modules get their own unit (their own mixed-precision policy) first.
        for name, module in fp32:
            if name == part.root or name.startswith(prefix):
                shard(module, mesh)
        one_unit = part_is_one_unit(part, job_config)
        block_groups = _block_groups(model, part, job_config)
        if not one_unit:
            for patterns in part.fsdp_groups:
                members = [m for _, m in matching_modules(model, part.root, patterns)]
                if members:
                    shard(members, mesh)
            if any(len(group) > 1 for group in block_groups):
                for group in block_groups:
                    shard(group, mesh)
                logger.info(f"{part.root}: blocks in {len(block_groups)} FSDP units of up to "
                            f"{len(block_groups[0])} (parallelism.llm_blocks_per_fsdp_unit)")
            for _, module in matching_modules(model, part.root, part.fsdp_units):
                shard(module, mesh)
        shard(root, mesh)
        _prefetch_next_block(block_groups)
        choices[part.root] = f"{choice}, one unit" if one_unit else choice
    for _, module in fp32:
        shard(module, default_mesh)  # fp32 modules outside every part
    fully_shard(model, mesh=default_mesh, mp_policy=mp, reshard_after_forward=False,
                offload_policy=offload, ignored_params=ignored or None)
    _sum_reductions(model)
    return choices


# ----------------------------------------------------------------- activation checkpointing
def apply_activation_checkpointing(
    model: nn.Module, plan: OmniParallelPlan, job_config: JobConfig
) -> dict[str, int]:
    """Checkpoint each part's ``ac_units``: LLM by ``[activation_checkpoint]``, encoders and
    decoders by their ``activation_checkpoint`` (``parallelism.parts``, else
    ``omni.encoder_activation_checkpoint``); returns units wrapped per part."""
    ac = job_config.activation_checkpoint
    done = {}
    for part in plan.parts:
        units = [m for _, m in matching_modules(model, part.root, part.ac_units)]
        if is_llm_part(part):
            n = checkpoint_units(
                units, ac.mode, str(ac.selective_ac_option),
                preserve_rng_state=ac.preserve_rng_state,
                keep_exchanges=job_config.parallelism.expert_ac_keep_exchanges)
        else:
            mode = part_settings(job_config, part.root).activation_checkpoint
            min_rows = job_config.omni.encoder_checkpoint_min_tokens
            n = (checkpoint_units(units, "selective", mode, min_rows=min_rows)
                 if mode in PER_OP_OPTIONS else checkpoint_units(units, mode, min_rows=min_rows))
        if n:
            done[part.root] = n
    return done


# ----------------------------------------------------------------- torch.compile
def _per_op_ac(plan: OmniParallelPlan, job_config: JobConfig) -> bool:
    """Whether some part uses a per-op selective activation checkpointing."""
    ac = job_config.activation_checkpoint
    return ((ac.mode == "selective" and str(ac.selective_ac_option) in PER_OP_OPTIONS)
            or any(part_settings(job_config, p.root).activation_checkpoint in PER_OP_OPTIONS
                   for p in plan.parts if not is_llm_part(p)))


def apply_compile(model: nn.Module, plan: OmniParallelPlan, job_config: JobConfig,
                  graph_breaks: bool | None = None) -> dict[str, int]:
    """Compile every part's blocks (``compile.components`` has "model") and the text head's
    loss kernel ("loss"); returns what was compiled per part. ``graph_breaks``: only the blocks
    that break the graph (True: call before activation checkpointing), only the others and the
    loss (False: after it), or everything (None)."""
    cfg = job_config.compile
    if not cfg.enable:
        return {}
    done = {}
    if "model" in cfg.components:
        for part in plan.parts:
            units = [m for _, m in matching_modules(model, part.root, part.ac_units)]
            n = compile_units(units, cfg.backend, graph_breaks) if units else 0
            if n:
                done[part.root] = n
    if "loss" in cfg.components and graph_breaks is not True:
        done["loss heads"] = compile_loss_heads(model, cfg.backend)
    return done


# ----------------------------------------------------------------- encoders' SP modes
def encoder_modes(model: nn.Module, job_config: JobConfig) -> dict[str, str]:
    """Each encoder's ``sequence_parallel`` mode: its ``parallelism.parts`` table's, else
    ``parallelism.encoder_sequence_parallel``."""
    encoders = getattr(model, "encoders", None) or {}
    return {name: part_settings(job_config, f"encoders.{name}").sequence_parallel
            for name in encoders}


def apply_encoder_modes(model: nn.Module, dims: OmniParallelDims,
                        job_config: JobConfig) -> dict[str, list[str]]:
    """Install each encoder's SP mode: "split" over the SP ranks (under Ulysses), "balance"
    over every data and SP rank (when there are several); "replicate" installs nothing.
    Encoders of different modes run in one step: each issues its own collectives, in the
    model's encoder order on every rank. Returns the encoders per installed mode."""
    modes = encoder_modes(model, job_config)
    encoders = cast(nn.ModuleDict, getattr(model, "encoders", {}))
    chosen = {mode: {n: encoders[n] for n, m in modes.items() if m == mode}
              for mode in ("split", "balance")}
    installed = {}
    if dims.sp_enabled and chosen["split"]:
        group = dims.get_mesh("sp").get_group()
        installed["split"] = install_split_encoders(chosen["split"], group)
        logger.info(f"Encoders split media items over SP ranks: {', '.join(installed['split'])}")
    encoder_ranks = dims.dp_replicate * dims.dp_shard * dims.sp
    if chosen["balance"] and encoder_ranks > 1:
        # every rank encodes (pp = tp = 1): the balancing group is the flattened loss mesh
        sp_group = dims.get_mesh("sp").get_group() if dims.sp_enabled else None
        # one ledger for the model's balanced encoders: each pass balances on top of the
        # earlier passes of the same forward
        ledger = BalanceLedger()
        model.register_forward_pre_hook(ledger.reset)
        installed["balance"] = install_balanced_encoders(
            chosen["balance"], dims.get_mesh("loss").get_group(), sp_group, ledger)
        logger.info(f"Encoders balance media items over {encoder_ranks} ranks: "
                    f"{', '.join(installed['balance'])}")
    return installed


# ----------------------------------------------------------------- expert dispatch
def capacity_tokens(job_config: JobConfig, sp: int) -> int:
    """Tokens of one rank's micro-batch that expert capacity is sized for: the most a batch
    holds (``BatchPlan.max_tokens``) over the Ulysses degree. A config value, so every rank of
    an expert-parallel group agrees on the slot sizes without communicating."""
    t, d = job_config.training, job_config.data
    plan = BatchPlan(seq_len=t.seq_len, rows=t.local_batch_size, token_budget=d.token_budget,
                     packing=d.packing, fixed_length=d.pad_to_fixed_length)
    return -(-plan.max_tokens() // sp)


def apply_expert_dispatch(model: nn.Module, plan: OmniParallelPlan, dims: OmniParallelDims,
                          job_config: JobConfig) -> list[str]:
    """Expert parallel (``ep`` > 1) and/or the capacity-padded dispatcher on the plan's experts;
    returns the experts modules sharded over ``ep`` (empty without EP)."""
    factor = job_config.parallelism.expert_capacity_factor
    if dims.ep == 1 and factor == 0:
        return []
    names = [n for n, _ in matching_modules(model, "", plan.experts)]
    if not names:
        what = ("parallelism.expert_parallel_degree > 1" if dims.ep > 1
                else "parallelism.expert_capacity_factor > 0")
        raise ValueError(f"{what} but the model's plan lists no experts modules (or none matches)")
    mesh = dims.get_mesh("ep") if dims.ep > 1 else None
    exchange = job_config.parallelism.expert_exchange
    chunks = job_config.parallelism.expert_dispatch_chunks
    unit = job_config.parallelism.expert_dispatch
    sized = factor > 0 or exchange == "nvshmem" or unit == "gather"
    tokens = capacity_tokens(job_config, dims.sp) if sized else None
    apply_expert_parallel(model, names, mesh, factor, tokens, chunks, unit, exchange)
    dispatch = (f"capacity factor {factor} ({tokens} tokens per rank and micro-batch)"
                if factor > 0 else "exact")
    if unit == "tokens" and dims.ep > 1:
        dispatch += ", each token sent once per rank"
    if unit == "gather" and dims.ep > 1:
        dispatch += (f", the group's tokens gathered and the results reduce-scattered ({tokens} "
                     "tokens per rank and micro-batch)")
    if exchange == "nvshmem" and dims.ep > 1:
        dispatch += f", NVSHMEM exchange with device split sizes (buffers for {tokens} tokens)"
    if chunks > 1 and dims.ep > 1:
        dispatch += f", exchange in {chunks} overlapped chunks"
    logger.info(f"MoE dispatch on {len(names)} experts modules: EP{dims.ep}, {dispatch}")
    return names if dims.ep > 1 else []


# ----------------------------------------------------------------- entry point
def parallelize_omni(
    model: nn.Module, parallel_dims: OmniParallelDims, job_config: JobConfig
) -> nn.Module:
    """``TrainSpec.parallelize_fn`` of every omni spec: apply the model's declared plan."""
    plan: OmniParallelPlan = model.parallel_plan
    dims = parallel_dims
    p = job_config.parallelism
    model.init_seed = job_config.omni.init_seed
    frozen = model.freeze(list(job_config.omni.freeze))
    if frozen:
        logger.info(f"Frozen modules: {', '.join(frozen)}")
    if isinstance(dims, RankSetDims):
        # non-colocated encoders: this rank set's share of the model, after freezing (the
        # encoder ranks must see omni.freeze's encoders), before anything is laid out
        model = split_model(model, dims.rank_sets)
        plan = cast(OmniParallelPlan, model.parallel_plan)
        held = ("the encoders" if dims.on_encoders
                else "the LLM and decoders (the encoders: RemoteEncoder stubs)")
        logger.info(f"Non-colocated encoders: this rank holds {held}")
    if job_config.lora.enable:
        # first: Ulysses, EP, AC, compile and FSDP then treat adapters as module parameters
        logger.info(apply_lora_config(model, job_config.lora).describe())

    if dims.sp_enabled:
        names = apply_ulysses(model, plan, dims, p.ulysses_async, p.ulysses_async_head_chunks)
        runner = model.get_submodule(names[0]).runner
        logger.info(f"Ulysses SP{dims.sp} ({runner!r}) on {len(names)} attention modules")
    apply_encoder_modes(model, dims, job_config)

    expert_names = apply_expert_dispatch(model, plan, dims, job_config)
    if expert_names and experts_outside_fsdp(dims, job_config):
        # before compiling: a block whose experts skip FSDP compiles as one graph
        for name in expert_names:
            cast(GroupedExperts, model.get_submodule(name)).outside_fsdp = True

    # Blocks that break the graph are compiled inside their activation checkpoint, the others
    # around it (torchtitan_omni.distributed.compile). Per-op selective AC cannot run compiled
    # code inside its checkpoint: there, such blocks are left to dynamo around the checkpoint,
    # which runs them eagerly.
    inside = not _per_op_ac(plan, job_config)
    pieces = apply_compile(model, plan, job_config, graph_breaks=True) if inside else {}
    if pieces:
        logger.info("torch.compile, with graph breaks: "
                    + ", ".join(f"{k}: {v}" for k, v in pieces.items()))

    ac = apply_activation_checkpointing(model, plan, job_config)
    min_rows = job_config.omni.encoder_checkpoint_min_tokens
    encoders_checked = any(not is_llm_part(p) for p in plan.parts if p.root in ac)
    if ac:
        exempt = (f" (encoder and decoder calls of under {min_rows:,} rows run unchecked)"
                  if min_rows and encoders_checked else "")
        logger.info("Activation checkpointing: "
                    + ", ".join(f"{k}: {v} units" for k, v in ac.items()) + exempt)
    if min_rows and not encoders_checked:
        logger.warning(f"omni.encoder_checkpoint_min_tokens = {min_rows} has nothing to exempt: "
                       "no encoder or decoder is activation-checkpointed")

    compiled = apply_compile(model, plan, job_config, graph_breaks=False if inside else None)
    if compiled:
        logger.info("torch.compile: " + ", ".join(f"{k}: {v}" for k, v in compiled.items()))

    if job_config.omni.activation_offload:
        # outside the compiled region: the hooks see what the compiled block saves
        blocks = [m for _, m in matching_modules(model, "llm", plan.part("llm").ac_units)]
        logger.info(f"Activation offload to host memory: {offload_activations(blocks)} LLM blocks")

    choices = apply_fsdp(model, plan, dims, job_config, expert_names)
    if choices:
        logger.info("FSDP2 meshes: " + ", ".join(f"{k}: {v}" for k, v in choices.items()))
        # what the default one-unit encoders add to the peak: their whole parameters, at once
        whole = {part.root: sum(t.numel() for t in model.get_submodule(part.root).parameters())
                 for part in plan.parts
                 if part.root in choices and part_is_one_unit(part, job_config)}
        if whole:
            logger.info("Encoders gathered whole while they run (encoder_fsdp_unit \"part\"; "
                        "\"block\" gathers one block at a time): "
                        + ", ".join(f"{k}: {n / 1e6:,.1f}M parameters" for k, n in whole.items()))
    return model
