"""Start-up checks of parallel layouts: one clear line per misconfiguration (no processes)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import common as C
from torchtitan_omni.config.manager import ConfigError, OmniConfigManager
from torchtitan_omni.config.validate import validate_job_config
from torchtitan_omni.distributed.checks import expert_problem, plan_problem, ulysses_problem
from torchtitan_omni.distributed.encoder_sp import split_bounds
from torchtitan_omni.distributed.ulysses import (
    NCCL_HIGH_PRIORITY_ENV, head_chunks, kv_replication, prefer_high_priority_exchanges,
)
from torchtitan_omni.protocols.media_items import slice_items


def _meta_model(**spec):
    with torch.device("meta"):
        return C.build_model(C.ModelSpec(**spec))


def test_kv_replication_gives_whole_heads():
    for heads, kv, degree in [(4, 1, 2), (8, 2, 4), (6, 2, 3), (12, 4, 6), (32, 8, 8), (4, 4, 2)]:
        rep = kv_replication(heads, kv, degree)
        assert (kv * rep) % degree == 0 and (heads // kv) % rep == 0, (heads, kv, degree, rep)
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"):
        kv_replication(6, 2, 4)


def test_async_head_groups_give_every_rank_whole_heads():
    # automatic: the most of 4 and 2 that fits, else 1
    assert head_chunks(32, 8, 2, 0) == 4  # LLaMA#Omni 8B at SP2
    assert head_chunks(32, 8, 4, 0) == 2  # ... at SP4
    assert head_chunks(16, 4, 2, 0) == 2
    assert head_chunks(4, 1, 2, 0) == 1  # kv repeated to 2 heads: one per rank, no groups
    assert head_chunks(32, 8, 8, 0) == 1
    for heads, kv, degree in [(32, 8, 2), (32, 8, 4), (16, 4, 2), (4, 4, 2), (12, 4, 2)]:
        c = head_chunks(heads, kv, degree, 0)
        rep = kv_replication(heads, kv, degree)
        assert heads % (c * degree) == 0 and (kv * rep) % (c * degree) == 0, (heads, kv, c)
    assert head_chunks(32, 8, 2, 2) == 2  # an explicit count that fits is kept
    with pytest.raises(ValueError, match=r"ulysses_async_head_chunks \(8\) x ulysses_degree "
                                         r"\(2\) must divide the 32 q heads and the 8 kv"):
        head_chunks(32, 8, 2, 8)
    with pytest.raises(ValueError, match="must be >= 0"):
        head_chunks(32, 8, 2, -1)


def test_high_priority_exchanges_unless_the_launch_says(monkeypatch):
    monkeypatch.delenv(NCCL_HIGH_PRIORITY_ENV, raising=False)
    assert prefer_high_priority_exchanges() == "1" and os.environ[NCCL_HIGH_PRIORITY_ENV] == "1"
    monkeypatch.setenv(NCCL_HIGH_PRIORITY_ENV, "0")
    assert prefer_high_priority_exchanges() == "0" and os.environ[NCCL_HIGH_PRIORITY_ENV] == "0"


def test_ulysses_and_expert_messages():
    line = ulysses_problem(6, 2, 4, "llm.layers.0.attention")
    assert "ulysses_degree (4)" in line and "6 q heads" in line and "llm.layers.0.attention" in line
    assert ulysses_problem(4, 1, 4) is None
    line = expert_problem(6, 4, "llm.layers.1.moe.experts")
    assert "expert_parallel_degree (4)" in line and "6" in line and "moe.experts" in line
    assert expert_problem(8, 4) is None


def test_plan_problem_on_meta_models():
    assert plan_problem(_meta_model(n_kv_heads=1), 2, 1) is None
    line = plan_problem(_meta_model(), 3, 1)
    assert "ulysses_degree (3)" in line and "llm.layers.0.attention" in line
    assert plan_problem(_meta_model(moe=True), 2, 2) is None
    line = plan_problem(_meta_model(moe=True), 1, 3)
    assert "expert_parallel_degree (3)" in line and "4 experts" in line
    line = plan_problem(_meta_model(), 1, 2)
    assert "no experts" in line
    assert plan_problem(_meta_model(moe=True), 1, 1, capacity_factor=1.25) is None
    line = plan_problem(_meta_model(), 1, 1, capacity_factor=1.25)
    assert "expert_capacity_factor is 1.25" in line and "no experts" in line


def _config(*args):
    return OmniConfigManager().parse_args(
        ["--job.config_file", "tests/configs/synthetic.toml", *args]
    )


def _refused(cfg, world_size: int, match: str) -> None:
    """``validate_job_config`` refuses ``cfg`` with one line matching ``match``."""
    with pytest.raises(ConfigError, match=match) as e:
        validate_job_config(cfg, world_size=world_size)
    assert "\n" not in str(e.value)


def test_validate_job_config_layouts():
    cfg = _config()
    cfg.parallelism.ulysses_degree = 2
    validate_job_config(cfg, world_size=2)
    validate_job_config(cfg, world_size=4)  # dp_shard -1 -> 2
    cfg.parallelism.data_parallel_shard_degree = 2
    _refused(cfg, 2, "does not match the world size 2")
    cfg.parallelism.data_parallel_shard_degree = -1
    cfg.parallelism.ulysses_degree = 3
    _refused(cfg, 3, "ulysses")
    cfg.parallelism.ulysses_degree = 1
    cfg.parallelism.expert_parallel_degree = 2
    _refused(cfg, 2, "expert_parallel_degree")  # the synthetic model has no experts
    cfg.parallelism.expert_parallel_degree = 1
    for bad in (-1.0, float("nan"), float("inf")):
        cfg.parallelism.expert_capacity_factor = bad
        _refused(cfg, 1, "expert_capacity_factor must be >= 0")
    cfg.parallelism.expert_capacity_factor = 1.0
    # the synthetic model has no experts
    _refused(cfg, 1, "expert_capacity_factor is 1.0 but .* no experts")
    cfg.parallelism.expert_capacity_factor = 0.0
    for bad in (0, -2):
        cfg.parallelism.expert_dispatch_chunks = bad
        _refused(cfg, 1, "expert_dispatch_chunks must be >= 1")
    cfg.parallelism.expert_dispatch_chunks = 2  # with the exact dispatcher (factor 0)
    _refused(cfg, 1, "expert_dispatch_chunks is 2 but expert_capacity_factor is 0")
    cfg.parallelism.expert_dispatch_chunks = 1
    # capacity-padded MoE without expert parallel: nothing to exchange, so chunks are refused
    moe = OmniConfigManager().parse_args(
        ["--job.config_file", "train_configs/qwen3_moe_omni_debug.toml"])
    moe.parallelism.expert_capacity_factor, moe.parallelism.expert_dispatch_chunks = 1.25, 2
    _refused(moe, 1, "expert_dispatch_chunks is 2 but expert_parallel_degree is 1")
    moe.parallelism.expert_parallel_degree = 2
    validate_job_config(moe, world_size=2)
    # keeping the expert exchanges through the recompute: refused where there is none
    moe.parallelism.expert_ac_keep_exchanges = True
    moe.activation_checkpoint.mode = "none"
    _refused(moe, 2, "expert_ac_keep_exchanges needs activation_")
    moe.activation_checkpoint.mode = "full"
    validate_job_config(moe, world_size=2)
    moe.parallelism.expert_parallel_degree, moe.parallelism.expert_dispatch_chunks = 1, 1
    _refused(moe, 2, "expert_ac_keep_exchanges needs expert_parallel_")
    moe.parallelism.expert_ac_keep_exchanges = False
    # the token dispatch: exact and expert-parallel only
    moe.parallelism.expert_dispatch = "tokens"
    _refused(moe, 2, "expert_dispatch 'tokens' needs expert_parallel_")
    moe.parallelism.expert_parallel_degree = 2
    _refused(moe, 2, "'tokens' is exact only, but expert_capacity_factor is 1.25")
    moe.parallelism.expert_capacity_factor = 0.0
    validate_job_config(moe, world_size=2)
    # the gather dispatch alike
    moe.parallelism.expert_dispatch = "gather"
    validate_job_config(moe, world_size=2)
    moe.parallelism.expert_capacity_factor = 1.25
    _refused(moe, 2, "'gather' is exact only, but expert_capacity_factor is 1.25")
    moe.parallelism.expert_capacity_factor, moe.parallelism.expert_parallel_degree = 0.0, 1
    _refused(moe, 2, "expert_dispatch 'gather' needs expert_parallel_")
    # its buffers are sized by training's micro-batch: a larger validation one is refused
    moe.parallelism.expert_parallel_degree = 2
    moe.validation.enable = True
    moe.validation.seq_len = moe.training.seq_len
    moe.validation.local_batch_size = moe.training.local_batch_size
    validate_job_config(moe, world_size=2)
    moe.validation.local_batch_size = 2 * moe.training.local_batch_size
    _refused(moe, 2, "expert_dispatch 'gather' sizes its buffers for a training micro-batch")
    moe.validation.enable = False
    moe.parallelism.expert_parallel_degree, moe.parallelism.expert_dispatch = 2, "tokens"
    # the NVSHMEM exchange: the exact copies dispatcher under EP, where NVSHMEM runs
    moe.parallelism.expert_exchange = "nvshmem"
    _refused(moe, 2, "expert_exchange 'nvshmem' is for the exact dispatcher of routed copies")
    moe.parallelism.expert_dispatch = "copies"
    _refused(moe, 2, "expert_exchange 'nvshmem' cannot run here: needs CUDA; use 'nccl'")
    moe.parallelism.expert_parallel_degree = 1
    _refused(moe, 1, "expert_exchange 'nvshmem' needs expert_parallel_degree > 1")
    moe.parallelism.expert_exchange = "nccl"
    # the encoders' small-call exemption: refused negative; a modifier of encoder AC, so
    # accepted (and without effect) where no encoder is checkpointed, as selective_ac_option is
    cfg.omni.encoder_checkpoint_min_tokens = -1
    _refused(cfg, 1, "encoder_checkpoint_min_tokens must be >= 0")
    cfg.omni.encoder_checkpoint_min_tokens = 1024
    validate_job_config(cfg, world_size=1)
    cfg.omni.encoder_checkpoint_min_tokens = 0
    cfg.activation_checkpoint.mode = "memory_budget"
    _refused(cfg, 1, "memory_budget")
    cfg.activation_checkpoint.mode = "selective"
    cfg.activation_checkpoint.selective_ac_option = "every"
    _refused(cfg, 1, "selective_ac_option")


def test_split_bounds_and_item_slicing():
    assert split_bounds([4, 4, 4, 4], 2) == [0, 2, 4]
    assert split_bounds([12, 2, 2], 2) == [0, 1, 3]
    assert split_bounds([5], 2) == [0, 1, 1]  # one item: the second rank gets none
    media = {
        "patches": torch.arange(10).view(10, 1),
        "grid_thw": torch.tensor([[1, 2, 2], [1, 3, 2]]),
    }
    part = slice_items(media, 1, 2)
    assert part["patches"].flatten().tolist() == [4, 5, 6, 7, 8, 9]
    assert part["grid_thw"].tolist() == [[1, 3, 2]]
    with pytest.raises(ValueError, match="'odd' has 3 rows"):
        slice_items({**media, "odd": torch.zeros(3)}, 0, 1)


def test_a_model_that_refuses_its_args_is_one_config_line_and_a_bug_keeps_its_traceback(
        monkeypatch):
    """Building the model on meta for the plan check: args the model refuses (ValueError) are
    a config error; anything else is a bug and is not swallowed."""
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = _config()
    cfg.parallelism.ulysses_degree = 2
    spec = get_train_spec(cfg.model.name)

    def refuses(args):
        raise ValueError("n_heads (4) must be a multiple of n_kv_heads (3)\nsecond line")

    monkeypatch.setattr(spec, "model_cls", refuses)
    with pytest.raises(ConfigError, match="cannot be built with these settings: n_heads") as e:
        validate_job_config(cfg, world_size=2)
    assert "\n" not in str(e.value)

    def broken(args):
        raise RuntimeError("a bug in the spec")

    monkeypatch.setattr(spec, "model_cls", broken)
    with pytest.raises(RuntimeError, match="a bug in the spec"):
        validate_job_config(cfg, world_size=2)


def test_make_dispatcher_refuses_bad_chunks():
    from torchtitan_omni.distributed.expert_parallel import make_dispatcher
    from torchtitan_omni.distributed.expert_overlap import chunk_widths

    with pytest.raises(ValueError, match="chunks must be >= 1"):
        make_dispatcher(8, 2, None, 1.0, 8, chunks=0)
    with pytest.raises(ValueError, match="need the capacity-padded dispatcher"):
        make_dispatcher(8, 2, None, 0.0, 8, chunks=2)
    # without EP nothing is exchanged: the local capacity dispatcher, unchunked
    assert type(make_dispatcher(8, 2, None, 1.0, 8, chunks=2)).__name__ == "CapacityDispatcher"
    # no divisibility needed: near-equal widths, at most one chunk per slot
    assert chunk_widths(3, 2) == [2, 1] and chunk_widths(3, 4) == [1, 1, 1]
    assert chunk_widths(8, 4) == [2, 2, 2, 2] and chunk_widths(0, 4) == [0]
