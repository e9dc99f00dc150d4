"""The MoE layer against a dense float64 reference, the dispatcher contract, and the
load-balancing loss (against Hugging Face's function, and under activation checkpointing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.moe import (
    GroupedExperts, MoE, combine, gather_sorted, load_balancing_loss, narrow_sort_keys,
    sort_by_expert,
)

E, K, D, H = 6, 2, 16, 12


def _moe(norm_topk_prob=True, dtype=torch.float64) -> MoE:
    moe = MoE(D, H, E, K, norm_topk_prob)
    with init_context(moe, seed=3):
        moe.init_weights(0.3, 0.3)
    return moe.to(dtype)


def _dense_reference(moe: MoE, x: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """Every expert on every token, then a mask of the chosen ones (no sorting, no gathering)."""
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    top = torch.topk(probs, K, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True) if norm_topk_prob else top.values
    dense_w = torch.zeros_like(probs).scatter(1, top.indices, w)  # [N, E]
    e = moe.experts
    h = F.silu(torch.einsum("nd,ehd->neh", x, e.w1)) * torch.einsum("nd,ehd->neh", x, e.w3)
    out = torch.einsum("neh,edh->ned", h, e.w2)
    return (dense_w.unsqueeze(-1) * out).sum(1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_matches_dense_reference_with_gradients(norm_topk_prob):
    moe = _moe(norm_topk_prob)
    x = torch.randn(3, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, _ = moe(x1)
    params = [moe.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * g).sum(), [x1, *params])
    ref = _dense_reference(moe, x2.reshape(-1, D), norm_topk_prob).reshape(x.shape)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x2, *params])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["x", "gate", "w1", "w2", "w3"], grads, ref_grads):
        torch.testing.assert_close(
            a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def test_sort_by_expert_groups_and_counts():
    idx = torch.randint(0, E, (50, K), generator=torch.Generator().manual_seed(5))
    order, counts = sort_by_expert(idx, E)
    flat = idx.reshape(-1)
    assert torch.equal(counts, torch.bincount(flat, minlength=E))
    assert torch.equal(flat[order], torch.sort(flat, stable=True).values)
    x = torch.randn(50, D, dtype=torch.float64)
    assert torch.equal(gather_sorted(x, order, K), x[order // K])


@pytest.mark.parametrize("num_experts, dtype", [(32, torch.uint8), (256, torch.uint8),
                                                 (257, torch.int16), (32768, torch.int16),
                                                 (32769, torch.int32)])
def test_sort_by_expert_sorts_narrow_keys_into_the_wide_keys_order(num_experts, dtype):
    """The expert ids are sorted in the narrowest integer dtype that holds them (the GPU's
    radix sort then makes fewer passes); the order is the stable order of the int64 ids,
    highest id included, and the counts are theirs."""
    g = torch.Generator().manual_seed(num_experts)
    idx = torch.randint(0, num_experts, (400, K), generator=g)
    idx[0, 0], idx[7, 1] = num_experts - 1, 0  # both ends of the range
    assert narrow_sort_keys(idx, num_experts).dtype == dtype
    order, counts = sort_by_expert(idx, num_experts)
    flat = idx.reshape(-1)
    reference = sorted(range(flat.numel()), key=lambda i: (int(flat[i]), i))
    assert order.tolist() == reference
    assert torch.equal(counts, torch.bincount(flat, minlength=num_experts))


def test_sorted_gather_and_combine_have_the_plain_indexing_gradients():
    """The sort's gather and the combine's un-sort (row_maps: gathers and placements instead of
    an index backward) give exactly the gradients of plain indexing."""
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(30)])
    order, _ = sort_by_expert(idx, E)
    weights = torch.rand(30, K, dtype=torch.float64, generator=g)
    up = torch.randn(30 * K, D, dtype=torch.float64, generator=g)
    grads = []
    for plain in (True, False):
        x = torch.randn(30, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        x.requires_grad_()
        if plain:
            inverse = torch.argsort(order)
            routed = x[order // K]
            out = torch.einsum("nk,nkd->nd", weights, (routed * up)[inverse].view(30, K, D))
        else:
            out = combine(gather_sorted(x, order, K) * up, order, weights)
        out.pow(2).sum().backward()
        grads.append((out.detach(), x.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_bf16_combine_rounds_once_with_bf16_weights_and_keeps_the_weights_gradient():
    """In bf16, combine weighs the outputs by the weights rounded to bf16, forms the products
    and their sum in float32 and rounds once: the correctly rounded float64 sum (up to the
    float32 sum's own rounding at a tie), for the outputs and for the weights' gradient."""
    g = torch.Generator().manual_seed(10)
    n, d = 64, 256
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    order, _ = sort_by_expert(idx, E)
    y = torch.randn(n * K, d, generator=g).bfloat16()
    weights = torch.softmax(torch.randn(n, K, generator=g), -1).requires_grad_()
    out = combine(y, order, weights)
    out.float().pow(2).sum().backward()
    inverse = torch.argsort(order)
    per_token = y[inverse].view(n, K, d).double()
    w64 = weights.detach().bfloat16().double().requires_grad_()
    exact = torch.einsum("nk,nkd->nd", w64, per_token)
    exact.bfloat16().double().pow(2).sum().backward()
    assert out.dtype == torch.bfloat16
    assert (out == exact.bfloat16()).float().mean() > 0.99
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=2e-2, atol=1e-3)


def test_experts_compute_with_a_slice_and_local_counts():
    """What expert parallel relies on: modules holding experts [lo, hi), given the tokens of
    their experts and local counts, compute what the module holding all experts does."""
    moe = _moe()
    x = torch.randn(40, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    _, _, indices = moe.route(x)
    order, counts = sort_by_expert(indices, E)
    routed = gather_sorted(x, order, K)
    expected = moe.experts(routed, counts)
    outs, start = [], 0
    for lo, hi in ((0, E // 2), (E // 2, E)):
        part = GroupedExperts(D, H, hi - lo).to(torch.float64)
        with torch.no_grad():
            for n in ("w1", "w2", "w3"):
                getattr(part, n).copy_(getattr(moe.experts, n)[lo:hi])
        n = int(counts[lo:hi].sum())
        outs.append(part(routed[start:start + n], counts[lo:hi]))
        start += n
        with pytest.raises(ValueError, match="counts for 6 experts but holds 3"):
            part(routed, counts)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-12, atol=1e-12)


def test_moe_goes_through_its_dispatcher():
    """A dispatcher that reverses the rows on the way out and back is invisible in the output."""
    moe = _moe()
    x = torch.randn(30, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    expected, _ = moe(x)
    calls = []

    class Reversing:
        host_sync = False

        def dropped(self, counts, copies):
            return torch.zeros_like(counts)

        def dispatch(self, x_sorted, counts):
            calls.append(counts.sum().item())
            return x_sorted.flip(0), counts.flip(0), "state"

        def combine(self, y, state):
            assert state == "state"
            return y.flip(0)

    moe.dispatcher = Reversing()
    moe.experts = _FlippedExperts(moe.experts)
    torch.testing.assert_close(moe(x)[0], expected, rtol=1e-12, atol=1e-12)
    assert calls == [30 * K]


class _FlippedExperts(torch.nn.Module):
    """Experts listed in reverse order (what ``Reversing`` hands them)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, counts):
        w = {n: getattr(self.inner, n).flip(0) for n in ("w1", "w2", "w3")}
        part = GroupedExperts(D, H, E).to(torch.float64)
        for n, t in w.items():
            setattr(part, n, torch.nn.Parameter(t))
        return part(x, counts)


def test_load_balancing_loss_matches_hf():
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    moe = _moe(dtype=torch.float32)
    layers = []
    for seed in range(3):
        x = torch.randn(20, D, generator=torch.Generator().manual_seed(seed))
        _, stats = moe(x)
        layers.append((stats, moe.gate(x)))
    ours = load_balancing_loss([r for r, _ in layers], E, K)
    ref = hf.load_balancing_loss_func(tuple(logits for _, logits in layers), E, K)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ac", ["composable", "wrapper"])
def test_aux_loss_gradients_survive_activation_checkpointing(ac):
    """The routing statistics leave the layer as outputs; non-reentrant AC (the composable
    ``checkpoint`` or TorchTitan's wrapper) must still backprop through them."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    results = []
    for wrap in (False, True):
        moe = _moe()
        layer = moe
        if wrap and ac == "composable":
            checkpoint(moe)
        elif wrap:
            layer = checkpoint_wrapper(moe)
        out, stats = layer(x)
        loss = out.square().mean() + load_balancing_loss([stats], E, K)
        loss.backward()
        results.append([p.grad.clone() for p in moe.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert results[0][0].abs().sum() > 0  # the router got gradient
