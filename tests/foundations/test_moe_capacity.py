"""Capacity-padded dispatch on one rank against an independent dense reference that applies the
capacity rule token by token (float64): outputs, gradients and dropped counts; the capacity
arithmetic; the slot layout; and the exact per-expert operator the experts use off CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.moe import MoE, load_balancing_loss, sort_by_expert
from torchtitan_omni.modules.moe_capacity import CapacityDispatcher, capacity, slot_layout
from torchtitan_omni.modules.segment_mm import segment_mm

E, K, D, H = 6, 2, 16, 12


def _moe(dtype=torch.float64) -> MoE:
    moe = MoE(D, H, E, K)
    with init_context(moe, seed=3):
        moe.init_weights(0.3, 0.3)
    return moe.to(dtype)


def _capacity_reference(moe: MoE, x: torch.Tensor, cap: int):
    """Every expert on every token; a copy is kept when fewer than ``cap`` earlier tokens chose
    the same expert. Returns the output and the dropped copies per expert."""
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    top = torch.topk(probs, K, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True)
    keep = torch.zeros(top.indices.shape, dtype=torch.bool)
    seen = [0] * E
    for n, row in enumerate(top.indices.tolist()):
        for j, e in enumerate(row):
            keep[n, j] = seen[e] < cap
            seen[e] += 1
    dropped = torch.tensor([max(0, s - cap) for s in seen])
    dense_w = torch.zeros_like(probs).scatter(1, top.indices, w * keep)
    e = moe.experts
    h = F.silu(torch.einsum("nd,ehd->neh", x, e.w1)) * torch.einsum("nd,ehd->neh", x, e.w3)
    return (dense_w.unsqueeze(-1) * torch.einsum("neh,edh->ned", h, e.w2)).sum(1), dropped


def test_capacity_is_exact_decimal_arithmetic():
    assert capacity(80, 1, 8, 1.1) == 11  # 1.1 * 80 / 8 in binary floating point is 11.000...02
    assert capacity(10, 2, 4, 1.0) == 5
    assert capacity(10, 2, 4, 1.25) == 7  # 6.25 rounds up
    assert capacity(0, 2, 4, 2.0) == 0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity factor"):
            capacity(10, 2, 4, bad)


def test_slot_layout_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for cap in (0, 1, 3, 40):
        counts = torch.randint(0, 6, (E,), generator=g)
        counts[2] = 0  # an expert nobody chose
        copies = int(counts.sum())
        src, dst = slot_layout(counts, copies, cap)
        expected_src, expected_dst, row = [], [copies + 0] * copies, 0
        for e, c in enumerate(counts.tolist()):
            for i in range(c):
                if i < cap:
                    expected_dst[row] = e * cap + i
                else:
                    expected_dst[row] = E * cap
                row += 1
            start = int(counts[:e].sum())
            expected_src += [start + i if i < c else copies for i in range(cap)]
        assert src.tolist() == expected_src and dst.tolist() == expected_dst, cap


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.1])
def test_capacity_dispatch_matches_dense_reference_with_gradients(factor):
    moe = _moe()
    moe.dispatcher = CapacityDispatcher(E, K, factor)
    x = torch.randn(2, 13, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, stats = moe(x1)
    cap = capacity(26, K, E, factor)
    ref, ref_dropped = _capacity_reference(moe, x2.reshape(-1, D), cap)
    ref = ref.reshape(x.shape)
    assert torch.equal(stats.dropped, ref_dropped)
    assert int(stats.dropped.sum()) > 0, "the capacity never bound: nothing was tested"
    chosen = moe.route(x.reshape(-1, D))[2].flatten()
    assert torch.equal(stats.routed, torch.bincount(chosen, minlength=E))
    params = [moe.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * g).sum(), [x1, *params])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x2, *params])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["x", "gate", "w1", "w2", "w3"], grads, ref_grads):
        torch.testing.assert_close(
            a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def test_all_tokens_to_one_expert_and_fixed_token_budget():
    """Every token's first choice is expert 0: it keeps ``C`` copies, the rest are dropped,
    counted, and add nothing; with ``tokens`` fixed the capacity ignores the batch size."""
    moe = _moe()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0] = 50.0
        moe.gate.weight[1:, 1:E] = torch.eye(E - 1, dtype=torch.float64)
    x = torch.randn(10, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 1.0
    moe.dispatcher = CapacityDispatcher(E, K, 1.0, tokens=6)  # C = 6 * 2 / 6 = 2
    out, stats = moe(x)
    assert stats.routed[0] == 10 and stats.dropped[0] == 8
    ref, ref_dropped = _capacity_reference(moe, x, 2)
    assert torch.equal(stats.dropped, ref_dropped)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_large_capacity_is_exact_and_zero_tokens_work():
    moe = _moe()
    x = torch.randn(20, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    exact, exact_stats = moe(x)
    moe.dispatcher = CapacityDispatcher(E, K, E / K)  # C = tokens: nothing can be dropped
    out, stats = moe(x)
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
    assert int(stats.dropped.sum()) == 0 and torch.equal(stats.routed, exact_stats.routed)
    torch.testing.assert_close(load_balancing_loss([stats], E, K),
                               load_balancing_loss([exact_stats], E, K))
    empty, empty_stats = moe(x[:0])
    assert empty.shape == (0, D) and int(empty_stats.routed.sum()) == 0


def test_segment_mm_matches_per_group_matmuls_with_empty_groups():
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    out = segment_mm(x, w, counts)
    starts = [0, 3, 3, 8, 9]
    ref = torch.cat([x[a:b] @ w[i] for i, (a, b) in enumerate(zip(starts, starts[1:]))])
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    got = torch.autograd.grad((out * grad).sum(), [x, w])
    expected = torch.autograd.grad((ref * grad).sum(), [x, w])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got[1][1].abs().sum() == 0  # the empty group's weight gets no gradient


def test_sort_then_slots_keep_the_earliest_tokens():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])
    order, counts = sort_by_expert(idx, 3)
    src, dst = slot_layout(counts, 8, 2)
    # expert 0 was chosen by tokens 0, 1, 2, 3 (in order): tokens 2 and 3 lose theirs
    kept_tokens = sorted(int(order[r]) // 2 for r in range(8) if dst[r] < 6 and r < int(counts[0]))
    assert kept_tokens == [0, 1]
