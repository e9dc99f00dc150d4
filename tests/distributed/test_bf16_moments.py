"""``optimizer.moments_dtype = "bfloat16"``: AdamW's moments of the tensors the compiled update
takes, kept in bfloat16 and rounded stochastically (``components.adam_update``,
``components.optimizer``). Stochastic rounding against its definition (each result a
neighbour, the mean the exact value); the hash's bits against uniform; the moments against an
exact float64 reference where rounding to nearest would freeze them; whole runs against the
same optimizer with float32 moments (within bfloat16's precision: the two are not meant to
agree bit for bit); the dtype
decided over the whole parameter on two FSDP ranks, and a DCP save and resume there bit for
bit; checkpoints moving between the two dtypes. Inductor's CPU backend compiles the update."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_distributed
from torchtitan_omni.components.adam_update import (
    adam_update_,
    compiled_adam_update,
    round_stochastically,
    rounding_noise,
)
from torchtitan_omni.components.optimizer import LocalShardAdamW

BF16 = torch.bfloat16
#: 1 + 2^-7 is the next bfloat16 after 1: values a quarter, half and most of the way between
FRACTIONS = (0.25, 0.5, 0.9)


def _noise(compiled: bool):
    return (torch.compile(rounding_noise, fullgraph=True, dynamic=True) if compiled
            else rounding_noise)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rounding_noise_is_uniform_and_changes_with_the_seed(compiled):
    """Each half of the hash is uniform over [0, 2^16) (16 bins of 2^20 draws within 5
    standard deviations of their expected count), the halves are uncorrelated, and the next
    seed's bits differ from this seed's (equal in about 1 of 65,536)."""
    torch._dynamo.reset()
    n = 1 << 20
    like = torch.empty(n // 4, 4)
    low, high = _noise(compiled)(like, torch.tensor(7))
    again = _noise(compiled)(like, torch.tensor(7))[0]
    nxt = _noise(compiled)(like, torch.tensor(8))[0]
    assert torch.equal(low, again) and low.shape == like.shape
    for half in (low, high):
        assert int(half.min()) >= 0 and int(half.max()) < 1 << 16
        counts = torch.bincount(half.flatten() >> 12, minlength=16).double()
        assert (counts - n / 16).abs().max() < 5 * math.sqrt(n / 16), counts
    a, b = low.double().flatten(), high.double().flatten()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / math.sqrt(n)
    assert float((low == nxt).double().mean()) < 1e-3


def _fmix32(h: int) -> int:
    # murmur3's 32-bit finalizer in Python integers: the reference of the int32 kernel
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rounding_noise_is_murmur3s_finalizer_in_wrapping_int32(compiled):
    """The int32 arithmetic (products wrapping, shifts made logical) gives murmur3's uint32
    finalizer of index + seed x 0x9E3779B1, bit for bit, for large seeds too."""
    torch._dynamo.reset()
    for seed in (0, 1, 40_000, 2**31 - 1):
        low, high = _noise(compiled)(torch.empty(3, 5), torch.tensor(seed, dtype=torch.int32))
        want = [_fmix32((i + seed * 0x9E3779B1) & 0xFFFFFFFF) for i in range(15)]
        assert low.flatten().tolist() == [h & 0xFFFF for h in want], seed
        assert high.flatten().tolist() == [h >> 16 for h in want], seed


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stochastic_rounding_lands_on_a_neighbour_with_the_exact_mean(compiled):
    """With the hash's bits, every result is one of the two bfloat16 neighbours; over 200,000
    elements the mean is the float32 value within 5 standard deviations of the draws' mean (a
    fixed rounding direction misses it by hundreds); exact bfloat16 values, zero and
    infinities come back unchanged."""
    torch._dynamo.reset()

    def rnd(x, seed):
        return round_stochastically(x, BF16, rounding_noise(x, torch.tensor(seed))[seed % 2])

    rnd = torch.compile(rnd, fullgraph=True, dynamic=True) if compiled else rnd
    n = 200_000
    ulp = 2.0 ** -7
    for seed, sign in enumerate((1.0, -1.0)):
        for frac in FRACTIONS:
            x = torch.full((n,), sign * (1.0 + frac * ulp))
            got = rnd(x, seed)
            assert got.dtype == BF16
            values = set(got.float().unique().tolist())
            assert values <= {sign * 1.0, sign * (1.0 + ulp)}, values
            sd = ulp * math.sqrt(frac * (1 - frac) / n)
            assert abs(got.double().mean().item() - x[0].item()) < 5 * sd, (sign, frac)
    exact = torch.tensor([1.0, -3.0, 0.0, 2.0 ** -100, float("inf"), -float("inf")])
    assert torch.equal(rnd(exact, 0).float(), exact)
    assert rnd(torch.tensor([float("nan")]), 0).isnan().all()


def test_stochastic_rounding_refuses_other_dtypes():
    x = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 to bfloat16 only"):
        round_stochastically(x, BF16, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_second_moment_decays_as_the_exact_one_where_rounding_to_nearest_freezes(compiled):
    """beta2 = 0.999 and no gradient: each step multiplies the second moment by 0.999, a
    change under half of bfloat16's spacing at 1, so rounding to nearest leaves it at 1
    forever. Stored stochastically, its mean over 16,384 elements follows 0.999^step (float64)
    within 1% over 600 steps; the first moment decays likewise with beta1 = 0.99."""
    assert (torch.ones(1, dtype=BF16).float() * 0.999).to(BF16).item() == 1.0  # the premise
    torch._dynamo.reset()
    update = compiled_adam_update() if compiled else adam_update_
    torch.manual_seed(0)
    n, steps = 16_384, 600
    param, grad = torch.zeros(n), torch.zeros(n)
    m, v = torch.ones(n, dtype=BF16), torch.ones(n, dtype=BF16)
    step = torch.tensor(0.0)
    for k in range(1, steps + 1):
        step += 1
        update(param, grad, m, v, step, None, lr=0.0, beta1=0.99, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled_weight_decay=True, maximize=False)
        if k % 200 == 0:
            assert v.double().mean().item() == pytest.approx(0.999 ** k, rel=0.01), k
            assert m.double().mean().item() == pytest.approx(0.99 ** k, rel=0.01), k
    assert m.dtype == v.dtype == BF16


SHAPES = ((64, 48), (32, 16, 8), (40,))
#: the two weights take the compiled update; the 40-element bias stays with torch's fused one
MIN_NUMEL = 100


def _run(moments: torch.dtype | None, held_grads: bool, steps: int = 30):
    """``steps`` clipped AdamW steps on float32 tensors of :data:`SHAPES` from the same
    gradients; with ``held_grads`` the gradients come in bf16 from compute copies, as the
    experts' do. Returns the tensors, the optimizer and the moments."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]
    start = [p.detach().clone() for p in params]
    opt = LocalShardAdamW(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.1, fused=True)
    opt.compile_updates(min_numel=MIN_NUMEL)
    if moments is not None:
        opt.keep_moments_in(moments)
    copies = {}
    if held_grads:
        copies = {p: p.detach().to(BF16).requires_grad_() for p in params[:2]}
        opt.keep_compute_copies(copies)
    torch.manual_seed(11)
    for step in range(steps):
        opt.zero_grad()
        for p in params:
            grad = torch.randn(p.shape, generator=g) * (1 + step % 3)
            if p in copies:
                copies[p].grad = grad.to(BF16)
            else:
                p.grad = grad.to(BF16).float() if held_grads else grad
        opt.scale_grads_in_next_step(torch.tensor(0.7))
        opt.step()
    return start, params, opt


