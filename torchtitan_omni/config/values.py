"""Value checks of the TorchTitan keys the omni trainer honours, run before launch.

A check takes the key's value, the whole config and a :class:`Context` (world size and
resolved parallel degrees) and returns what is wrong as a phrase that follows the key's name
("must be > 0, got 0.0"), or None. ``torchtitan_omni.config.unsupported`` names the check of
each key; a check there marked ``when_set`` runs only on a value other than the default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.config import JobConfig

from torchtitan_omni import platform
from torchtitan_omni.components.quantization import FLOAT8_NAMES, uses_float8
from torchtitan_omni.eval.validator import validation_problem

COMPILE_COMPONENTS = ("model", "loss", "optimizer")
FLOAT8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer


@dataclass(frozen=True)
class Context:
    """What value checks need beyond the config: the launch's world size and degrees."""

    world_size: int
    degrees: dict[str, int]

    @property
    def data_parallel(self) -> int:
        """Data-parallel degree: ranks reading different samples (replicate x shard)."""
        d = self.degrees
        return d["data_parallel_replicate_degree"] * d["data_parallel_shard_degree"]


Check = Callable[[Any, JobConfig, Context], "str | None"]


# ----------------------------------------------------------------- bounds
def above(bound: float) -> Check:
    """A check that the value is > ``bound``."""
    def check(value, cfg, ctx):
        return None if value > bound else f"must be > {bound}, got {value}"
    return check


def at_least(bound: int) -> Check:
    """A check that the value is >= ``bound``."""
    def check(value, cfg, ctx):
        return None if value >= bound else f"must be >= {bound}, got {value}"
    return check


def beta(value, cfg, ctx) -> str | None:
    """Adam's moving-average coefficients live in [0, 1)."""
    return None if 0 <= value < 1 else f"must be in [0, 1), got {value}"


def optimizer_name(value, cfg, ctx) -> str | None:
    """TorchTitan's ``build_optimizers`` knows Adam and AdamW only."""
    if value in ("Adam", "AdamW"):
        return None
    return f"must be 'Adam' or 'AdamW' (TorchTitan's build_optimizers), got {value!r}"


# ----------------------------------------------------------------- schedule and batch
def warmup_steps(value, cfg, ctx) -> str | None:
    """Warm-up fits in the schedule (TorchTitan would silently shorten it)."""
    if value < 0:
        return f"must be >= 0, got {value}"
    total = cfg.lr_scheduler.total_steps
    length, name = (total, "lr_scheduler.total_steps") if total is not None else (
        cfg.training.steps, "training.steps")
    if value > length:
        return (f"must be <= {name} ({length}), got {value}: TorchTitan would cut the warm-up "
                "short; lower it, or set lr_scheduler.total_steps for a longer schedule")
    return None


def global_batch_size(value, cfg, ctx) -> str | None:
    """-1 (one micro-batch per step) or a whole number of micro-batches over all data ranks."""
    if value == -1:
        return None
    local = cfg.training.local_batch_size
    unit = local * ctx.data_parallel
    if value < 1 or value % unit:
        return (f"must be -1 or a positive multiple of training.local_batch_size ({local}) x "
                f"data-parallel degree ({ctx.data_parallel}) = {unit}, got {value}")
    return None


def seq_len(value, cfg, ctx) -> str | None:
    """Each Ulysses rank holds an equal slice of every row."""
    ulysses = ctx.degrees["ulysses_degree"]
    if value % ulysses:
        return f"({value}) must be a multiple of parallelism.ulysses_degree ({ulysses})"
    return None


def expert_parallel_degree(value, cfg, ctx) -> str | None:
    """Experts are split over (borrowed) FSDP ranks: dp_shard x ulysses."""
    if value < 1:
        return f"must be >= 1, got {value}"
    sharded = ctx.degrees["data_parallel_shard_degree"] * ctx.degrees["ulysses_degree"]
    if value > 1 and sharded % value:
        return (f"({value}) must divide data_parallel_shard_degree x ulysses_degree "
                f"({sharded}): experts are split over those ranks")
    return None


