"""The table of TorchTitan keys (torchtitan_omni/config/unsupported.py): every key of
TorchTitan's JobConfig is classified, refused keys refuse any non-default value with one line,
honoured keys pass, and each value check refuses what cannot work (in-process: parse +
validate; the real entry point is tested in tests/test_trainer.py)."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import typing
from typing import Literal, get_args, get_origin

import pytest
import torch

import torchtitan.config
from tests.harness import REPO
from torchtitan_omni.config import unsupported as U
from torchtitan_omni.config import values as V
from torchtitan_omni.config.manager import ConfigError, parse_job_config
from torchtitan_omni.config.validate import resolved_degrees

CONFIG = str(REPO / "train_configs" / "llama_omni_debug.toml")


def _fields(cls, prefix=""):
    """(dotted key, annotation, default) of every leaf field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yield f"{prefix}{f.name}", tp, default


TORCHTITAN_KEYS = {key: (tp, default) for key, tp, default in _fields(torchtitan.config.JobConfig)}


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")


@pytest.fixture(scope="module")
def base():
    return parse_job_config(["--job.config_file", CONFIG])


def _parse(*args):
    return parse_job_config(["--job.config_file", CONFIG, *args])


def _refused_line(*args) -> str:
    with pytest.raises(ConfigError) as e:
        _parse(*args)
    line = str(e.value)
    assert "\n" not in line
    return line


def _fits(value, tp) -> bool:
    if get_origin(tp) is Literal:
        return value in get_args(tp)
    return isinstance(value, get_origin(tp) or tp)


