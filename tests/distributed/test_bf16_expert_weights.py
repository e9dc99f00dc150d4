"""``optimizer.expert_weights_dtype = "bfloat16"``: the MoE experts' weights stored in bfloat16
and updated by the compiled AdamW kernel in float32, stored rounded stochastically
(``components.expert_weights``, ``components.adam_update``, ``components.optimizer``).

The update against its definition (each stored weight a bfloat16 neighbour of the float32
update, their mean that update); updates under half of bfloat16's spacing that rounding to
nearest drops (torch's fused kernel on a bf16 weight: the premise) accumulating as the float32
weights' do; whole clipped runs against float32 weights (within bfloat16's precision, not bit
for bit); the weights converted in place where the experts cast their own; the float32
moments of bf16 weights through ``load_state_dict`` unrounded; expert-parallel DTensor weights
on two ranks through DCP: a float32 checkpoint loading into bf16 weights, and a bf16 run
resuming bit for bit. Inductor's CPU backend compiles the update."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.harness import REPO, run_distributed, run_train
from torchtitan_omni.components.adam_update import adam_update_, compiled_adam_update
from torchtitan_omni.components.expert_weights import store_expert_weights_in
from torchtitan_omni.components.optimizer import LocalShardAdamW, clip_gradients_
from torchtitan_omni.modules.moe import EXPERT_WEIGHTS, GroupedExperts

BF16 = torch.bfloat16
#: bfloat16's spacing just below 1
ULP_BELOW_ONE = 2.0 ** -8


def _first_step(update, n: int, lr: float, seed_step: float):
    # Adam's first step with a constant gradient moves each weight by lr (m/sqrt(v) = 1)
    param = torch.ones(n, dtype=BF16)
    grad = torch.full((n,), 1e-3, dtype=BF16)
    m, v = torch.zeros(n), torch.zeros(n)
    update(param, grad, m, v, torch.tensor(seed_step), None, lr=lr, beta1=0.9, beta2=0.999,
           eps=0.0, weight_decay=0.0, decoupled_weight_decay=True, maximize=False)
    return param


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_weight_lands_on_a_neighbour_of_the_float32_update_with_its_mean(compiled):
    """A step of 0.3 of bfloat16's spacing from 1: every stored weight is 1 or the next
    bfloat16 below, their mean over 200,000 elements the float32 update within 5 standard
    deviations of the draws' mean (rounding to nearest would give 1 everywhere, 0.3 spacings
    off), and another step count draws other bits."""
    torch._dynamo.reset()
    update = compiled_adam_update() if compiled else adam_update_
    n, frac = 200_000, 0.3
    got = _first_step(update, n, frac * ULP_BELOW_ONE, 1.0)
    assert got.dtype == BF16
    assert set(got.float().unique().tolist()) == {1.0, 1.0 - ULP_BELOW_ONE}
    exact = 1.0 - frac * ULP_BELOW_ONE
    sd = ULP_BELOW_ONE * math.sqrt(frac * (1 - frac) / n)
    assert abs(got.double().mean().item() - exact) < 5 * sd
    again = _first_step(update, n, frac * ULP_BELOW_ONE, 1.0)
    other = _first_step(update, n, frac * ULP_BELOW_ONE, 2.0)
    assert torch.equal(got, again) and not torch.equal(got, other)


def _descent(weights: torch.dtype, compiled: bool, steps: int, n: int = 16_384):
    # AdamW from weights of 1 with a constant gradient: each step moves a weight by about lr
    param = torch.nn.Parameter(torch.ones(n, dtype=weights))
    opt = LocalShardAdamW([param], lr=0.1 * ULP_BELOW_ONE, betas=(0.9, 0.999), eps=1e-12,
                          weight_decay=0.0, fused=True)
    if compiled:
        opt.compile_updates(min_numel=1)
    for _ in range(steps):
        param.grad = torch.full((n,), 1e-3, dtype=weights)
        opt.step()
    return param.detach()


def test_small_updates_accumulate_where_rounding_to_nearest_freezes():
    """200 steps of a tenth of bfloat16's spacing each: torch's fused kernel on bf16 weights
    rounds every one away (the weights stay 1: the premise), the compiled update's bf16
    weights descend on average as the float32 weights do (within 2% of the 20 spacings)."""
    torch._dynamo.reset()
    steps = 200
    frozen = _descent(BF16, compiled=False, steps=steps)
    assert torch.equal(frozen, torch.ones_like(frozen))
    exact = _descent(torch.float32, compiled=True, steps=steps)
    got = _descent(BF16, compiled=True, steps=steps)
    moved = 1.0 - exact.double().mean().item()
    assert moved == pytest.approx(steps * 0.1 * ULP_BELOW_ONE, rel=0.01)
    assert 1.0 - got.double().mean().item() == pytest.approx(moved, rel=0.02)


SHAPES = ((64, 48), (32, 16, 8), (40,))


def _run(weights: torch.dtype, moments: torch.dtype | None, steps: int = 30):
    """``steps`` clipped AdamW steps from the same start and gradients (bf16 gradients for
    bf16 weights); returns the start, the weights and the optimizer."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    # a start bfloat16 holds, so both runs start from the same values
    start = [torch.randn(*s, generator=g).to(BF16).float() for s in SHAPES]
    params = [torch.nn.Parameter(s.clone().to(weights)) for s in start]
    opt = LocalShardAdamW(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, fused=True)
    opt.compile_updates(min_numel=100)
    if moments is not None:
        opt.keep_moments_in(moments)
    for step in range(steps):
        opt.zero_grad()
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (1 + step % 3)).to(BF16).to(weights)
        opt.scale_grads_in_next_step(torch.tensor(0.7))
        opt.step()
    return start, params, opt