# ----------------------------------------------------------------- activation checkpointing
def ac_mode(value, cfg, ctx) -> str | None:
    """``memory_budget`` is the compiler's partitioner over whole graphs, not provided here."""
    if value == "memory_budget":
        return ("'memory_budget' is not supported by torchtitan-omni (it needs the compiler's "
                "memory-budget partitioner over the whole model); use none, full or selective")
    return None


def selective_ac_option(value, cfg, ctx) -> str | None:
    """'op', 'attention' (per-op) or every N-th block, when selective AC is on."""
    if cfg.activation_checkpoint.mode != "selective":
        return None
    if value in ("op", "attention"):
        return _per_op_with_experts_problem(value, cfg, ctx)
    try:
        every = int(value)
    except ValueError:
        every = 0
    if every < 1:
        return ("must be 'op', 'attention' or a whole number >= 1 (checkpoint every N-th "
                f"layer), got {value!r}")
    return None


def _per_op_with_experts_problem(value, cfg, ctx) -> str | None:
    """Per-op AC under expert parallel needs the experts outside FSDP: an FSDP unit of their
    own gathers inside the checkpointed block, and per-op AC's replay cannot run those hooks
    again. They are outside where their FSDP ranks (dp_replicate x dp_shard x ulysses / ep)
    are one, without CPU offload (``parallelize.experts_outside_fsdp``)."""
    ep = cfg.parallelism.expert_parallel_degree
    if ep <= 1:
        return None
    d = ctx.degrees
    expert_fsdp = (d["data_parallel_replicate_degree"] * d["data_parallel_shard_degree"]
                   * d["ulysses_degree"] // ep)
    if expert_fsdp > 1 or cfg.training.enable_cpu_offload:
        why = ("training.enable_cpu_offload gives them one" if expert_fsdp == 1 else
               f"they are FSDP-sharded over dp_replicate x dp_shard x ulysses / "
               f"expert_parallel_degree = {expert_fsdp} ranks")
        return (f"{value!r} with parallelism.expert_parallel_degree > 1 needs the experts "
                f"without an FSDP unit, and {why}; use activation_checkpoint.mode full or "
                "selective_ac_option N (every N-th block)")
    return None


# ----------------------------------------------------------------- compile and float8
def compile_components(value, cfg, ctx) -> str | None:
    """The parts torch.compile is applied to: blocks ("model"), the loss kernel ("loss") and
    the optimizer's update of large tensors ("optimizer", with the fused implementation)."""
    for name in value:
        if name not in COMPILE_COMPONENTS:
            return (f"has {name!r}: only 'model' (every part's blocks), 'loss' (the text head's "
                    "loss kernel) and 'optimizer' (the fused AdamW's update) can be compiled")
    if "optimizer" in value and cfg.optimizer.implementation != "fused":
        return ("has 'optimizer', which compiles the fused implementation's update; "
                f"optimizer.implementation is {cfg.optimizer.implementation!r}: use 'fused'")
    if cfg.compile.enable and not value:
        return "is empty, so compile.enable would compile nothing; use ['model', 'loss']"
    return None


def compile_enable(value, cfg, ctx) -> str | None:
    """Async Ulysses overlaps its all-to-alls by hand with Work handles, which a compiled graph
    cannot hold; compiled blocks use the traceable synchronous all-to-all."""
    if value and ctx.degrees["ulysses_degree"] > 1 and cfg.parallelism.ulysses_async:
        return ("cannot be combined with parallelism.ulysses_async: the compiled blocks run the "
                "synchronous (traceable) Ulysses all-to-all; drop --parallelism.ulysses_async")
    return None


def cpu_offload(value, cfg, ctx) -> str | None:
    """FSDP2's CPU offload moves sharded state to the host of a GPU job with FSDP units."""
    if not value:
        return None
    if platform.is_cpu():
        return "needs a CUDA GPU (on a CPU run everything is in host memory already)"
    sharded = ctx.degrees["data_parallel_shard_degree"] * ctx.degrees["ulysses_degree"]
    if ctx.data_parallel * ctx.degrees["ulysses_degree"] == 1 or sharded < 1:
        return "needs FSDP, i.e. 2 or more ranks (NGPU >= 2)"
    return None


def validation(value, cfg, ctx) -> str | None:
    """The [validation] values and the held-out data, when validation is on."""
    if not value:
        return None

    problem = validation_problem(cfg, ctx.degrees["ulysses_degree"])
    # the validator's message names its own key: drop the leading "validation.enable" context
    return f"is on, but {problem}" if problem else None


def cuda_capability() -> tuple[int, int]:
    """Lowest compute capability of the visible GPUs (every local rank takes one of them)."""
    return min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))


