"""Start-up checks of a parsed ``JobConfig``: impossible combinations fail with one line.

Checked here, before any process group or model exists: every TorchTitan key against the
table of what the omni trainer honours (``torchtitan_omni.config.unsupported``: refused keys,
then value checks), the parallel degrees against the world size, torchtitan-omni's own
sections, the model name and flavor, and the model-dependent constraints the spec's model args
declare (``validate_parallelism``: Ulysses degree vs. attention heads, expert-parallel degree
vs. experts), the per-part layouts (``parallelism.parts``) against the model's parts (and
non-colocated encoders, ``torchtitan_omni.config.noncolocated``: the parallel degrees are then
the LLM ranks'), and the ``[lora]`` settings against the model's module names.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import os
from typing import Any

import torch

from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_omni.models  # noqa: F401  (registers the zoo's specs, which are checked here)
from torchtitan_omni.components.quantization import uses_float8
from torchtitan_omni.config.noncolocated import model_ranks_problem, ranks_problem
from torchtitan_omni.config.parts import table_problem
from torchtitan_omni.config.unsupported import check_values, refuse_unsupported
from torchtitan_omni.config.values import Context, needs_float8
from torchtitan_omni.data.default_dataset import DEFAULT_NAME
from torchtitan_omni.data.loader import build_omni_dataloader, check_data_config
from torchtitan_omni.data.tokenizer import tokenizer_folder
from torchtitan_omni.distributed.checks import fsdp_unit_problem, parts_problem, plan_problem
from torchtitan_omni.distributed.expert_device_splits import nvshmem_usable
from torchtitan_omni.distributed.parallelize import capacity_tokens
from torchtitan_omni.distributed.rank_sets import encoder_ranks_of
from torchtitan_omni.errors import ConfigError, OmniInputError
from torchtitan_omni.lora import apply_lora_config
from torchtitan_omni.protocols.model import llm_layers_problem


def world_size_from_env() -> int:
    """World size of this launch: ``WORLD_SIZE`` under torchrun, else ``NGPU``, else 1."""
    for var in ("WORLD_SIZE", "NGPU"):
        if os.environ.get(var):
            try:
                return int(os.environ[var])
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]!r} is not a whole number") from None
    return 1


def resolved_degrees(cfg: JobConfig, world_size: int) -> dict[str, int]:
    """The parallel degrees with ``data_parallel_shard_degree = -1`` filled in."""
    p = cfg.parallelism
    degrees = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "data_parallel_shard_degree": p.data_parallel_shard_degree,
        "ulysses_degree": p.ulysses_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    for key, value in degrees.items():
        if key != "data_parallel_shard_degree" and value < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {value}")
    others = 1
    for key, value in degrees.items():
        if key != "data_parallel_shard_degree":
            others *= value
    shard = degrees["data_parallel_shard_degree"]
    if shard == -1:
        if world_size % others:
            raise ConfigError(
                f"world size {world_size} is not divisible by "
                + " x ".join(f"parallelism.{k} ({v})" for k, v in degrees.items()
                             if k != "data_parallel_shard_degree")
                + f" = {others}, so data_parallel_shard_degree = -1 cannot be inferred"
            )
        degrees["data_parallel_shard_degree"] = world_size // others
    elif shard < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree must be -1 or >= 1, got {shard}")
    product = 1
    for value in degrees.values():
        product *= value
    if product != world_size:
        raise ConfigError(
            " x ".join(f"parallelism.{k} ({v})" for k, v in degrees.items())
            + f" = {product} does not match the world size {world_size}"
        )
    return degrees


def validate_job_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` for the first impossible setting found."""
    world_size = world_size_from_env() if world_size is None else world_size
    refuse_unsupported(cfg)
    problem = table_problem(cfg.parallelism.parts) or ranks_problem(cfg, world_size)
    if problem:
        raise ConfigError(problem)
    # non-colocated encoders: the parallel degrees are the LLM ranks'
    degrees = resolved_degrees(cfg, world_size - len(encoder_ranks_of(cfg.parallelism)))
    check_values(cfg, Context(world_size, degrees))
    factor = cfg.parallelism.expert_capacity_factor
    if not (factor >= 0 and math.isfinite(factor)):
        raise ConfigError(
            f"parallelism.expert_capacity_factor must be >= 0 (0: exact dispatch, nothing "
            f"dropped), got {factor}"
        )
    head_chunks = cfg.parallelism.ulysses_async_head_chunks
    if head_chunks < 0:
        raise ConfigError(
            f"parallelism.ulysses_async_head_chunks must be >= 0 (0: as many as fit), got "
            f"{head_chunks}")
    if head_chunks and not cfg.parallelism.ulysses_async:
        raise ConfigError(
            f"parallelism.ulysses_async_head_chunks is {head_chunks} but ulysses_async is off: "
            "only async Ulysses pipelines its heads; set --parallelism.ulysses_async or leave "
            "it at 0")
    if cfg.parallelism.ulysses_async and degrees["ulysses_degree"] < 2:
        raise ConfigError(
            f"parallelism.ulysses_async is set but ulysses_degree is "
            f"{degrees['ulysses_degree']}: without Ulysses there is no exchange to overlap; "
            "set --parallelism.ulysses_degree 2 or more, or drop --parallelism.ulysses_async")
    per_unit = cfg.parallelism.llm_blocks_per_fsdp_unit
    if per_unit < 1:
        raise ConfigError(f"parallelism.llm_blocks_per_fsdp_unit must be >= 1, got {per_unit}")
    if per_unit > 1 and degrees["data_parallel_shard_degree"] * degrees["ulysses_degree"] == 1:
        raise ConfigError(
            f"parallelism.llm_blocks_per_fsdp_unit is {per_unit} but the LLM is not "
            "FSDP-sharded (data_parallel_shard_degree x ulysses_degree is 1): there are no "
            "units to group; set it to 1")
    chunks = cfg.parallelism.expert_dispatch_chunks
    if chunks < 1:
        raise ConfigError(f"parallelism.expert_dispatch_chunks must be >= 1, got {chunks}")
    if chunks > 1 and factor == 0:
        raise ConfigError(
            f"parallelism.expert_dispatch_chunks is {chunks} but expert_capacity_factor is 0: "
            "the chunked, overlapped exchange needs the capacity-padded dispatcher (static "
            "splits; the exact one reads its split sizes on the host)"
        )
    if chunks > 1 and cfg.parallelism.expert_parallel_degree < 2:
        raise ConfigError(
            f"parallelism.expert_dispatch_chunks is {chunks} but expert_parallel_degree is "
            f"{cfg.parallelism.expert_parallel_degree}: without expert parallel there is no "
            "exchange to cut into chunks; set it to 1"
        )
    dispatch = cfg.parallelism.expert_dispatch
    if dispatch != "copies":
        if cfg.parallelism.expert_parallel_degree < 2:
            raise ConfigError(
                f"parallelism.expert_dispatch {dispatch!r} needs expert_parallel_degree > 1 (it "
                "changes how expert parallel exchanges tokens; without EP there is no exchange)")
        if factor > 0:
            raise ConfigError(
                f"parallelism.expert_dispatch {dispatch!r} is exact only, but "
                f"expert_capacity_factor is {factor}: set it to 0, or expert_dispatch to "
                "'copies'")
    if cfg.parallelism.expert_exchange == "nvshmem":
        _check_nvshmem_exchange(cfg, factor)
    problem = _sized_dispatch_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.parallelism.expert_ac_keep_exchanges:
        if cfg.parallelism.expert_parallel_degree < 2:
            raise ConfigError(
                "parallelism.expert_ac_keep_exchanges needs expert_parallel_degree > 1 (it "
                "checkpoints MoE blocks around their expert-parallel all-to-alls; without EP "
                "there are none)")
        if cfg.activation_checkpoint.mode == "none":
            raise ConfigError(
                "parallelism.expert_ac_keep_exchanges needs activation_checkpoint.mode full or "
                "selective (without a recompute there is no exchange to spare)")
    compiled_update = cfg.compile.enable and "optimizer" in cfg.compile.components
    if cfg.optimizer.moments_dtype != "float32" and not compiled_update:
        raise ConfigError(
            f"optimizer.moments_dtype {cfg.optimizer.moments_dtype!r} needs the optimizer's "
            "compiled update, which keeps them: set --compile.enable and add 'optimizer' to "
            "compile.components")
    if cfg.optimizer.expert_weights_dtype != "float32":
        if not compiled_update:
            raise ConfigError(
                f"optimizer.expert_weights_dtype {cfg.optimizer.expert_weights_dtype!r} needs "
                "the optimizer's compiled update, which rounds the new weights stochastically: "
                "set --compile.enable and add 'optimizer' to compile.components")
        if cfg.parallelism.expert_compute_copies:
            raise ConfigError(
                f"optimizer.expert_weights_dtype {cfg.optimizer.expert_weights_dtype!r} leaves "
                "the experts nothing to copy: drop parallelism.expert_compute_copies")
    if cfg.omni.float8_encoders and (problem := needs_float8(True, cfg, None)):
        raise ConfigError(f"omni.float8_encoders {problem}")
    if cfg.omni.float8_encoders and cfg.quantize.linear.float8.recipe_name:
        # the encoders' converter implements TorchTitan's default, tensorwise scaling only
        raise ConfigError(
            "omni.float8_encoders supports only tensorwise float8 (leave "
            f"quantize.linear.float8.recipe_name unset, not "
            f"{cfg.quantize.linear.float8.recipe_name!r})")
    if cfg.omni.encoder_checkpoint_min_tokens < 0:
        raise ConfigError(f"omni.encoder_checkpoint_min_tokens must be >= 0 (0: checkpoint "
                          f"every call), got {cfg.omni.encoder_checkpoint_min_tokens}")
    for entry in cfg.omni.loss_weights:
        name, eq, value = entry.partition("=")
        try:
            float(value)
        except ValueError:
            eq = ""
        if not eq:
            raise ConfigError(f"omni.loss_weights entry {entry!r} is not 'name=number'")
    for entry in cfg.weights.sources:
        part, eq, path = entry.partition("=")
        if not eq or not part.strip() or not path.strip():
            raise ConfigError(f"weights.sources entry {entry!r} is not 'part=path'")
        if not os.path.exists(path.strip()):
            raise ConfigError(f"weights.sources {part.strip()}: {path.strip()} does not exist")
    _validate_model(cfg, degrees)