@pytest.mark.parametrize("moments", [None, BF16], ids=["float32_moments", "bf16_moments"])
def test_bf16_weights_follow_float32_weights_up_to_unbiased_rounding_noise(moments):
    """30 clipped steps with bf16 weights against float32 weights from the same start and
    gradients (steps of about a bfloat16 spacing, where rounding matters most): every tensor,
    the 40-element one too, goes to the compiled kernel and stays bf16. The bf16 weights
    differ from the float32 ones by rounding noise: no bias (the mean difference within 4
    standard errors of 0) and an rms under a random walk of half a spacing a step
    (sqrt(30) x rms spacing / 2). The moments are float32 (or bf16, as kept), within 5% in
    norm."""
    steps = 30
    start, ref, ref_opt = _run(torch.float32, moments, steps)
    _, got, opt = _run(BF16, moments, steps)
    assert opt.compiled_numel == sum(p.numel() for p in got)
    for i, (s, a, b) in enumerate(zip(start, ref, got)):
        assert b.dtype == BF16
        a, b = a.detach().double(), b.detach().double()
        diff = b - a
        spacing = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), s.abs()))) - 7)
        bound = math.sqrt(steps) * spacing.square().mean().sqrt() / 2
        assert diff.square().mean().sqrt() < bound, (i, float(diff.square().mean().sqrt() / bound))
        standard_error = diff.std() / math.sqrt(diff.numel())
        assert abs(diff.mean()) < 4 * standard_error, (i, float(diff.mean() / standard_error))
        for key in ("exp_avg", "exp_avg_sq"):
            ours, exact = opt.state[got[i]][key], ref_opt.state[ref[i]][key]
            assert ours.dtype == (moments or torch.float32), (i, key)
            rel = (ours.float() - exact.float()).norm() / exact.float().norm()
            assert rel < 0.05, (i, key, float(rel))


def test_a_bf16_weight_the_compiled_kernel_cannot_take_is_refused():
    """A bf16 weight whose update does not fit the compiled kernel (a transposed view) would
    go to torch's fused kernel, which rounds to nearest: the step raises, naming its shape."""
    param = torch.nn.Parameter(torch.randn(8, 100, dtype=BF16).t())
    opt = LocalShardAdamW([param], lr=0.01, fused=True)
    opt.compile_updates()
    param.grad = torch.randn_like(param)
    with pytest.raises(RuntimeError, match=r"a torch.bfloat16 parameter's moments are in "
                                           r"torch.float32 but its update does not fit the "
                                           r"compiled kernel \(shape \(100, 8\)"):
        opt.step()


def test_float32_moments_of_bf16_weights_load_unrounded():
    """torch's ``load_state_dict`` casts state to the parameter's dtype, which would round a
    bf16 weight's float32 moments: they load as saved, bit for bit, and the next step of the
    loaded optimizer equals the original's."""
    _, params, opt = _run(BF16, None, steps=3)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = LocalShardAdamW(clones, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, fused=True)
    loaded.compile_updates(min_numel=100)
    # a copy, as a checkpoint holds (torch's load_state_dict keeps the tensors it is given)
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, clones):
        for key in ("exp_avg", "exp_avg_sq"):
            assert loaded.state[q][key].dtype == torch.float32
            assert torch.equal(loaded.state[q][key], opt.state[p][key]), key
    for o, ps in ((opt, params), (loaded, clones)):
        for i, p in enumerate(ps):
            p.grad = torch.full(p.shape, 0.01 * (i + 1), dtype=BF16)
        o.step()
    for p, q in zip(params, clones):
        assert torch.equal(p, q)