@pytest.mark.parametrize("held_grads", [False, True], ids=["float32_grads", "bf16_held_grads"])
def test_bf16_moments_follow_float32_moments(held_grads):
    """30 clipped steps with the moments in bfloat16 against the same steps with float32
    moments: the large tensors' moments are bfloat16, the bias's float32 and its values equal
    bit for bit; the tensors end within 1% of how far they moved, the moments within 2% (in
    norm), and the compute copies are the updated weights' casts."""
    start, ref, ref_opt = _run(None, held_grads)
    _, got, opt = _run(BF16, held_grads)
    assert opt.compiled_numel == ref_opt.compiled_numel == 64 * 48 + 32 * 16 * 8
    for i, (s, a, b) in enumerate(zip(start, ref, got)):
        moved = (a - s).norm()
        assert (b - a).norm() < 0.01 * moved, (i, float((b - a).norm() / moved))
        for key in ("exp_avg", "exp_avg_sq"):
            ours, exact = opt.state[b][key], ref_opt.state[a][key]
            if i < 2:
                assert ours.dtype == BF16 and exact.dtype == torch.float32
                err = (ours.float() - exact).norm() / exact.norm()
                assert err < 0.02, (i, key, float(err))
            else:
                assert ours.dtype == torch.float32 and torch.equal(ours, exact)
    if held_grads:
        for p, c in opt._compute_copies.items():
            assert torch.equal(c.detach(), p.detach().to(BF16))


def test_bf16_moments_need_the_compiled_update():
    opt = LocalShardAdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1, fused=True)
    with pytest.raises(ValueError, match="need the compiled update"):
        opt.keep_moments_in(BF16)
    opt.compile_updates()
    with pytest.raises(ValueError, match="only"):
        opt.keep_moments_in(torch.float16)


