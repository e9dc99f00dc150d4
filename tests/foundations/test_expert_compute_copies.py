"""``parallelism.expert_compute_copies`` (``components.compute_copies``): MoE experts reading a
compute-dtype copy of their weights that the optimizer keeps, against the same experts casting
their weights in every pass. Float64 weights computing in float32 here (bf16 from float32 on
the GPU, ``tests/test_gpu_fast_paths.py``): the outputs, gradients, updates and copies must
be equal bit for bit, eager and compiled, under activation checkpointing, with the fused and
the compiled update, and for expert-parallel DTensor weights on two ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.harness import REPO, run_distributed, run_train
from torchtitan_omni.components.compute_copies import keep_expert_compute_copies
from torchtitan_omni.components.optimizer import LocalShardAdamW, keep_compute_copies
from torchtitan_omni.modules.moe import EXPERT_WEIGHTS, GroupedExperts

DIM, HIDDEN, EXPERTS = 16, 24, 4
COUNTS = torch.tensor([5, 0, 10, 5])  # an expert without rows: its gradient is zero


def _experts(seed: int = 0) -> GroupedExperts:
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for which in EXPERT_WEIGHTS:
            w = getattr(experts, which)
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.2)
    experts.compute_dtype = torch.float32
    return experts


def _rows(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(int(COUNTS.sum()), DIM, generator=g, dtype=torch.float64)


def _pass(experts: GroupedExperts, x: torch.Tensor, compiled: bool):
    run = torch.compile(experts, fullgraph=True) if compiled else experts
    x = x.clone().requires_grad_()
    out = checkpoint(run, x, COUNTS, use_reentrant=False)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), x.grad, [getattr(experts, w).grad for w in EXPERT_WEIGHTS]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_experts_reading_their_copies_match_casting_each_pass(compiled):
    """A checkpointed forward and backward (the recompute reads the copies again): the same
    output, input gradient and float64 weight gradients as casting; a changed copy changes
    the output (the copies are what the projections read)."""
    torch._dynamo.reset()
    x = _rows(0)
    casting = _experts()
    reading = _experts()
    copies = keep_expert_compute_copies([reading], None)
    assert len(copies) == 3 and copies.numel == sum(p.numel() for p in reading.parameters())
    copies.refresh()
    ref, got = _pass(casting, x, compiled), _pass(reading, x, compiled)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for a, b in zip(ref[2], got[2]):
        assert b.dtype == torch.float64 and torch.equal(a, b)
    with torch.no_grad():
        reading.w2_compute_copy.mul_(2)
    assert not torch.equal(_pass(reading, x, compiled)[0], ref[0])


def _train(update: str, with_copies: bool, steps: int = 3):
    """``steps`` AdamW steps of the experts (clipping coefficient in the step), with or without
    compute copies; the weights, and after each step whether every copy is its weight's cast."""
    torch._dynamo.reset()
    experts = _experts()
    opt = LocalShardAdamW(experts.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1,
                          fused=True)
    if update == "compiled":
        opt.compile_updates(min_numel=300)  # every weight (1,536 elements), copy in the kernel
    copies = None
    if with_copies:
        copies = keep_expert_compute_copies([experts], None)
        keep_compute_copies([opt], copies.copies)
        copies.refresh()
    fresh = []
    for step in range(steps):
        opt.zero_grad()
        _pass(experts, _rows(step), compiled=False)
        opt.scale_grads_in_next_step(torch.tensor(0.5, dtype=torch.float64))
        opt.step()
        if copies is not None:
            fresh.append(all(torch.equal(c, p.detach().float())
                             for p, c in copies.copies.items()))
    return [p.detach().clone() for p in experts.parameters()], fresh, opt.compiled_numel


@pytest.mark.parametrize("update", ["fused", "compiled"])
def test_optimizer_keeps_the_copies_its_weights_cast(update):
    """Three steps with copies against three without: the same weights; after every step each
    copy equals its updated weight's cast (written in the compiled kernel or after the fused
    step)."""
    ref, _, _ = _train(update, with_copies=False)
    got, fresh, compiled_numel = _train(update, with_copies=True)
    assert fresh == [True] * 3
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert compiled_numel == (3 * EXPERTS * DIM * HIDDEN if update == "compiled" else 0)


def _expert_parallel(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    local = torch.tensor([5, 10]) if rank == 0 else torch.tensor([0, 7])
    out = {}
    for with_copies in (False, True):
        experts = _experts()
        for which in EXPERT_WEIGHTS:  # the experts split over the ranks, as expert parallel
            full = getattr(experts, which).detach()
            setattr(experts, which,
                    torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
        opt = LocalShardAdamW(experts.parameters(), lr=0.05, fused=True)
        opt.compile_updates(min_numel=1)
        if with_copies:
            copies = keep_expert_compute_copies([experts], None)
            keep_compute_copies([opt], copies.copies)
            copies.refresh()
        for step in range(2):
            opt.zero_grad()
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(int(local.sum()), DIM, generator=g, dtype=torch.float64)
            checkpoint(experts, x, local, use_reentrant=False).square().sum().backward()
            opt.step()
        out[with_copies] = [p.full_tensor() for p in experts.parameters()]
        if with_copies:
            out["fresh"] = all(torch.equal(c, p.to_local().float())
                               for p, c in copies.copies.items())
    return out


def test_expert_parallel_weights_keep_their_local_copies():
    """Experts sharded over 2 ranks (DTensor weights, each rank its local experts and rows,
    one rank without rows for an expert): two steps with copies give the weights of two steps
    without, and each rank's copies are its local weights' cast."""
    for result in run_distributed(_expert_parallel, 2):
        assert result["fresh"]
        for a, b in zip(result[False], result[True]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_trainer_refuses_copies_where_no_expert_casts_its_weights():
    """On CPU the experts compute in float32, their weights' dtype: the key is refused at
    start-up with one line naming it, not ignored."""
    run = run_train(REPO / "train_configs" / "qwen3_moe_omni_debug.toml", 1,
                    "--training.steps", "1", "--lr_scheduler.warmup_steps", "1",
                    "--parallelism.expert_compute_copies",
                    "--job.dump_folder", "outputs/test_compute_copies_refused")
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines()
             if "torchtitan-omni: error: parallelism.expert_compute_copies" in line]
    assert lines and "cast their own weights" in lines[0], run.output[-2000:]
    assert "torchtitan_omni/" not in run.output.split("torchtitan-omni: error:")[-1]