# --- the experts' weights converted where they cast their own

DIM, HIDDEN, EXPERTS = 16, 24, 4


def _experts(compute_dtype: torch.dtype | None = BF16) -> GroupedExperts:
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for which in EXPERT_WEIGHTS:
            w = getattr(experts, which)
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    experts.compute_dtype = compute_dtype
    return experts


def test_expert_weights_are_converted_in_place():
    """The parameters the optimizer already holds become bf16 (the float32 values rounded to
    nearest) and are what the optimizer then steps; a forward reads them as they are."""
    experts = _experts()
    before = {w: getattr(experts, w).detach().clone() for w in EXPERT_WEIGHTS}
    params = list(experts.parameters())
    opt = LocalShardAdamW(params, lr=0.01, fused=True)
    opt.compile_updates()
    numel = store_expert_weights_in([experts], None, BF16)
    assert numel == 3 * EXPERTS * DIM * HIDDEN
    for which, p in zip(("w1", "w2", "w3"), params):
        assert getattr(experts, which) is p and p.dtype == BF16
        assert torch.equal(p.detach(), before[which].to(BF16))
    counts = torch.tensor([3, 0, 2, 1])
    out = experts(torch.randn(6, DIM), counts)
    out.float().square().sum().backward()
    assert all(p.grad.dtype == BF16 for p in params)
    opt.step()
    assert all(p.dtype == BF16 for p in params) and opt.compiled_numel == numel


def test_expert_weights_refused_while_a_state_dict_holds_the_old_ones():
    """A state dict taken before the conversion (TorchTitan's checkpoint model wrapper keeps
    one from its construction) would go on holding, and saving, the float32 weights: refused,
    naming the module and how many tensors hold them; taken after, it holds the bf16 ones."""
    experts = _experts()
    state = experts.state_dict()
    with pytest.raises(RuntimeError, match=r"^experts: 3 other tensor\(s\) still hold the "
                                           r"weights in their old dtype"):
        store_expert_weights_in([experts], None, BF16)
    assert state["w1"].dtype == torch.float32
    del state
    fresh = _experts()
    store_expert_weights_in([fresh], None, BF16)
    assert all(v.dtype == BF16 for v in fresh.state_dict().values())


def test_torchtitans_inert_checkpointer_holds_the_weights_until_dropped():
    """What the trainer relies on: the inert checkpoint manager TorchTitan's trainer builds
    (checkpointing off) still keeps the model's state dict, so a conversion while it lives is
    refused; once ``drop_titan_checkpointer`` lets it go, the conversion goes through."""
    import gc
    import types

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import Checkpoint

    from torchtitan_omni.checkpoint import drop_titan_checkpointer

    experts = _experts()
    trainer = types.SimpleNamespace(checkpointer=CheckpointManager(
        dataloader=None, model_parts=[experts], optimizers=None, lr_schedulers=None, states={},
        checkpoint_config=Checkpoint(enable=False), sd_adapter=None))
    with pytest.raises(RuntimeError, match="still hold the weights in their old dtype"):
        store_expert_weights_in([experts], None, BF16)
    drop_titan_checkpointer(trainer)
    gc.collect()
    assert trainer.checkpointer is None
    experts = _experts()
    trainer.checkpointer = CheckpointManager(
        dataloader=None, model_parts=[experts], optimizers=None, lr_schedulers=None, states={},
        checkpoint_config=Checkpoint(enable=False), sd_adapter=None)
    drop_titan_checkpointer(trainer)
    gc.collect()
    assert store_expert_weights_in([experts], None, BF16) == 3 * EXPERTS * DIM * HIDDEN


def test_expert_weights_refused_where_no_expert_casts_or_computes_in_another_dtype():
    with pytest.raises(ValueError, match="no MoE experts here cast their own weights"):
        store_expert_weights_in([_experts(None)], None, BF16)
    with pytest.raises(ValueError, match=r"compute in torch.float16, not torch.bfloat16"):
        store_expert_weights_in([_experts(torch.float16)], None, BF16)
    # with FSDP off, an autocast to bf16 makes the experts cast their own weights
    experts = _experts(None)
    assert store_expert_weights_in([experts], BF16, BF16) > 0
    assert experts.compute_dtype == BF16 and experts.w1.dtype == BF16