def _other_value(tp, default):
    """A value of annotation ``tp`` that differs from ``default``."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        tp = args[0] if default is None else next(a for a in args if _fits(default, a))
    if get_origin(tp) is Literal:
        options = [a for a in get_args(tp) if a != default]
        return options[0] if options else f"not_{default}"
    if get_origin(tp) is list:
        inner = get_args(tp)[0]
        return [["x"]] if get_origin(inner) is list else ["x"]
    if tp is bool:
        return not default
    if tp is int:
        return 1 if default is None else default + 1
    if tp is float:
        return 0.5 if default is None else default + 0.25
    if tp is str:
        return "x" if default is None else f"{default}x"
    raise AssertionError(f"no sample value for {tp}")


def test_every_torchtitan_key_is_classified():
    # A TorchTitan upgrade that adds or renames a key fails here until the table has a row.
    assert len(TORCHTITAN_KEYS) > 140
    missing = sorted(set(TORCHTITAN_KEYS) - set(U.KEYS))
    stale = sorted(set(U.KEYS) - set(TORCHTITAN_KEYS))
    assert not missing, f"TorchTitan keys without a row in config/unsupported.py: {missing}"
    assert not stale, f"rows for keys TorchTitan does not have: {stale}"
    for key, rule in U.KEYS.items():
        assert rule.status in (U.HONOURED, U.NO_OP, U.CHECKED, U.REFUSED), key
        assert rule.why and "\n" not in rule.why, key
        assert (rule.check is not None) == (rule.status == U.CHECKED), key


@pytest.mark.parametrize("key", sorted(k for k, r in U.KEYS.items() if r.status == U.REFUSED))
def test_refused_key_refuses_a_non_default_value(base, key):
    cfg = copy.deepcopy(base)
    section, _, name = key.rpartition(".")
    value = _other_value(*TORCHTITAN_KEYS[key])
    setattr(U.value_of(cfg, section), name, value)
    with pytest.raises(ConfigError) as e:
        U.refuse_unsupported(cfg)
    line = str(e.value)
    assert line.startswith(f"{key} = ") and U.KEYS[key].why in line and "\n" not in line


def test_honoured_keys_are_not_refused(base):
    for key, rule in U.KEYS.items():
        if rule.status == U.REFUSED:
            continue
        cfg = copy.deepcopy(base)
        section, _, name = key.rpartition(".")
        setattr(U.value_of(cfg, section), name, _other_value(*TORCHTITAN_KEYS[key]))
        U.refuse_unsupported(cfg)  # the refusal pass leaves honoured keys alone


def test_bundled_configs_pass_the_table():
    # The real-size configs need 8 ranks (expert_parallel_degree 4); parsed without the full
    # validation (which builds the 30B model on meta), then run through the table.
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        cfg = torchtitan.config.ConfigManager().parse_args(["--job.config_file", str(path)])
        U.refuse_unsupported(cfg)
        U.check_values(cfg, V.Context(8, resolved_degrees(cfg, 8)))


def test_validation_values_are_checked_when_enabled():
    _parse("--validation.enable")  # the bundled val split
    line = _refused_line("--validation.enable", "--validation.freq", "0")
    assert "validation.enable" in line and "validation.freq must be >= 1, got 0" in line
    _parse("--validation.freq", "0")  # read only with validation on
    line = _refused_line("--validation.enable", "--validation.dataset_path", "/no/such/val")
    assert "/no/such/val" in line


def test_existing_degree_checks_come_from_the_table():
    line = _refused_line("--parallelism.context_parallel_degree", "2")
    assert "context_parallel_degree = 2" in line and "ulysses_degree" in line
    line = _refused_line("--parallelism.expert_tensor_parallel_degree", "2")
    assert line.startswith("parallelism.expert_tensor_parallel_degree = 2 ")


# ----------------------------------------------------------------- value checks
VALUE_CASES = [
    (("--optimizer.lr", "0"), "optimizer.lr must be > 0"),
    (("--optimizer.lr", "-1e-4"), "optimizer.lr must be > 0"),
    (("--optimizer.eps", "0"), "optimizer.eps must be > 0"),
    (("--optimizer.beta1", "1.0"), "optimizer.beta1 must be in [0, 1)"),
    (("--optimizer.beta2", "-0.1"), "optimizer.beta2 must be in [0, 1)"),
    (("--optimizer.weight_decay", "-0.01"), "optimizer.weight_decay must be >= 0"),
    (("--optimizer.name", "SGD"), "optimizer.name must be 'Adam' or 'AdamW'"),
    (("--lr_scheduler.warmup_steps", "-1"), "lr_scheduler.warmup_steps must be >= 0"),
    (("--lr_scheduler.warmup_steps", "31"),
     "lr_scheduler.warmup_steps must be <= training.steps (30)"),
    (("--lr_scheduler.total_steps", "40", "--lr_scheduler.warmup_steps", "41"),
     "lr_scheduler.warmup_steps must be <= lr_scheduler.total_steps (40)"),
    (("--training.max_norm", "0"), "training.max_norm must be > 0"),
    (("--training.global_batch_size", "0"), "training.global_batch_size must be -1 or a positive"),
    (("--training.global_batch_size", "3"), "local_batch_size (2) x data-parallel degree (1) = 2"),
    (("--training.dataloader.num_workers", "-2"), "training.dataloader.num_workers must be >= 0"),
    (("--metrics.log_freq", "0"), "metrics.log_freq must be >= 1"),
    (("--checkpoint.interval", "0"), "checkpoint.interval must be >= 1"),
    (("--training.gc_freq", "0"), "training.gc_freq must be >= 1"),
    (("--training.steps", "0", "--lr_scheduler.warmup_steps", "0"), "training.steps must be >= 1"),
    (("--training.local_batch_size", "0"), "training.local_batch_size must be >= 1"),
    (("--checkpoint.initial_load_path", "/ckpt/step-10"),
     "checkpoint.initial_load_path is only read"),
    (("--checkpoint.load_step", "10"), "checkpoint.load_step is only read with checkpoint.enable"),
    (("--checkpoint.create_seed_checkpoint",), "needs checkpoint.enable = true"),
    (("--profiling.enable_memory_snapshot",), "runs on CPU"),
    (("--compile.components", "model,graph"), "compile.components has 'graph'"),
    (("--compile.components", "model,optimizer", "--optimizer.implementation", "foreach"),
     "compile.components has 'optimizer', which compiles the fused implementation's update"),
    (("--optimizer.moments_dtype", "bfloat16", "--compile.enable"),
     "optimizer.moments_dtype 'bfloat16' needs the optimizer's compiled update"),
    (("--optimizer.expert_weights_dtype", "bfloat16", "--compile.enable"),
     "optimizer.expert_weights_dtype 'bfloat16' needs the optimizer's compiled update"),
    (("--optimizer.expert_weights_dtype", "bfloat16", "--compile.enable", "--compile.components",
      "model,optimizer", "--optimizer.implementation", "fused",
      "--parallelism.expert_compute_copies"),
     "optimizer.expert_weights_dtype 'bfloat16' leaves the experts nothing to copy"),
    (("--model.converters", "mx"), "model.converters has 'mx'"),
    (("--model.converters", "float8"), "float8 needs a CUDA GPU, but this job runs on CPU"),
    (("--model.converters", "quantize.linear.float8"),
     "float8 needs a CUDA GPU, but this job runs on CPU"),
    (("--model.converters", "quantize.grouped_mm.float8"),
     "model.converters has 'quantize.grouped_mm.float8'"),
    (("--model.converters", "float8", "--quantize.linear.float8.emulate", "--compile.enable"),
     "emulated float8 runs eagerly only"),
    (("--quantize.linear.float8.filter_fqns", "output"),
     "quantize.linear.float8.filter_fqns only applies with model.converters = "
     "['quantize.linear.float8'] (or 'float8')"),
    (("--quantize.linear.float8.recipe_name", "rowwise"),
     "quantize.linear.float8.recipe_name only applies with model.converters"),
    (("--activation_checkpoint.mode", "memory_budget"),
     "activation_checkpoint.mode 'memory_budget'"),
    (("--omni.float8_encoders",),
     "omni.float8_encoders only applies with model.converters = ['quantize.linear.float8']"),
]


@pytest.mark.parametrize("args, fragment", VALUE_CASES, ids=[c[0][0][2:] for c in VALUE_CASES])
def test_value_check_refuses(args, fragment):
    assert fragment in _refused_line(*args)


def test_values_that_work_pass():
    _parse("--lr_scheduler.warmup_steps", "30", "--optimizer.beta1", "0",
           "--optimizer.weight_decay", "0", "--training.global_batch_size", "-1")
    _parse("--lr_scheduler.total_steps", "100", "--lr_scheduler.warmup_steps", "50")
    _parse("--training.global_batch_size", "6")  # 3 micro-batches of 2 rows
    _parse("--compile.enable", "--compile.components", "model")
    _parse("--compile.enable", "--compile.components", "model,loss,optimizer",
           "--optimizer.implementation", "fused")
    _parse("--compile.enable", "--compile.components", "model,optimizer",
           "--optimizer.implementation", "fused", "--optimizer.moments_dtype", "bfloat16")
    _parse("--compile.enable", "--compile.components", "model,optimizer",
           "--optimizer.implementation", "fused", "--optimizer.expert_weights_dtype", "bfloat16")
    _parse("--checkpoint.enable", "--checkpoint.load_step", "10")


def test_global_batch_size_counts_data_parallel_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # data_parallel_shard_degree -1 -> 2
    assert "(2) x data-parallel degree (2) = 4, got 6" in _refused_line(
        "--training.global_batch_size", "6")
    _parse("--training.global_batch_size", "8")


def test_seed_checkpoint_needs_one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = _refused_line("--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    assert "checkpoint.create_seed_checkpoint needs a single process" in line
    monkeypatch.setenv("WORLD_SIZE", "1")
    _parse("--checkpoint.enable", "--checkpoint.create_seed_checkpoint")


def test_compile_enable_without_components(base):
    cfg = copy.deepcopy(base)
    cfg.compile.enable, cfg.compile.components = True, []
    with pytest.raises(ConfigError, match="compile.components is empty"):
        U.check_values(cfg, V.Context(1, resolved_degrees(cfg, 1)))


def test_profiling_needs_a_gpu_and_a_fitting_schedule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a visible GPU" in _refused_line("--profiling.enable_profiling")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    line = _refused_line("--profiling.enable_profiling", "--profiling.profile_freq", "3")
    assert "profile_freq (3) >= profiler_warmup (3) + profiler_active (1)" in line
    _parse("--profiling.enable_profiling", "--profiling.profile_freq", "4")


# ----------------------------------------------------------------- float8 on a (pretend) GPU
@pytest.fixture
def on_gpu(monkeypatch):
    """A CUDA job as far as the float8 check can tell: GPU device, torchao importable."""
    monkeypatch.setattr(V.platform, "is_cpu", lambda: False)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setattr(V, "cuda_capability", lambda: (9, 0))
    return monkeypatch


def test_float8_needs_torchao(on_gpu):
    on_gpu.setitem(sys.modules, "torchao", None)  # "import torchao" raises ImportError
    assert "float8 needs torchao, which cannot be imported" in _refused_line(
        "--model.converters", "float8")


def test_float8_encoders_refuse_a_float8_recipe(on_gpu):
    """The encoders' float8 converter scales tensorwise only: a recipe would reach the
    foundation alone, so the pair is refused rather than half applied."""
    _parse("--model.converters", "float8", "--omni.float8_encoders")
    _parse("--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise")
    assert "omni.float8_encoders supports only tensorwise float8" in _refused_line(
        "--model.converters", "float8", "--omni.float8_encoders",
        "--quantize.linear.float8.recipe_name", "rowwise")


def test_float8_needs_compute_capability_8_9(on_gpu):
    _parse("--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output")
    on_gpu.setattr(V, "cuda_capability", lambda: (8, 0))
    line = _refused_line("--model.converters", "float8")
    assert "compute capability >= 8.9" in line and "this one has 8.0" in line
    _parse("--model.converters", "float8", "--quantize.linear.float8.emulate")
    assert "emulated float8 runs eagerly only" in _refused_line(
        "--model.converters", "float8", "--quantize.linear.float8.emulate", "--compile.enable")


def test_compile_refuses_async_ulysses(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = _refused_line("--compile.enable", "--parallelism.ulysses_degree", "2",
                         "--parallelism.ulysses_async")
    assert "compile.enable" in line and "ulysses_async" in line
    _parse("--compile.enable", "--parallelism.ulysses_degree", "2")


def test_cpu_offload_needs_a_gpu_job_with_fsdp(monkeypatch):
    assert "needs a CUDA GPU" in _refused_line("--training.enable_cpu_offload")
    monkeypatch.setattr(V.platform, "is_cpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert "2 or more ranks" in _refused_line("--training.enable_cpu_offload")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _parse("--training.enable_cpu_offload")


def test_per_op_ac_with_expert_parallel_needs_the_experts_outside_fsdp(monkeypatch):
    """Per-op AC ('op', 'attention') with EP: refused where the experts have an FSDP unit of
    their own (4 ranks, EP2: sharded over 2), accepted where they have none (2 ranks, EP2)."""
    moe = str(REPO / "train_configs" / "qwen3_moe_omni_debug.toml")
    for option in ("op", "attention"):
        per_op = ("--job.config_file", moe, "--parallelism.expert_parallel_degree", "2",
                  "--activation_checkpoint.mode", "selective",
                  "--activation_checkpoint.selective_ac_option", option)
        monkeypatch.setenv("WORLD_SIZE", "4")
        line = _refused_line(*per_op)
        assert "selective_ac_option" in line and "= 2 ranks" in line and option in line, line
        monkeypatch.setenv("WORLD_SIZE", "2")
        _parse(*per_op)
    # CPU offload keeps the experts in FSDP (it must move them), one expert-FSDP rank or not
    monkeypatch.setattr(V.platform, "is_cpu", lambda: False)
    line = _refused_line(*per_op, "--training.enable_cpu_offload")
    assert "selective_ac_option" in line and "enable_cpu_offload" in line, line
    monkeypatch.setenv("WORLD_SIZE", "4")
    _parse("--job.config_file", moe, "--parallelism.expert_parallel_degree", "2",
           "--activation_checkpoint.mode", "full")