def test_bf16_moments_of_a_tensor_the_compiled_kernel_cannot_take_are_refused():
    """A parameter large enough for bf16 moments whose update does not fit the compiled kernel
    (not contiguous: a transposed view) would go to torch's fused kernel, which keeps moments
    in the parameter's dtype: the step raises, naming the shape, instead of mixing dtypes."""
    param = torch.nn.Parameter(torch.randn(8, MIN_NUMEL).t())
    assert not param.is_contiguous()
    opt = LocalShardAdamW([param], lr=0.01, fused=True)
    opt.compile_updates(min_numel=MIN_NUMEL)
    opt.keep_moments_in(BF16)
    param.grad = torch.randn_like(param)
    with pytest.raises(RuntimeError, match=r"moments are in torch.bfloat16 but its update does "
                                           r"not fit the compiled kernel \(shape \(%d, 8\)"
                                           % MIN_NUMEL):
        opt.step()


def test_checkpoints_move_between_moment_dtypes():
    """torch's ``load_state_dict`` casts moments to their parameter's dtype: an optimizer
    keeping bf16 moments casts them back (a float32 checkpoint's rounded to nearest, a bf16
    one's exactly), and one keeping float32 moments takes a bf16 checkpoint's exactly."""
    _, params, f32 = _run(None, held_grads=False, steps=3)
    _, _, b16 = _run(BF16, held_grads=False, steps=3)

    def fresh(moments):
        opt = LocalShardAdamW([torch.nn.Parameter(p.detach().clone()) for p in params],
                              lr=0.01, fused=True)
        opt.compile_updates(min_numel=MIN_NUMEL)
        if moments is not None:
            opt.keep_moments_in(moments)
        return opt

    for source, moments in ((f32, BF16), (b16, BF16), (b16, None)):
        opt = fresh(moments)
        opt.load_state_dict(source.state_dict())
        saved, loaded = source.state_dict()["state"], opt.state_dict()["state"]
        for i in saved:
            for key in ("exp_avg", "exp_avg_sq"):
                want_dtype = BF16 if moments is not None and i < 2 else torch.float32
                assert loaded[i][key].dtype == want_dtype, (i, key)
                assert torch.equal(loaded[i][key], saved[i][key].to(want_dtype)), (i, key)


def _sharded(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    # 9 rows over 2 ranks: shards of 5 x 12 = 60 and 4 x 12 = 48 elements of a 108-element
    # weight, both under MIN_NUMEL (100); the second weight (27) is under it whole
    model = torch.nn.Sequential(torch.nn.Linear(12, 9, bias=False),
                                torch.nn.Linear(9, 3, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sharded_step(model, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    opt.zero_grad()
    model(torch.randn(4, 12, generator=g)).square().sum().backward()
    torch.manual_seed(1000 + step)  # the stochastic rounding's draws, alike in both runs
    opt.step()


def _sharded_resume(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def make():
        model = _sharded(world)
        opt = LocalShardAdamW(model.parameters(), lr=0.05, fused=True)
        opt.compile_updates(min_numel=MIN_NUMEL)
        opt.keep_moments_in(BF16)
        return model, opt

    model, opt = make()
    for step in range(2):
        _sharded_step(model, opt, step, rank)
    dtypes = [str(opt.state[p]["exp_avg"].to_local().dtype) for p in model.parameters()]
    numel = opt.compiled_numel
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=folder)
    _sharded_step(model, opt, 2, rank)
    straight = [p.to_local().clone() for p in model.parameters()]
    straight_moments = [opt.state[p]["exp_avg_sq"].to_local().clone() for p in model.parameters()]

    resumed, ropt = make()
    state = {"model": get_model_state_dict(resumed),
             "optim": get_optimizer_state_dict(resumed, ropt)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, ropt, state["optim"])
    loaded = [str(ropt.state[p]["exp_avg"].to_local().dtype) for p in resumed.parameters()]
    _sharded_step(resumed, ropt, 2, rank)
    same = all(torch.equal(a, b.to_local()) for a, b in zip(straight, resumed.parameters()))
    same_moments = all(torch.equal(a, ropt.state[p]["exp_avg_sq"].to_local())
                       for a, p in zip(straight_moments, resumed.parameters()))
    return {"dtypes": dtypes, "loaded": loaded, "numel": numel, "same": same,
            "same_moments": same_moments}


def test_moments_dtype_is_the_whole_parameters_and_resumes_through_dcp(tmp_path):
    """Two FSDP ranks: a 108-element weight (above the bound) whose shards (60 and 48
    elements) are each under it keeps bf16 moments on both ranks, the 27-element one float32
    on both; saved through DCP after two steps and resumed into a fresh model and optimizer,
    the third step gives the same shards and moments as the run that went on, bit for bit."""
    results = run_distributed(_sharded_resume, 2, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32"], (rank, r)
        assert r["loaded"] == r["dtypes"], (rank, r)
        assert r["numel"] == (60 if rank == 0 else 48), (rank, r)
        assert r["same"] and r["same_moments"], (rank, r)