def _expert_parallel_resume(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    local = torch.tensor([5, 10]) if rank == 0 else torch.tensor([0, 7])

    def make(weights: torch.dtype):
        experts = _experts()
        for which in EXPERT_WEIGHTS:  # the experts split over the ranks, as expert parallel
            full = getattr(experts, which).detach()
            setattr(experts, which, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
        del full  # the shards may be views of it: it would hold the weights being converted
        opt = LocalShardAdamW(experts.parameters(), lr=0.05, fused=True)
        opt.compile_updates(min_numel=1)
        if weights == BF16:
            store_expert_weights_in([experts], None, BF16)
        return experts, opt

    def step(experts, opt, k: int) -> None:
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * k + rank)
        x = torch.randn(int(local.sum()), DIM, generator=g)
        checkpoint(experts, x, local, use_reentrant=False).float().square().sum().backward()
        clip_gradients_([opt], list(experts.parameters()), 0.05)
        opt.step()

    def save(experts, opt, name: str) -> None:
        dcp.save({"model": get_model_state_dict(experts),
                  "optim": get_optimizer_state_dict(experts, opt)},
                 checkpoint_id=f"{folder}/{name}")

    def load(experts, opt, name: str) -> None:
        state = {"model": get_model_state_dict(experts),
                 "optim": get_optimizer_state_dict(experts, opt)}
        dcp.load(state, checkpoint_id=f"{folder}/{name}")
        set_model_state_dict(experts, state["model"])
        set_optimizer_state_dict(experts, opt, state["optim"])

    out = {}
    # a float32 run's checkpoint into bf16 weights: the weights rounded, the moments as saved
    f32, f32_opt = make(torch.float32)
    for k in range(2):
        step(f32, f32_opt, k)
    save(f32, f32_opt, "f32")
    b16, b16_opt = make(BF16)
    load(b16, b16_opt, "f32")
    out["weights_rounded"] = all(
        q.dtype == BF16 and torch.equal(q.to_local(), p.to_local().to(BF16))
        for p, q in zip(f32.parameters(), b16.parameters()))
    out["moments_as_saved"] = all(
        torch.equal(b16_opt.state[q][key].to_local(), f32_opt.state[p][key].to_local())
        for p, q in zip(f32.parameters(), b16.parameters()) for key in ("exp_avg", "exp_avg_sq"))
    # a bf16 run saved after two steps and resumed: its third step, bit for bit
    run, run_opt = make(BF16)
    for k in range(2):
        step(run, run_opt, k)
    save(run, run_opt, "b16")
    step(run, run_opt, 2)
    resumed, resumed_opt = make(BF16)
    load(resumed, resumed_opt, "b16")
    step(resumed, resumed_opt, 2)
    out["resumed"] = all(p.dtype == BF16 and torch.equal(p.to_local(), q.to_local())
                         for p, q in zip(run.parameters(), resumed.parameters()))
    out["moved"] = not all(torch.equal(p.to_local(), q.to_local())
                           for p, q in zip(run.parameters(), b16.parameters()))
    return out


def test_expert_parallel_bf16_weights_load_float32_checkpoints_and_resume_through_dcp(tmp_path):
    """Experts over 2 ranks (DTensor weights; one rank without rows for an expert), clipped
    steps: a float32 run's DCP checkpoint loads into bf16 weights as their rounding, its
    float32 moments unrounded; a bf16 run saved after two steps and resumed gives the third
    step's weights of the run that went on, bit for bit."""
    for rank, r in enumerate(run_distributed(_expert_parallel_resume, 2, str(tmp_path))):
        assert r == {"weights_rounded": True, "moments_as_saved": True, "resumed": True,
                     "moved": True}, (rank, r)


@pytest.mark.slow
def test_trainer_refuses_bf16_expert_weights_where_no_expert_casts_its_weights():
    """On CPU the experts compute in float32: the key is refused at start-up with one line
    naming it, not ignored."""
    run = run_train(REPO / "train_configs" / "qwen3_moe_omni_debug.toml", 1,
                    "--training.steps", "1", "--lr_scheduler.warmup_steps", "1",
                    "--compile.enable", "--compile.components", "optimizer",
                    "--optimizer.implementation", "fused",
                    "--optimizer.expert_weights_dtype", "bfloat16",
                    "--job.dump_folder", "outputs/test_bf16_expert_weights_refused")
    assert "cast their own weights" in run.refusal("optimizer.expert_weights_dtype 'bfloat16'")