def _validate_data(cfg: JobConfig, spec) -> None:
    """The [data] values, and that a user dataset exists (the bundled one is built on use),
    for specs that read data through torchtitan-omni's loader."""
    if spec.build_dataloader_fn is not build_omni_dataloader:
        return

    try:
        check_data_config(cfg.data, cfg.training.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.training
    if t.dataset != DEFAULT_NAME:
        path = t.dataset_path or t.dataset
        if not path or not os.path.exists(path):
            raise ConfigError(
                f"training.dataset_path {path!r} does not exist (training.dataset="
                f"{t.dataset!r}; use '{DEFAULT_NAME}' for the bundled dataset)"
            )


def _validate_model(cfg: JobConfig, degrees: dict[str, int]) -> None:
    if cfg.experimental.custom_import:
        try:
            importlib.import_module(cfg.experimental.custom_import)
        except ImportError as e:
            raise ConfigError(f"experimental.custom_import cannot be imported: {e}") from None

    try:
        spec = get_train_spec(cfg.model.name)
    except (ValueError, ImportError):
        raise ConfigError(f"model.name {cfg.model.name!r} is not a registered model spec") from None
    if cfg.model.flavor not in spec.model_args:
        raise ConfigError(
            f"model.flavor {cfg.model.flavor!r} is not a flavor of {cfg.model.name} "
            f"(flavors: {', '.join(spec.model_args)})"
        )
    _validate_data(cfg, spec)
    args = _job_args(spec, cfg)
    llm_args = getattr(args, "llm_args", None)
    if cfg.omni.llm_layers and llm_args is not None:
        problem = llm_layers_problem(cfg.omni.llm_layers, llm_args)
        if problem:
            raise ConfigError(problem)
    check = getattr(args, "validate_parallelism", None)
    if check is not None:
        problem = check(
            ulysses_degree=degrees["ulysses_degree"],
            expert_parallel_degree=cfg.parallelism.expert_parallel_degree,
        )
        if problem:
            raise ConfigError(problem)
    _validate_plan(spec, args, degrees["ulysses_degree"], cfg.parallelism.expert_parallel_degree,
                   cfg.parallelism.expert_capacity_factor,
                   cfg.parallelism.ulysses_async_head_chunks if cfg.parallelism.ulysses_async
                   else None)
    _validate_parts(cfg, spec, args, degrees)
    _validate_lora(cfg, spec, args)


def _model_on_meta(spec, args) -> Any:  # an OmniModel, or what a custom spec builds
    """The spec's model built on the meta device (no memory). Args the model refuses
    (``ValueError``, ``OmniInputError``) are a :class:`ConfigError`; any other failure is a bug
    of the spec and keeps its traceback."""
    try:
        with torch.device("meta"):
            return spec.model_cls(args)
    except (OmniInputError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{spec.model_cls.__name__} cannot be built with these settings: "
                          f"{why}") from None


def _job_args(spec, cfg: JobConfig):
    """The flavor's args; for flavor "hf" or a ``model.parts_flavor``, shaped by the job
    (``config.json`` files read, a copy updated) so every check sees the real model."""
    args = spec.model_args[cfg.model.flavor]
    if not (getattr(args, "from_hf", False) or cfg.model.parts_flavor):
        return args
    args = copy.deepcopy(args)
    try:
        args.update_from_config(cfg)
    except OmniInputError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:  # e.g. a tokenizer larger than the checkpoint's vocabulary
        raise ConfigError(str(e)) from None
    if args.from_hf:
        folder = tokenizer_folder(cfg)
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise ConfigError(
                f"no tokenizer.json in {folder}: model.flavor = 'hf' takes the tokenizer from "
                "the LLM's weights.sources folder, or from model.hf_assets_path when that names "
                "another folder than the bundled tokenizer's")
    return args


def _validate_plan(spec, args, ulysses_degree: int, ep_degree: int,
                   capacity_factor: float = 0.0, async_head_chunks: int | None = None) -> None:
    """The spec's declared plan against the degrees, on the model built on the meta device
    (catches what a spec's own ``validate_parallelism`` misses); ``async_head_chunks``:
    ``parallelism.ulysses_async_head_chunks`` under async Ulysses, else None."""
    if ulysses_degree == 1 and ep_degree == 1 and capacity_factor == 0:
        return
    model = _model_on_meta(spec, args)
    problem = plan_problem(model, ulysses_degree, ep_degree, capacity_factor, async_head_chunks)
    if problem:
        raise ConfigError(problem)


def _validate_parts(cfg: JobConfig, spec, args, degrees: dict[str, int]) -> None:
    """The per-part layouts (``parallelism.parts``), the encoders' "balance" mode and
    ``fsdp_unit`` "part" on the model built on the meta device (``checks.parts_problem``,
    ``checks.fsdp_unit_problem``)."""
    encoder_ranks = (degrees["data_parallel_replicate_degree"]
                     * degrees["data_parallel_shard_degree"] * degrees["ulysses_degree"])
    balance = encoder_ranks > 1 and (
        cfg.parallelism.encoder_sequence_parallel == "balance"
        or any(t.get("sequence_parallel") == "balance" for t in cfg.parallelism.parts.values()))
    if not (cfg.parallelism.parts or balance):
        return
    model = _model_on_meta(spec, args)
    # non-colocated encoders are sharded over their own ranks only
    own_ranks = len(encoder_ranks_of(cfg.parallelism)) or encoder_ranks
    problem = (parts_problem(model, cfg, encoder_ranks)
               or fsdp_unit_problem(model, cfg, own_ranks)
               or model_ranks_problem(cfg, list(getattr(model, "encoders", None) or {})))
    if problem:
        raise ConfigError(problem)


def _validate_lora(cfg: JobConfig, spec, args) -> None:
    """The ``[lora]`` values, and its module patterns on the model built on the meta device
    (frozen by ``omni.freeze`` first, as ``parallelize_omni`` does)."""
    lora = cfg.lora
    if not lora.enable:
        if lora.save_adapter_only:
            raise ConfigError("lora.save_adapter_only is set but lora.enable is not")
        return
    if lora.rank < 1:
        raise ConfigError(f"lora.rank must be >= 1, got {lora.rank}")
    if not lora.alpha > 0:
        raise ConfigError(f"lora.alpha must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if uses_float8(cfg.model.converters):
        raise ConfigError("lora.enable with float8 model.converters is not supported: "
                          "adapters go on plain linears; train LoRA in bf16")
    if lora.save_adapter_only and cfg.checkpoint.initial_load_path:
        raise ConfigError(
            "lora.save_adapter_only with checkpoint.initial_load_path: resuming an adapter-only "
            "checkpoint takes the base from weights.sources, so give the base there (a DCP "
            "checkpoint works too: 'llm=PATH')")
    model = _model_on_meta(spec, args)
    try:
        model.freeze(list(cfg.omni.freeze))
        apply_lora_config(model, lora)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _sized_dispatch_problem(cfg: JobConfig) -> str | None:
    """The exact dispatchers whose buffers are sized by the training micro-batch's tokens
    (``expert_dispatch = "gather"``, ``expert_exchange = "nvshmem"``) cannot take a larger
    validation micro-batch: the first validation would fail mid-run."""
    p, v = cfg.parallelism, cfg.validation
    if not v.enable or p.expert_parallel_degree < 2:
        return None
    which = ("expert_dispatch 'gather'" if p.expert_dispatch == "gather"
             else "expert_exchange 'nvshmem'" if p.expert_exchange == "nvshmem" else None)
    if which is None:
        return None
    train = capacity_tokens(cfg, 1)
    held_out = capacity_tokens(dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, seq_len=v.seq_len, local_batch_size=v.local_batch_size)), 1)
    if held_out <= train:
        return None
    return (f"parallelism.{which} sizes its buffers for a training micro-batch of {train} "
            f"tokens, but a validation micro-batch holds up to {held_out} "
            f"(validation.local_batch_size {v.local_batch_size} x validation.seq_len "
            f"{v.seq_len}): make validation's micro-batch no larger than training's")


def _check_nvshmem_exchange(cfg, factor: float) -> None:
    """``parallelism.expert_exchange = "nvshmem"``: the exact copies dispatcher under expert
    parallel, on a machine where torch's NVSHMEM all-to-all-v runs."""
    p = cfg.parallelism
    if p.expert_parallel_degree < 2:
        raise ConfigError(
            "parallelism.expert_exchange 'nvshmem' needs expert_parallel_degree > 1 (it is how "
            "the expert-parallel all-to-all moves rows; without EP there is none)")
    if factor > 0 or p.expert_dispatch != "copies":
        raise ConfigError(
            "parallelism.expert_exchange 'nvshmem' is for the exact dispatcher of routed "
            f"copies: expert_capacity_factor must be 0 (is {factor}) and expert_dispatch "
            f"'copies' (is {p.expert_dispatch!r})")
    usable, why = nvshmem_usable()
    if not usable:
        raise ConfigError(f"parallelism.expert_exchange 'nvshmem' cannot run here: {why}; "
                          "use 'nccl'")

