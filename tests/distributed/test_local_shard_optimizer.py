"""``components.optimizer``: Adam/AdamW stepping on FSDP2's local shards against torch's own
optimizers stepping the same DTensor parameters (DTensor's dispatch), and the gradient clipping
on local shards against torch's ``clip_grad_norm_`` of the full (unsharded) model in one
process, float64. "compiled" is the fused implementation with its larger tensors updated by
the compiled kernel (``components.adam_update``; inductor's CPU backend here), against torch's
fused optimizer."""

from __future__ import annotations

import torch

from tests.harness import run_distributed

IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
#: local shards of at least this many elements take the compiled update in the "compiled" cases:
#: the first two weights (48/36 and 21/14 elements on the two ranks); biases and the last
#: weight stay with torch's fused kernel
COMPILED_MIN_NUMEL = 14


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # an odd row count: FSDP2 pads the last rank's shard
    return torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.GELU(), torch.nn.Linear(7, 5),
                               torch.nn.Linear(5, 3, bias=False)).double()


def _sharded(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = _model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _grads(model: torch.nn.Module, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 12, generator=g, dtype=torch.float64)
    model(x).square().sum().backward()


def _optimizers_agree(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from torchtitan_omni.components.optimizer import LocalShardAdam, LocalShardAdamW

    out = {}
    for name, ours_cls, torch_cls in (("AdamW", LocalShardAdamW, torch.optim.AdamW),
                                      ("Adam", LocalShardAdam, torch.optim.Adam)):
        for impl in IMPLEMENTATIONS + ("compiled",):
            if name == "Adam" and impl not in ("fused", "compiled"):
                continue
            kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                      "fused": impl in ("fused", "compiled"), "foreach": impl == "foreach",
                      # Adam's compiled case also climbs (the gradient negated)
                      "maximize": name == "Adam" and impl == "compiled"}
            ours_model, ref_model = _sharded(world), _sharded(world)
            ours, ref = ours_cls(ours_model.parameters(), **kwargs), torch_cls(
                ref_model.parameters(), **kwargs)
            if impl == "compiled":
                ours.compile_updates(min_numel=COMPILED_MIN_NUMEL)
            for step in range(3):
                for model, opt in ((ours_model, ours), (ref_model, ref)):
                    opt.zero_grad()
                    _grads(model, step, rank)
                    # a schedule: the compiled update must take each step's rate
                    opt.param_groups[0]["lr"] = 0.05 / (step + 1)
                    opt.step()
            worst = max((a.full_tensor() - b.full_tensor()).abs().max().item()
                        for a, b in zip(ours_model.parameters(), ref_model.parameters()))
            moved = max((a.full_tensor() - b).abs().max().item()
                        for a, b in zip(ours_model.parameters(), _model().parameters()))
            ours_state, ref_state = ours.state_dict()["state"], ref.state_dict()["state"]
            state_worst = 0.0
            kinds_match = ours_state.keys() == ref_state.keys()
            for i in ref_state:
                kinds_match &= ours_state[i].keys() == ref_state[i].keys()
                for key, value in ref_state[i].items():
                    mine = ours_state[i][key]
                    kinds_match &= (type(mine) is type(value) and mine.dtype == value.dtype
                                    and mine.device == value.device)
                    full = (lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
                    state_worst = max(state_worst, (full(mine) - full(value)).abs().max().item())
            out[f"{name}/{impl}"] = {"worst": worst, "moved": moved, "state_worst": state_worst,
                                     "kinds_match": bool(kinds_match),
                                     "compiled_numel": getattr(ours, "compiled_numel", 0)}
    return out


def test_local_shard_adam_steps_as_torch_does_on_the_dtensors():
    for rank, rank_out in enumerate(run_distributed(_optimizers_agree, 2)):
        assert len(rank_out) == 6, rank_out
        for case, r in rank_out.items():
            assert r["moved"] > 1e-3, (case, "the parameters did not move")
            assert r["worst"] <= 1e-12, (case, r)
            assert r["state_worst"] <= 1e-12, (case, r)
            assert r["kinds_match"], (case, "the state differs in keys, types or dtypes")
            # the compiled cases' first two weights (48 + 21 or 36 + 14 elements a rank)
            expected = {0: 69, 1: 50}[rank] if case.endswith("/compiled") else 0
            assert r["compiled_numel"] == expected, (case, r)


def _clip_agrees(rank: int, world: int) -> dict:
    from torchtitan_omni.distributed.utils import clip_grad_norm_

    out = {}
    for max_norm in (1e-3, 1e6):  # clipping, and a bound above the norm (no change)
        model, ref = _sharded(world), _model()
        _grads(model, 0, rank)
        for r in range(world):  # the reference sees every rank's batch; FSDP averages
            _grads(ref, 0, r)
        for q in ref.parameters():
            q.grad /= world
        norm = clip_grad_norm_(list(model.parameters()), max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
        worst = max((p.grad.full_tensor() - q.grad).abs().max().item()
                    for p, q in zip(model.parameters(), ref.parameters()))
        scale = max(q.grad.abs().max().item() for q in ref.parameters())
        out[max_norm] = {"norm": float(norm), "ref_norm": float(ref_norm), "worst": worst,
                         "scale": scale}
    return out


def test_clip_on_local_shards_matches_torch_on_the_full_model():
    for rank_out in run_distributed(_clip_agrees, 2):
        for max_norm, r in rank_out.items():
            # the norm is summed in float32 (as before these local shards)
            assert abs(r["norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"], (max_norm, r)
            assert r["worst"] <= 1e-6 * r["scale"], (max_norm, r)
        assert rank_out[1e-3]["ref_norm"] > 1e-3, "the clipping case did not clip"


def _clipped_steps_agree(rank: int, world: int) -> dict:
    from torchtitan_omni.components.optimizer import LocalShardAdamW, clip_gradients_
    from torchtitan_omni.distributed.utils import clip_grad_norm_

    out = {}
    for impl in IMPLEMENTATIONS + ("compiled",):
        kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                  "fused": impl in ("fused", "compiled"), "foreach": impl == "foreach"}
        ours_model, ref_model = _sharded(world), _sharded(world)
        ours = LocalShardAdamW(ours_model.parameters(), **kwargs)
        ref = torch.optim.AdamW(ref_model.parameters(), **kwargs)
        if impl == "compiled":  # every tensor: the coefficient multiplies, as clipping does
            ours.compile_updates(min_numel=1)
        norms = []
        # steps 0 and 1 clipped (the coefficient goes into our step); step 2 not clipped, so a
        # coefficient left over from step 1 would show
        for step in range(3):
            for model, opt in ((ours_model, ours), (ref_model, ref)):
                opt.zero_grad()
                _grads(model, step, rank)
                if opt is ours:
                    given = [p.grad.full_tensor().clone() for p in model.parameters()]
                if step < 2 and opt is ours:
                    norms.append(float(clip_gradients_([ours], model.parameters(), 1e-2)))
                elif step < 2:
                    norms.append(float(clip_grad_norm_(list(model.parameters()), 1e-2)))
                opt.step()
            if step == 0:
                # after the step, the gradients are the clipped ones, as clipping first leaves
                # them; the compiled update only reads them (they are as given)
                after = (given if impl == "compiled" else
                         [b.grad.full_tensor() for b in ref_model.parameters()])
                grads_worst = max((a.grad.full_tensor() - b).abs().max().item()
                                  for a, b in zip(ours_model.parameters(), after))
        worst = max((a.full_tensor() - b.full_tensor()).abs().max().item()
                    for a, b in zip(ours_model.parameters(), ref_model.parameters()))
        out[impl] = {"worst": worst, "grads_worst": grads_worst, "norms": norms}
    return out


def test_clipping_coefficient_taken_into_the_next_step_matches_clipping_first():
    for rank_out in run_distributed(_clipped_steps_agree, 2):
        assert sorted(rank_out) == sorted(IMPLEMENTATIONS + ("compiled",))
        for impl, r in rank_out.items():
            ours_norms, ref_norms = r["norms"][0::2], r["norms"][1::2]
            assert min(ref_norms) > 1e-2, (impl, "the gradients were not clipped", r)
            for a, b in zip(ours_norms, ref_norms):
                assert abs(a - b) <= 1e-6 * b, (impl, r)
            # the fused kernel takes the inverse coefficient as a float32 (torch's grad_scale):
            # float32 rounding of these float64 gradients (about 1e-3 each), none elsewhere
            tol = 1e-6 if impl == "fused" else 1e-12
            assert r["worst"] <= tol, (impl, r)
            assert r["grads_worst"] <= tol * 1e-3, (impl, r)


def test_compiled_update_compiles_once_per_size_up_to_the_bound(monkeypatch):
    """A schedule's new learning rate reuses the compiled graphs; the sizes that update the
    most elements in all (three here) get a graph each whatever their shapes and wherever they
    come, every other size one shared graph, and only the tensors at the size bound go to the
    compiled update. Each step calls each graph once, with all its tensors (the three of
    size 2048 together): a call per graph, not per tensor, costs the host."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from torchtitan_omni.components import adam_update
    from torchtitan_omni.components.optimizer import LocalShardAdamW

    monkeypatch.setattr(adam_update, "STATIC_SIZES_MAX", 3)
    monkeypatch.setattr(adam_update, "_compiled", {})
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # sizes 100 and 540 first, then 2048 (four shapes), 1024 and 1536
    shapes = [(100,), (12, 5, 9), (64, 32), (32, 64), (16, 8, 8), (2048,), (32, 32), (48, 32),
              (7,)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = LocalShardAdamW(params, lr=1e-3, fused=True)
    opt.compile_updates(min_numel=50)  # all but the 7-element bias
    update = adam_update.compiled_adam_update()
    compiled, calls = update._update, []

    def counted(params, *args, **kwargs):
        calls.append(sorted(p.numel() for p in params))
        return compiled(params, *args, **kwargs)

    monkeypatch.setattr(update, "_update", counted)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.param_groups[0]["lr"] = 1e-3 / (step + 1)
        calls.clear()
        opt.step()
        assert opt.compiled_numel == sum(p.numel() for p in params[:-1])
        assert sorted(calls) == [[100, 540], [1024] * 2, [1536], [2048] * 3], calls
    assert adam_update.compiled_adam_update().static_sizes == {2048, 1536, 1024}
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


def test_compiled_update_resumes_from_a_state_dict_as_it_ran_on():
    """Two steps, the optimizer's state saved and loaded into a new optimizer over copies of the
    parameters, a third step: the same parameters and state as three steps in one go (the step
    counters and moments the compiled update reads come back as torch's load puts them)."""
    from torchtitan_omni.components.optimizer import LocalShardAdamW

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64))
                for s in ((40, 30), (6, 5, 7), (9,))]

    def grads(ps, step: int) -> None:
        g = torch.Generator().manual_seed(10 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)

    def make(ps):
        opt = LocalShardAdamW(ps, lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
        opt.compile_updates(min_numel=100)  # the two weights; the bias goes to the fused kernel
        return opt

    straight = params()
    straight_opt = make(straight)
    for step in range(3):
        grads(straight, step)
        straight_opt.step()

    first = params()
    opt = make(first)
    for step in range(2):
        grads(first, step)
        opt.step()
    saved = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = make(resumed)
    opt.load_state_dict(saved)
    grads(resumed, 2)
    opt.step()
    assert opt.compiled_numel == 40 * 30 + 6 * 5 * 7
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)
    ours, ref = opt.state_dict()["state"], straight_opt.state_dict()["state"]
    assert ours.keys() == ref.keys()
    for i in ref:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[i][key], ref[i][key]), (i, key)
            assert ours[i][key].dtype == ref[i][key].dtype