def converters(value, cfg, ctx) -> str | None:
    """Only TorchTitan's float8 converter (by its key or its short name), on a GPU that has
    float8 tensor cores; emulated (``quantize.linear.float8.emulate``) also on CPU, as
    TorchTitan allows it without compile (a test of the path, no speed)."""
    for name in value:
        if name not in FLOAT8_NAMES:
            return (f"has {name!r}: torchtitan-omni supports only float8 linears in the "
                    f"foundation's blocks ({' or '.join(map(repr, FLOAT8_NAMES))}, TorchTitan's "
                    "converter)")
    if not uses_float8(value):
        return None
    emulate = cfg.quantize.linear.float8.emulate
    cpu = platform.is_cpu()
    if cpu and not emulate:
        return ("float8 needs a CUDA GPU, but this job runs on CPU (TORCHTITAN_OMNI_DEVICE=cpu "
                "or no GPU visible); quantize.linear.float8.emulate runs its numerics there")
    emulated = cpu
    if not cpu:
        major, minor = cuda_capability()
        emulated = (major, minor) < FLOAT8_MIN_CAPABILITY
        if emulated and not emulate:
            return (f"float8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer), "
                    f"this one has {major}.{minor} (quantize.linear.float8.emulate tests it "
                    "there)")
    if emulated and cfg.compile.enable:
        return ("emulated float8 runs eagerly only (TorchTitan's rule): turn compile.enable "
                "off")
    try:
        importlib.import_module("torchao")
    except Exception as e:  # noqa: BLE001  (a torchao built for another torch fails otherwise)
        return f"float8 needs torchao, which cannot be imported ({type(e).__name__}: {e})"
    return None


def needs_float8(value, cfg, ctx) -> str | None:
    """A float8 setting means nothing without the float8 converter."""
    if uses_float8(cfg.model.converters):
        return None
    return ("only applies with model.converters = ['quantize.linear.float8'] (or 'float8'), "
            "which this job does not set")


# ----------------------------------------------------------------- checkpoints
def needs_checkpointing(value, cfg, ctx) -> str | None:
    """Loading settings are read only by an enabled checkpoint manager."""
    if cfg.checkpoint.enable:
        return None
    return ("is only read with checkpoint.enable = true (nothing would be loaded); add "
            "--checkpoint.enable")


def seed_checkpoint(value, cfg, ctx) -> str | None:
    """A seed checkpoint is saved by an enabled manager, from one unsharded process."""
    if not cfg.checkpoint.enable:
        return "needs checkpoint.enable = true (nothing would be saved)"
    if ctx.world_size != 1:
        return f"needs a single process (NGPU=1), got world size {ctx.world_size}"
    return None


# ----------------------------------------------------------------- profiling
def profiling(value, cfg, ctx) -> str | None:
    """TorchTitan's profiler asks for a GPU activity and a schedule that fits in its period."""
    if not torch.cuda.is_available():
        return "needs a visible GPU (TorchTitan 0.2.2's profiler set-up fails without one)"
    p = cfg.profiling
    if p.profile_freq < p.profiler_warmup + p.profiler_active:
        return (f"needs profiling.profile_freq ({p.profile_freq}) >= profiler_warmup "
                f"({p.profiler_warmup}) + profiler_active ({p.profiler_active})")
    return None


def memory_snapshot(value, cfg, ctx) -> str | None:
    """Snapshots record the CUDA caching allocator."""
    if platform.is_cpu():
        return "records the CUDA caching allocator, but this job runs on CPU"
    return None
