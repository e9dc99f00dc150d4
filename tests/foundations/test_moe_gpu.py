"""The grouped-GEMM expert path (CUDA, bf16) against the exact per-expert loop and a float64
reference, with uneven and empty expert groups; and a Qwen3-MoE foundation in bf16 on CUDA
against float32."""

from __future__ import annotations

import pytest
import torch

from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.moe import GroupedExperts, MoE

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_grouped_mm_matches_loop_with_uneven_and_empty_groups():
    torch.manual_seed(0)
    E, D, H = 8, 256, 128
    experts = GroupedExperts(D, H, E)
    with init_context(experts, seed=1):
        experts.init_weights(0.05)
    counts = torch.tensor([0, 7, 1, 33, 0, 130, 5, 80])  # not multiples of 8 or 16, two empty
    x = torch.randn(int(counts.sum()), D, dtype=torch.float64)

    ref_x = x.clone().requires_grad_()
    ref = experts.double()(ref_x, counts)  # CPU float64 loop
    g = torch.randn_like(ref)
    ref.backward(g)
    ref_grads = [ref_x.grad] + [p.grad.clone() for p in experts.parameters()]

    gpu = experts.to("cuda", torch.bfloat16)
    results = {}
    for grouped in (True, False):
        gpu.zero_grad()
        gpu.use_grouped_mm = None if grouped else False
        xg = x.to("cuda", torch.bfloat16).requires_grad_()
        out = gpu(xg, counts.cuda())
        out.backward(g.to("cuda", torch.bfloat16))
        results[grouped] = [out, xg.grad] + [p.grad.clone() for p in gpu.parameters()]
    for name, a, b, r in zip(["out", "x", "w1", "w2", "w3"], results[True], results[False],
                             [ref] + ref_grads):
        assert _rel(a, r.to(a.device)) < 2e-2, (name, _rel(a, r.to(a.device)))
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))
    # empty experts get exactly zero gradient
    for p_grad in results[True][2:]:
        assert p_grad[0].abs().sum() == 0 and p_grad[4].abs().sum() == 0


def test_moe_layer_in_bf16_on_cuda_matches_float64():
    torch.manual_seed(0)
    moe = MoE(dim=128, hidden_dim=64, num_experts=16, top_k=4)
    with init_context(moe, seed=2):
        moe.init_weights(0.05, 0.05)
    x = torch.randn(3, 50, 128, dtype=torch.float64)
    ref, _ = moe.double()(x)  # MoE returns (output, routing statistics)
    out, _ = moe.to("cuda", torch.bfloat16)(x.to("cuda", torch.bfloat16))
    # bf16 routing can flip near-tied experts for a few tokens: compare most tokens tightly.
    err = (out.double().cpu() - ref).abs().amax(-1) / ref.abs().amax()
    assert (err < 3e-2).float().mean() > 0.95, err


def test_float32_experts_under_bf16_autocast_use_grouped_mm(monkeypatch):
    """Without FSDP's mixed precision TorchTitan autocasts: the experts still take the grouped
    path (weights cast to bf16), and agree with float64."""
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    moe = MoE(dim=128, hidden_dim=64, num_experts=8, top_k=2)
    with init_context(moe, seed=3):
        moe.init_weights(0.05, 0.05)
    x = torch.randn(64, 128, dtype=torch.float64)
    ref, _ = moe.double()(x)
    moe = moe.float().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = moe(x.float().cuda())
    assert calls, "grouped_mm was not used under autocast"
    err = (out.double().cpu() - ref).abs().amax(-1) / ref.abs().amax()
    assert (err < 3e-2).float().mean() > 0.95, err


def test_padded_groups_use_grouped_mm_and_match_batched_matmul():
    """Capacity-padded groups ``[experts, R, D]`` (zero rows for empty slots): grouped_mm with
    static offsets against the batched matmul and float64; zero rows give zero outputs."""
    torch.manual_seed(0)
    E, D, H, R = 4, 256, 128, 48
    experts = GroupedExperts(D, H, E)
    with init_context(experts, seed=4):
        experts.init_weights(0.05)
    x = torch.randn(E, R, D, dtype=torch.float64)
    x[1] = 0  # an expert with no token
    x[2, 30:] = 0  # empty slots
    ref = experts.double()(x, None)
    gpu = experts.to("cuda", torch.bfloat16)
    outs = {}
    for grouped in (True, False):
        gpu.use_grouped_mm = None if grouped else False
        outs[grouped] = gpu(x.to("cuda", torch.bfloat16), None)
    assert _rel(outs[True], ref.to("cuda")) < 2e-2 and _rel(outs[True], outs[False]) < 2e-2
    assert outs[True][1].abs().sum() == 0 and outs[True][2, 30:].abs().sum() == 0


def test_capacity_moe_layer_in_bf16_on_cuda_matches_float64():
    from torchtitan_omni.modules.moe_capacity import CapacityDispatcher

    torch.manual_seed(0)
    moe = MoE(dim=128, hidden_dim=64, num_experts=16, top_k=4)
    with init_context(moe, seed=2):
        moe.init_weights(0.05, 0.05)
    moe.dispatcher = CapacityDispatcher(16, 4, 4.0)  # room for every copy: no drop
    x = torch.randn(3, 50, 128, dtype=torch.float64)
    ref, ref_stats = moe.double()(x)
    out, stats = moe.to("cuda", torch.bfloat16)(x.to("cuda", torch.bfloat16))
    assert int(stats.dropped.sum()) == 0 and int(ref_stats.dropped.sum()) == 0
    err = (out.double().cpu() - ref).abs().amax(-1) / ref.abs().amax()
    assert (err < 3e-2).float().mean() > 0.95, err
