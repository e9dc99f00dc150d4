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
from torchtitan_omni.components.optimizer import (
    LocalShardAdamW,
    clip_gradients_,
    keep_compute_copies,
)
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
    # no copies, copies, copies holding the (bf16) gradients
    for gradients in (None, False, True):
        experts = _bf16_experts()
        for which in EXPERT_WEIGHTS:  # the experts split over the ranks, as expert parallel
            full = getattr(experts, which).detach()
            setattr(experts, which,
                    torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
        opt = LocalShardAdamW(experts.parameters(), lr=0.05, fused=True)
        opt.compile_updates(min_numel=1)
        if gradients is not None:
            copies = keep_expert_compute_copies([experts], None, gradients=gradients)
            keep_compute_copies([opt], copies.copies)
            copies.refresh()
        norms = []
        for step in range(2):
            opt.zero_grad()
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(int(local.sum()), DIM, generator=g)
            out_rows = checkpoint(experts, x, local, use_reentrant=False)
            out_rows.float().square().sum().backward()
            # the norm over both ranks' experts (the held gradients all-reduced as their
            # DTensor weights' would be); 0.05 clips
            norms.append(float(clip_gradients_([opt], list(experts.parameters()), 0.05)))
            opt.step()
        out[gradients] = {"weights": [p.full_tensor() for p in experts.parameters()],
                          "norms": norms}
        if gradients is not None:
            out[gradients]["fresh"] = all(torch.equal(c, p.to_local().bfloat16())
                                          for p, c in copies.copies.items())
    return out


def test_expert_parallel_weights_keep_their_local_copies():
    """Experts sharded over 2 ranks (DTensor weights, each rank its local experts and rows,
    one rank without rows for an expert), two clipped steps: with copies, and with copies
    holding the gradients, the norms and weights of two steps without, bit for bit; each
    rank's copies are its local weights' cast."""
    for result in run_distributed(_expert_parallel, 2):
        ref = result[None]
        assert min(ref["norms"]) > 0.05, "the steps were not clipped"
        for variant in (False, True):
            got = result[variant]
            assert got["fresh"] and got["norms"] == ref["norms"], variant
            for a, b in zip(ref["weights"], got["weights"]):
                assert torch.equal(a, b), variant


# --- the copies taking the experts' gradients (one gradient a step), float32 weights
# computing in bf16 as on the GPU: a bf16 gradient's float32 cast is exact, so the updates
# must be the same bit for bit

def _bf16_experts() -> GroupedExperts:
    experts = _experts().float()
    experts.compute_dtype = torch.bfloat16
    return experts


def _bf16_pass(experts: GroupedExperts, step: int, compiled: bool = False):
    run = torch.compile(experts, fullgraph=True) if compiled else experts
    x = _rows(step).float().requires_grad_()
    out = checkpoint(run, x, COUNTS, use_reentrant=False)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_copies_taking_the_gradients_match_casting_each_pass(compiled):
    """A checkpointed forward and backward: the same output and input gradient as casting;
    each copy holds a bf16 gradient whose cast is the casting experts' float32 weight
    gradient, bit for bit, and the weights get none."""
    torch._dynamo.reset()
    casting, reading = _bf16_experts(), _bf16_experts()
    keep_expert_compute_copies([reading], None, gradients=True).refresh()
    ref, got = _bf16_pass(casting, 0, compiled), _bf16_pass(reading, 0, compiled)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for which in EXPERT_WEIGHTS:
        held = getattr(reading, f"{which}_compute_copy").grad
        assert getattr(reading, which).grad is None and held.dtype == torch.bfloat16
        assert torch.equal(held.float(), getattr(casting, which).grad), which


def test_a_second_gradient_into_a_copy_raises_until_zero_grad():
    """Two backwards without the optimizer's zero_grad would sum bf16 gradients: refused with
    the weight's name; after zero_grad (which clears the copies' gradients) a backward runs."""
    experts = _bf16_experts()
    opt = LocalShardAdamW(experts.parameters(), lr=0.05, fused=True)
    copies = keep_expert_compute_copies([experts], None, gradients=True)
    keep_compute_copies([opt], copies.copies)
    copies.refresh()
    _bf16_pass(experts, 0)
    with pytest.raises(RuntimeError, match=r"w\d: a second gradient before the optimizer's"):
        _bf16_pass(experts, 1)
    opt.zero_grad()
    assert all(c.grad is None for c in copies.copies.values())
    _bf16_pass(experts, 1)
    assert all(c.grad is not None for c in copies.copies.values())


def _clipped_bf16_steps(update: str, gradients: bool | None, steps: int = 3):
    """``steps`` AdamW steps of bf16-computing experts clipped by ``clip_gradients_`` (a norm
    that clips): without copies (None), with copies, with copies holding the gradients; the
    weights, the norms, and whether each copy is its weight's cast after every step."""
    torch._dynamo.reset()
    experts = _bf16_experts()
    opt = LocalShardAdamW(experts.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1,
                          fused=True)
    if update == "compiled":
        opt.compile_updates(min_numel=300)
    copies = None
    if gradients is not None:
        copies = keep_expert_compute_copies([experts], None, gradients=gradients)
        keep_compute_copies([opt], copies.copies)
        copies.refresh()
    norms, fresh = [], []
    for step in range(steps):
        opt.zero_grad()
        _bf16_pass(experts, step)
        norms.append(clip_gradients_([opt], list(experts.parameters()), 0.5))
        opt.step()
        if copies is not None:
            fresh.append(all(torch.equal(c, p.detach().bfloat16())
                             for p, c in copies.copies.items()))
    assert opt.compiled_numel == (3 * EXPERTS * DIM * HIDDEN if update == "compiled" else 0)
    return [p.detach().clone() for p in experts.parameters()], norms, fresh


@pytest.mark.parametrize("update", ["fused", "compiled"])
def test_optimizer_reading_the_copies_gradients_matches_float32_gradients(update):
    """Three clipped steps with the gradients in the copies (bf16, widened by the update;
    normed in float32) against three with float32 gradients, with and without copies: the
    same norms and weights bit for bit, and fresh copies after every step."""
    ref, ref_norms, _ = _clipped_bf16_steps(update, None)
    cast, cast_norms, _ = _clipped_bf16_steps(update, False)
    got, norms, fresh = _clipped_bf16_steps(update, True)
    assert fresh == [True] * 3
    assert min(ref_norms) > 0.5, "the steps were not clipped"
    for n in (cast_norms, norms):
        assert [float(a) for a in n] == [float(a) for a in ref_norms]
    for a, b, c in zip(ref, cast, got):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("seed", range(8))
def test_clipping_norm_with_held_bf16_gradients_is_their_float32_casts_norm(seed):
    """Held bf16 gradients among float32 ones in one group (one GPU: every gradient a plain
    tensor): the norm is that of the float32 casts, bit for bit. The tensors' norms are summed
    in the parameters' order (grouped by dtype, seeds 2, 4 and 6 differ in the last bit)."""
    from torchtitan_omni.distributed.utils import grad_norm_and_clip_coef

    g = torch.Generator().manual_seed(seed)
    # bf16-exact values; the middle gradient large (its own float32), the others small
    grads = [(torch.randn(7, generator=g) * (3.0 if i == 20 else 1e-3)).bfloat16().float()
             for i in range(41)]
    params = [torch.nn.Parameter(torch.zeros(7)) for _ in grads]
    casts = [torch.nn.Parameter(torch.zeros(7)) for _ in grads]
    held = {}
    for i, (p, q, grad) in enumerate(zip(params, casts, grads)):
        q.grad = grad.clone()
        if i == 20:
            p.grad = grad.clone()
        else:
            held[p] = grad.bfloat16()
    got, got_coef = grad_norm_and_clip_coef(params, 1.0, None, held)
    ref, ref_coef = grad_norm_and_clip_coef(casts, 1.0)
    assert got.dtype == torch.float32 and torch.equal(got, ref) and torch.equal(got_coef, ref_coef)


@pytest.mark.slow
def test_trainer_refuses_copies_where_no_expert_casts_its_weights():
    """On CPU the experts compute in float32, their weights' dtype: the key is refused at
    start-up with one line naming it, not ignored."""
    run = run_train(REPO / "train_configs" / "qwen3_moe_omni_debug.toml", 1,
                    "--training.steps", "1", "--lr_scheduler.warmup_steps", "1",
                    "--parallelism.expert_compute_copies",
                    "--job.dump_folder", "outputs/test_compute_copies_refused")
    assert "cast their own weights" in run.refusal("parallelism.expert_compute_copies")
