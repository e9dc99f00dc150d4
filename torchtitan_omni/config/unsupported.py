"""Which of TorchTitan 0.2.2's ``JobConfig`` keys the omni trainer honours: one table.

Every key of TorchTitan's ``JobConfig`` has a row in :data:`KEYS`: its status and why.

- ``honoured``: the omni trainer does what TorchTitan documents, often through the parts of
  TorchTitan it inherits (``Trainer.__init__`` and ``train``, the checkpoint manager, the
  metrics processor, the optimizer and LR-scheduler builders);
- ``no-op``: nothing to honour (a description; a switch whose feature is off either way);
- ``checked``: honoured, and the value is checked before launch (``config/values.py``; a
  ``when_set`` check runs only on a value other than the default);
- ``refused``: not provided; any value other than the default is refused with the reason, so
  nothing a user passes is silently ignored.

``validate_job_config`` runs :func:`refuse_unsupported`, then :func:`check_values` once the
parallel degrees are known. ``tests/test_unsupported_keys.py`` fails when TorchTitan has a key
without a row here (a new TorchTitan version must be classified key by key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce
from typing import Any

from torchtitan.config import JobConfig

from torchtitan_omni.config import values as V
from torchtitan_omni.errors import ConfigError

HONOURED, NO_OP, CHECKED, REFUSED = "honoured", "no-op", "checked", "refused"


@dataclass(frozen=True)
class Rule:
    """How the omni trainer treats one key."""

    status: str
    why: str
    check: V.Check | None = None
    when_set: bool = False  # the check runs only on a non-default value
    also_default: tuple = ()  # values that mean the same as the default (e.g. "" and None)


def honoured(why: str) -> Rule:
    """A key the omni trainer honours; ``why`` says where."""
    return Rule(HONOURED, why)


def no_op(why: str) -> Rule:
    """A key with nothing to honour."""
    return Rule(NO_OP, why)


def refused(why: str, *also_default) -> Rule:
    """A key whose non-default values are refused with ``why``."""
    return Rule(REFUSED, why, also_default=also_default)


def checked(why: str, check: V.Check, when_set: bool = False) -> Rule:
    """An honoured key whose value ``check`` vets before launch."""
    return Rule(CHECKED, why, check, when_set)


# Shared reasons.
_TRAINER = "TorchTitan's Trainer, which OmniTrainer inherits"
_METRICS = "TorchTitan's metrics processor, which OmniMetricsProcessor extends"
_CKPT = "TorchTitan's checkpoint manager, which OmniCheckpointManager extends"
_PROFILER = "TorchTitan's profiler around the inherited training loop"
_LOADER = "passed to the StatefulDataLoader (torchtitan_omni.data.loader)"
_SCHEDULE = "TorchTitan's build_lr_schedulers"
_COMM = "TorchTitan's init_distributed (NCCL flight recorder)"
_DETERMINISM = "TorchTitan's set_determinism (weights are drawn from omni.init_seed)"
_TP = "tensor parallel is not provided; use FSDP, ulysses_degree and expert_parallel_degree"
_PP = "pipeline parallel is not provided (world = dp_replicate x dp_shard x ulysses_degree)"
_CP = "context parallel is not provided; use parallelism.ulysses_degree"
_AC_ARGS = "not passed to torch.utils.checkpoint by torchtitan-omni's activation checkpointing"
_BUDGET = "only read by activation_checkpoint.mode 'memory_budget', which is not supported"
_FLOAT8 = ("TorchTitan's float8 converter; only together with model.converters = "
           "['quantize.linear.float8'] (or 'float8')")
_MX = "MX formats are not supported; model.converters takes only float8"
_FT = "TorchFT fault tolerance is not integrated; resume from checkpoints (checkpoint.enable)"
_VALIDATION = (
    "read by the omni validator (torchtitan_omni.eval.validator) when validation.enable; "
    "values checked with validation.enable"
)
_ESTIMATION = ("memory estimation is not run by the omni trainer; "
               "a short run logs the peak memory per step")

KEYS: dict[str, Rule] = {
    # ------------------------------------------------------------ [job]
    "job.config_file": honoured("read by the config parser (torchtitan_omni.config.manager)"),
    "job.dump_folder": honoured("root of checkpoints, TensorBoard logs and traces"),
    "job.description": no_op("logged at start-up only"),
    "job.print_config": honoured(f"{_TRAINER} (JobConfig.maybe_log)"),
    "job.save_config_file": honoured(f"{_TRAINER} (JobConfig.maybe_log)"),
    "job.custom_config_module": honoured("merged by the config parser over the omni sections"),
    # ------------------------------------------------------------ [profiling]
    "profiling.enable_profiling": checked(
        f"{_PROFILER}; needs a GPU and profile_freq >= profiler_warmup + profiler_active",
        V.profiling, when_set=True),
    "profiling.save_traces_folder": honoured(_PROFILER),
    "profiling.profile_freq": honoured(_PROFILER),
    "profiling.profiler_active": honoured(_PROFILER),
    "profiling.profiler_warmup": honoured(_PROFILER),
    "profiling.enable_memory_snapshot": checked(
        f"{_PROFILER}; CUDA only", V.memory_snapshot, when_set=True),
    "profiling.save_memory_snapshot_folder": honoured(_PROFILER),
    # ------------------------------------------------------------ [metrics]
    "metrics.log_freq": checked(f"{_METRICS}; >= 1", V.at_least(1)),
    "metrics.enable_tensorboard": honoured(_METRICS),
    "metrics.disable_color_printing": honoured(_METRICS),
    "metrics.save_tb_folder": honoured(_METRICS),
    "metrics.save_for_all_ranks": honoured(_METRICS),
    "metrics.enable_wandb": honoured(_METRICS),
    # ------------------------------------------------------------ [model]
    "model.name": honoured("the registered model spec (checked by validate.py)"),
    "model.flavor": honoured("the spec's flavor (checked by validate.py)"),
    "model.hf_assets_path": honoured("the tokenizer.json folder (torchtitan_omni.data.tokenizer)"),
    "model.tokenizer_path": honoured(
        "deprecated alias: TorchTitan's config parser copies it into model.hf_assets_path"),
    "model.converters": checked(
        f"{_TRAINER} applies them; only float8 ('quantize.linear.float8' or 'float8'), with "
        "torchao, on a GPU of capability >= 8.9 (emulated also on CPU)",
        V.converters),
    "model.print_after_conversion": honoured(f"{_TRAINER} (its converter container)"),
    # ------------------------------------------------------------ [optimizer]
    "optimizer.name": checked("TorchTitan's build_optimizers: Adam or AdamW", V.optimizer_name),
    "optimizer.lr": checked("TorchTitan's build_optimizers; > 0", V.above(0)),
    "optimizer.beta1": checked("TorchTitan's build_optimizers; in [0, 1)", V.beta),
    "optimizer.beta2": checked("TorchTitan's build_optimizers; in [0, 1)", V.beta),
    "optimizer.eps": checked("TorchTitan's build_optimizers; > 0", V.above(0)),
    "optimizer.weight_decay": checked("TorchTitan's build_optimizers; >= 0", V.at_least(0)),
    "optimizer.implementation": honoured("TorchTitan's build_optimizers"),
    "optimizer.early_step_in_backward": refused(
        "the omni trainer accumulates micro-batches and clips by the global gradient norm "
        "before optimizers.step(); a step inside backward would skip both"),
    # ------------------------------------------------------------ [lr_scheduler]
    "lr_scheduler.warmup_steps": checked(f"{_SCHEDULE}; 0 to the schedule's length",
                                         V.warmup_steps),
    "lr_scheduler.total_steps": honoured(_SCHEDULE),
    "lr_scheduler.decay_ratio": honoured(_SCHEDULE),
    "lr_scheduler.decay_type": honoured(_SCHEDULE),
    "lr_scheduler.min_lr_factor": honoured(_SCHEDULE),
    # ------------------------------------------------------------ [training]
    "training.dataset": honoured("the spec's dataloader (torchtitan_omni.data.loader)"),
    "training.dataset_path": honoured("the spec's dataloader (torchtitan_omni.data.loader)"),
    "training.local_batch_size": checked("rows per micro-batch; >= 1", V.at_least(1)),
    "training.global_batch_size": checked(
        f"{_TRAINER} (gradient accumulation); -1 or a multiple of local x data-parallel",
        V.global_batch_size),
    "training.seq_len": checked("row length; a multiple of parallelism.ulysses_degree",
                                V.seq_len),
    "training.max_norm": checked("global gradient-norm clipping (OmniTrainer); > 0",
                                 V.above(0)),
    "training.steps": checked(f"{_TRAINER}; >= 1", V.at_least(1)),
    "training.enable_cpu_offload": checked(
        "FSDP2 CPU offload (torchtitan_omni.distributed.parallelize); initialization on CPU "
        f"by {_TRAINER}; needs a GPU job with 2+ ranks", V.cpu_offload),
    "training.dtype": honoured(f"the model is built under it by {_TRAINER}"),
    "training.mixed_precision_param": honoured(
        "FSDP2 mixed precision, or autocast without FSDP, on GPU; CPU runs stay float32"),
    "training.mixed_precision_reduce": honoured("FSDP2 mixed precision on GPU"),
    "training.gc_freq": checked(f"{_TRAINER} (garbage collection); >= 1", V.at_least(1)),
    "training.gc_debug": honoured(f"{_TRAINER} (garbage collection)"),
    # An omni config module may default num_workers to an "auto" value (e.g. -1): the check
    # only looks at values a user set.
    "training.dataloader.num_workers": checked(f"{_LOADER}; >= 0", V.at_least(0),
                                               when_set=True),
    "training.dataloader.persistent_workers": honoured(_LOADER),
    "training.dataloader.pin_memory": honoured(_LOADER),
    "training.dataloader.prefetch_factor": honoured(_LOADER),
    # ------------------------------------------------------------ [parallelism]
    "parallelism.data_parallel_replicate_degree": honoured(
        "the device mesh (validate.resolved_degrees checks it against the world size)"),
    "parallelism.data_parallel_shard_degree": honoured(
        "the device mesh (validate.resolved_degrees checks it against the world size)"),
    "parallelism.fsdp_reshard_after_forward": honoured(
        "FSDP2 reshard_after_forward ('default': every unit but the plan's "
        "gathered_after_forward ones, the LLM head, as TorchTitan's default)"),
    "parallelism.tensor_parallel_degree": refused(_TP),
    "parallelism.disable_loss_parallel": no_op(
        "loss parallel needs tensor parallel, which is refused: it is off either way"),
    "parallelism.enable_async_tensor_parallel": refused(_TP),
    "parallelism.pipeline_parallel_degree": refused(_PP),
    "parallelism.module_fqns_per_model_part": refused(_PP),
    "parallelism.pipeline_parallel_first_stage_less_layers": refused(_PP),
    "parallelism.pipeline_parallel_last_stage_less_layers": refused(_PP),
    "parallelism.pipeline_parallel_layers_per_stage": refused(_PP),
    "parallelism.pipeline_parallel_schedule": refused(_PP),
    "parallelism.pipeline_parallel_schedule_csv": refused(_PP, None),
    "parallelism.pipeline_parallel_microbatch_size": refused(_PP),
    "parallelism.pipeline_parallel_expert_parallel_overlap": refused(_PP),
    "parallelism.context_parallel_degree": refused(_CP),
    "parallelism.context_parallel_load_balancer": refused(_CP),
    "parallelism.context_parallel_rotate_method": refused(_CP),
    "parallelism.expert_parallel_degree": checked(
        "expert parallel (torchtitan_omni.distributed.expert_parallel); divides dp_shard x "
        "ulysses_degree", V.expert_parallel_degree),
    "parallelism.expert_tensor_parallel_degree": refused(
        "expert tensor parallel needs tensor parallel, which is not provided; experts are "
        "split by expert_parallel_degree and sharded by FSDP"),
    "parallelism.expert_parallel_comm_backend": refused(
        "expert parallel uses PyTorch all-to-all (torchtitan_omni.distributed.expert_parallel); "
        "DeepEP is not integrated"),
    # ------------------------------------------------------------ [checkpoint]
    "checkpoint.enable": honoured(_CKPT),
    "checkpoint.enable_ft_dataloader_checkpoints": refused(_FT),
    "checkpoint.folder": honoured(_CKPT),
    "checkpoint.interval": checked(f"{_CKPT}; >= 1", V.at_least(1)),
    "checkpoint.initial_load_path": checked(f"{_CKPT}; needs checkpoint.enable",
                                            V.needs_checkpointing, when_set=True),
    "checkpoint.initial_load_model_only": honoured(_CKPT),
    "checkpoint.initial_load_in_hf": refused(
        "give each part's Hugging Face folder in weights.sources, e.g. 'llm=/ckpt/Llama-3-8B'"),
    "checkpoint.initial_load_in_hf_quantized": refused(
        "quantized Hugging Face checkpoints are not read; give each part's folder in "
        "weights.sources"),
    "checkpoint.last_save_model_only": honoured(_CKPT),
    "checkpoint.last_save_in_hf": refused(
        "export with scripts/convert_checkpoint.py dcp-to-hf (the LLM, encoders and decoders "
        "each get a Hugging Face folder)"),
    "checkpoint.export_dtype": honoured(_CKPT),
    "checkpoint.async_mode": honoured(_CKPT),
    "checkpoint.keep_latest_k": honoured(f"{_CKPT} (counts published checkpoints only)"),
    "checkpoint.load_step": checked(f"{_CKPT}; needs checkpoint.enable",
                                    V.needs_checkpointing, when_set=True),
    "checkpoint.exclude_from_loading": honoured(_CKPT),
    "checkpoint.enable_first_step_checkpoint": honoured(_CKPT),
    "checkpoint.create_seed_checkpoint": checked(
        "saved by torchtitan_omni.train's main; needs checkpoint.enable and one process",
        V.seed_checkpoint, when_set=True),
    "checkpoint.load_only": honoured(_CKPT),
    # ------------------------------------------------------------ [activation_checkpoint]
    "activation_checkpoint.mode": checked(
        "the LLM's blocks (torchtitan_omni.distributed.activation_checkpoint): none, full or "
        "selective", V.ac_mode),
    "activation_checkpoint.selective_ac_option": checked(
        "'op', 'attention' or every N-th block", V.selective_ac_option),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": refused(
        "per-op SAC here saves every matmul and attention output and takes no list of forced "
        "recomputes"),
    "activation_checkpoint.early_stop": refused(_AC_ARGS),
    "activation_checkpoint.memory_budget": refused(_BUDGET),
    "activation_checkpoint.visualize_memory_budget_pareto": refused(_BUDGET),
    "activation_checkpoint.preserve_rng_state": honoured(
        "passed to torch.utils.checkpoint for the LLM's blocks"),
    "activation_checkpoint.determinism_check": refused(_AC_ARGS),
    "activation_checkpoint.debug": refused(_AC_ARGS),
    # ------------------------------------------------------------ [compile]
    "compile.enable": checked("torch.compile of the omni model (distributed/parallelize.py); "
                              "not with async Ulysses", V.compile_enable),
    "compile.components": checked("'model' (every part's blocks), 'loss' (the loss kernel) and "
                                  "'optimizer' (the fused AdamW's update of large tensors)",
                                  V.compile_components),
    "compile.backend": honoured("passed to torch.compile"),
    # ------------------------------------------------------------ [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": checked(
        _FLOAT8, V.needs_float8, when_set=True),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": checked(
        _FLOAT8, V.needs_float8, when_set=True),
    "quantize.linear.float8.recipe_name": checked(_FLOAT8, V.needs_float8, when_set=True),
    "quantize.linear.float8.filter_fqns": checked(_FLOAT8, V.needs_float8, when_set=True),
    "quantize.linear.float8.emulate": checked(_FLOAT8, V.needs_float8, when_set=True),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": refused(_MX),
    "quantize.linear.mx.recipe_name": refused(_MX),
    "quantize.linear.mx.filter_fqns": refused(_MX),
    "quantize.grouped_mm.float8.fqns": refused(
        "float8 grouped GEMMs of MoE experts are not supported; float8 covers the "
        "foundation's linear layers", ""),
    "quantize.grouped_mm.mx.recipe_name": refused(_MX),
    "quantize.grouped_mm.mx.fqns": refused(_MX, ""),
    # ------------------------------------------------------------ [comm]
    "comm.init_timeout_seconds": honoured("TorchTitan's init_distributed"),
    "comm.train_timeout_seconds": honoured(f"{_TRAINER} (after the first step)"),
    "comm.trace_buf_size": honoured(_COMM),
    "comm.save_traces_folder": honoured(_COMM),
    "comm.save_traces_file_prefix": honoured(_COMM),
    "comm.mode": refused(
        "fake-backend and local-tensor dry runs are not supported by the omni trainer; try a "
        "layout on CPU with TORCHTITAN_OMNI_DEVICE=cpu NGPU=N ./run_train.sh"),
    # ------------------------------------------------------------ [memory_estimation]
    "memory_estimation.enable": refused(_ESTIMATION),
    "memory_estimation.disable_fake_mode": refused(_ESTIMATION),
    # ------------------------------------------------------------ [fault_tolerance]
    "fault_tolerance.enable": refused(_FT),
    "fault_tolerance.process_group": refused(_FT),
    "fault_tolerance.process_group_timeout_ms": refused(_FT),
    "fault_tolerance.replica_id": refused(_FT),
    "fault_tolerance.group_size": refused(_FT),
    "fault_tolerance.min_replica_size": refused(_FT),
    "fault_tolerance.semi_sync_method": refused(_FT),
    # ------------------------------------------------------------ [experimental]
    "experimental.custom_import": honoured("imported before the model spec is looked up"),
    "experimental.custom_args_module": refused(
        "deprecated by TorchTitan and not read by torchtitan-omni's parser; name the module "
        "in job.custom_config_module"),
    # ------------------------------------------------------------ [validation]
    "validation.enable": checked(
        "held-out losses every validation.freq steps (torchtitan_omni.eval.validator)",
        V.validation),
    "validation.dataset": honoured(_VALIDATION),
    "validation.dataset_path": honoured(_VALIDATION),
    "validation.local_batch_size": honoured(_VALIDATION),
    "validation.seq_len": honoured(_VALIDATION),
    "validation.freq": honoured(_VALIDATION),
    "validation.steps": honoured(_VALIDATION),
    "validation.dataloader.num_workers": honoured(_VALIDATION),
    "validation.dataloader.persistent_workers": honoured(_VALIDATION),
    "validation.dataloader.pin_memory": honoured(_VALIDATION),
    "validation.dataloader.prefetch_factor": honoured(_VALIDATION),
    # ------------------------------------------------------------ [debug]
    "debug.seed": honoured(_DETERMINISM),
    "debug.deterministic": honoured(_DETERMINISM),
    "debug.deterministic_warn_only": honoured(_DETERMINISM),
    "debug.moe_force_load_balance": refused(
        "the omni MoE routes by its router only (torchtitan_omni.modules.moe); there is no "
        "forced round-robin"),
}


def value_of(cfg: Any, key: str) -> Any:
    """The value of a dotted key (``"training.dataloader.num_workers"``)."""
    return reduce(getattr, key.split("."), cfg)


def _is_default(rule: Rule, value: Any, default: Any) -> bool:
    return value == default or any(value == d and type(value) is type(d)
                                   for d in rule.also_default)


def show(value: Any) -> str:
    """A value as a user writes it (TOML-like: true, "text", ["a"])."""
    if value is None:
        return "None"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def refuse_unsupported(cfg: JobConfig) -> None:
    """Raise :class:`ConfigError` for the first refused key set to a non-default value."""
    defaults = type(cfg)()
    for key, rule in KEYS.items():
        if rule.status != REFUSED:
            continue
        value = value_of(cfg, key)
        if not _is_default(rule, value, value_of(defaults, key)):
            raise ConfigError(f"{key} = {show(value)} is not supported by torchtitan-omni: "
                              f"{rule.why}")


def check_values(cfg: JobConfig, ctx: V.Context) -> None:
    """Raise :class:`ConfigError` for the first honoured key whose value cannot work."""
    defaults = type(cfg)()
    for key, rule in KEYS.items():
        if rule.check is None:
            continue
        value = value_of(cfg, key)
        if rule.when_set and _is_default(rule, value, value_of(defaults, key)):
            continue
        problem = rule.check(value, cfg, ctx)
        if problem:
            raise ConfigError(f"{key} {problem}")
