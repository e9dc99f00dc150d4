"""``run_train.sh`` end to end: each spec's debug config with Ulysses 2 (and, for the MoE spec,
expert parallel 2, with either exact dispatcher: every routed copy, or each token once per
rank; and with full AC, where the experts skip FSDP) on 2 CPU ranks gives the per-step losses
of the single-rank run (the same samples: one data-parallel rank either way) within 1e-4,
under ``--debug.deterministic``.

The chunked expert exchange (``parallelism.expert_dispatch_chunks`` 2) on 4 ranks, everything
on (FSDP with the experts' own efsdp unit, Ulysses, EP 2, capacity-padded dispatch):

- dp_shard 2 x SP 2 x EP 2 with capacity factor 2.0 (copies dropped) against the same layout
  in one chunk: losses within 1e-5, the same drops. Not against one rank: which copies are
  dropped depends on each rank's tokens (its sequence slice, its data-parallel batch) and on
  the capacity they size, and data-parallel ranks read other documents than one rank does.
- SP 4 x EP 2 (one data-parallel rank, so one rank's samples; FSDP over the 4 SP ranks, the
  experts over efsdp 2) with factor 4.0 = experts / top-k (C = a rank's tokens: nothing can be
  dropped, the exact dispatch's step) against the single-rank run within 1e-4.
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.harness import REPO, run_train

STEPS = 3
TOL = 1e-4
CASES = {
    "llama_omni": ("--parallelism.ulysses_degree", "2"),
    "janus": ("--parallelism.ulysses_degree", "2", "--parallelism.ulysses_async"),
    "qwen3_omni": ("--parallelism.ulysses_degree", "2"),
    "qwen3_moe_omni": (
        "--parallelism.ulysses_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
    ),
    # every block checkpointed: the experts skip FSDP (their mesh is one rank: EP2 over both)
    "qwen3_moe_omni:outside_fsdp": (
        "--parallelism.ulysses_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--activation_checkpoint.mode", "full",
    ),
    # the exact dispatcher sending each token once per rank
    "qwen3_moe_omni:tokens": (
        "--parallelism.ulysses_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--parallelism.expert_dispatch", "tokens",
    ),
    # the exact dispatcher gathering the group's tokens (no host read, fixed shapes)
    "qwen3_moe_omni:gather": (
        "--parallelism.ulysses_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--parallelism.expert_dispatch", "gather",
    ),
}


def _run(config, ngpu, tag, *extra):
    args = ("--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", str(STEPS),
            "--debug.deterministic", "--debug.seed", "42",
            "--job.dump_folder", f"outputs/test_parallel_{tag}", *extra)
    run = run_train(config, ngpu, *args)
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("spec", sorted(CASES))
def test_sp_ep_losses_match_single_rank(spec):
    model, _, variant = spec.partition(":")
    config = REPO / "train_configs" / f"{model}_debug.toml"
    if not config.exists():
        pytest.skip(f"{config.relative_to(REPO)} does not exist yet")
    base = _single_rank(model)
    para = _run(config, 2, f"{model}_2{variant}", *CASES[spec])
    if model == "qwen3_moe_omni":  # the trainer logs expert load; exact dispatch drops nothing
        assert "moe: max/mean" in para.output and "dropped 0 (0.00%)" in para.output
    if variant == "tokens":
        assert "each token sent once per rank" in para.output
    if variant == "gather":
        assert "the group's tokens gathered and the results reduce-scattered" in para.output
    if model == "qwen3_moe_omni":  # without AC the experts keep their one-rank FSDP unit
        assert ("Experts outside FSDP" in para.output) == (variant == "outside_fsdp")
    for step in range(1, STEPS + 1):
        assert abs(para.losses[step] - base.losses[step]) <= TOL, (step, base.losses, para.losses)
        for name, value in base.named[step].items():
            if name.endswith("aux"):
                continue  # load balancing is a per-rank mean over each rank's own tokens
            assert abs(para.named[step][name] - value) <= TOL, (step, name, base.named, para.named)


#: a step line's dropped copies (the trainer's MoE summary: summed over all ranks)
_DROPPED = re.compile(r"step:\s*(\d+)\s.*dropped (\d+) ")
MOE_CONFIG = REPO / "train_configs" / "qwen3_moe_omni_debug.toml"
CHUNK_TOL = 1e-5
#: dp_shard 2 x SP 2 x EP 2 on 4 ranks, capacity-padded with drops
DP2_SP2_EP2 = ("--parallelism.ulysses_degree", "2", "--parallelism.expert_parallel_degree", "2",
               "--parallelism.expert_capacity_factor", "2.0")


@functools.cache
def _single_rank(spec: str):
    """The single-rank run of a spec's debug config (shared by the tests of this module)."""
    return _run(REPO / "train_configs" / f"{spec}_debug.toml", 1, f"{spec}_1")


def _dropped(run) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(2)) for m in _DROPPED.finditer(_plain(run.output))}


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _assert_losses(run, base, tol: float) -> None:
    for step in range(1, STEPS + 1):
        assert abs(run.losses[step] - base.losses[step]) <= tol, (step, base.losses, run.losses)
        for name, value in base.named[step].items():
            assert abs(run.named[step][name] - value) <= tol, (step, name, base.named, run.named)


@pytest.mark.slow
def test_chunked_expert_exchange_on_4_ranks_matches_one_chunk():
    one = _run(MOE_CONFIG, 4, "moe_dp2sp2ep2_chunks1", *DP2_SP2_EP2,
               "--parallelism.expert_dispatch_chunks", "1")
    two = _run(MOE_CONFIG, 4, "moe_dp2sp2ep2_chunks2", *DP2_SP2_EP2,
               "--parallelism.expert_dispatch_chunks", "2")
    assert "exchange in 2 overlapped chunks" in two.output, two.output[-3000:]
    dropped = _dropped(one)
    assert sorted(dropped) == list(range(1, STEPS + 1)) and sum(dropped.values()) > 0, dropped
    assert _dropped(two) == dropped
    # the printed losses have 5 decimals: equal values may print one unit apart
    _assert_losses(two, one, CHUNK_TOL + 1e-9)


@pytest.mark.slow
def test_chunked_expert_exchange_without_drops_sp4_ep2_matches_single_rank():
    para = _run(MOE_CONFIG, 4, "moe_sp4ep2_chunks2", "--parallelism.ulysses_degree", "4",
                "--parallelism.expert_parallel_degree", "2",
                "--parallelism.expert_capacity_factor", "4.0",
                "--parallelism.expert_dispatch_chunks", "2")
    assert "exchange in 2 overlapped chunks" in para.output, para.output[-3000:]
    assert set(_dropped(para).values()) == {0}, _dropped(para)
    base = _single_rank("qwen3_moe_omni")
    for step in range(1, STEPS + 1):
        assert abs(para.losses[step] - base.losses[step]) <= TOL, (step, base.losses, para.losses)
        # load balancing is a per-rank mean over each rank's own tokens: not compared
        assert abs(para.named[step]["text"] - base.named[step]["text"]) <= TOL, (
            step, base.named, para.named)
