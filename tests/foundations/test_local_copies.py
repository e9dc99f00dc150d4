"""The gather expert dispatch's row maps over the used rows of its worst-case buffer
(``torchtitan_omni.modules.local_copies``): the operators against their definitions written as
loops (float64), the two differentiable steps' gradients against autograd through a dense
reference, rows past ``count`` never read (NaN there changes nothing), the experts' SwiGLU and
input-gradient sum over the used rows against autograd, the Triton kernels in Triton's
interpreter (CPU) against torch's implementation, and the dispatcher's local work with and
without them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtitan_omni.distributed.comm import GroupShape
from torchtitan_omni.distributed.expert_gather import GatherExpertParallelDispatcher
from torchtitan_omni.modules.local_copies import (
    combine_copies,
    gather_copies,
    rows_below,
    slot_dots,
    slot_sums,
    swiglu_rows,
)
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.moe import GroupedExperts

TOKENS, TOP_K, DIM = 7, 3, 5


def _routing(seed: int, local_experts: int, experts: int):
    """Each slot's key (its local expert, or ``local_experts`` when another rank's), the sort
    order of the slots by key (stable), its inverse and the used rows' count."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(TOKENS)])
    key = torch.where(ids.reshape(-1) < local_experts, ids.reshape(-1), local_experts)
    order = torch.argsort(key, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return key, order, inverse, (key < local_experts).sum()


@pytest.mark.parametrize("count", [0, 4, TOKENS * TOP_K])
def test_operators_match_their_definitions(count):
    g = torch.Generator().manual_seed(count)
    rows = TOKENS * TOP_K
    src = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    sorted_rows = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    other = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    index = torch.randint(0, TOKENS, (rows,), generator=g)
    scale = torch.randn(rows, generator=g, dtype=torch.float64)
    pos = torch.randperm(rows, generator=g)
    weights = torch.randn(TOKENS, TOP_K, generator=g, dtype=torch.float64)
    c = torch.tensor(count)

    out = rows_below(src, index, scale, c)
    for i in range(rows):
        want = src[index[i]] * scale[i] if i < count else torch.zeros(DIM, dtype=torch.float64)
        torch.testing.assert_close(out[i], want)
    sums, plain = slot_sums(sorted_rows, pos, c, weights, TOP_K), slot_sums(sorted_rows, pos, c,
                                                                             None, TOP_K)
    dots = slot_dots(sorted_rows, other, pos, c, TOP_K)
    for t in range(TOKENS):
        used = [j for j in range(TOP_K) if pos[t * TOP_K + j] < count]
        want = sum((weights[t, j] * sorted_rows[pos[t * TOP_K + j]] for j in used),
                   torch.zeros(DIM, dtype=torch.float64))
        torch.testing.assert_close(sums[t], want)
        torch.testing.assert_close(plain[t], sum((sorted_rows[pos[t * TOP_K + j]] for j in used),
                                                 torch.zeros(DIM, dtype=torch.float64)))
        for j in range(TOP_K):
            want = sorted_rows[pos[t * TOP_K + j]] @ other[t] if j in used else 0.0
            torch.testing.assert_close(dots[t, j], torch.as_tensor(want, dtype=torch.float64))


def _dense_reference(x, weights, key, local_experts, w):
    # each token's copies on this rank's experts, weighed and summed: no sort, no buffer
    out = torch.zeros_like(x)
    for t in range(TOKENS):
        for j in range(TOP_K):
            e = int(key[t * TOP_K + j])
            if e < local_experts:
                out[t] = out[t] + weights[t, j] * (x[t] @ w[e])
    return out


def test_gather_and_combine_gradients_match_a_dense_reference():
    """Through a per-expert linear map between the two steps, with NaN written into the
    buffer's rows past ``count`` (rows no expert uses): forward and the gradients of the
    tokens, the router weights and the experts' weights equal the dense reference's."""
    local_experts, experts = 2, 6
    key, order, inverse, count = _routing(1, local_experts, experts)
    assert 0 < int(count) < TOKENS * TOP_K
    g = torch.Generator().manual_seed(2)
    x = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(local_experts, DIM, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    sorted_key = key[order]

    def experts_then_nan(rows):
        used = torch.arange(rows.shape[0]) < count
        per_row = w[sorted_key.clamp(max=local_experts - 1)]  # [rows, D, D]
        y = torch.einsum("rd,rde->re", rows, per_row)
        return torch.where(used.unsqueeze(1), y, float("nan"))

    out = combine_copies(experts_then_nan(gather_copies(x, order, inverse, count, TOP_K)),
                         weights, order, inverse, count)
    upstream = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * upstream).sum(), (x, weights, w))
    ref_out = _dense_reference(x, weights, key, local_experts, w)
    want = torch.autograd.grad((ref_out * upstream).sum(), (x, weights, w))
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("count", [0, 5, 9])
def test_swiglu_over_the_used_rows_matches_autograd(count):
    """``silu(a) * b`` and its gradients against autograd (float64) on the rows below
    ``count``; zero past it (the CPU implementation), whatever those rows hold (NaN)."""
    g = torch.Generator().manual_seed(count)
    a, b, up = (torch.randn(9, 6, generator=g, dtype=torch.float64) for _ in range(3))
    a[count:] = float("nan")
    c = torch.tensor(count)
    ai, bi = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = swiglu_rows(ai, bi, c)
    grads = torch.autograd.grad((out * up).sum(), (ai, bi))
    ar, br = a[:count].clone().requires_grad_(), b[:count].clone().requires_grad_()
    ref = torch.nn.functional.silu(ar) * br
    want = torch.autograd.grad((ref * up[:count]).sum(), (ar, br), allow_unused=True)
    torch.testing.assert_close(out[:count], ref)
    assert (out[count:] == 0).all()
    for got, w in zip(grads, want):
        torch.testing.assert_close(got[:count], torch.zeros_like(got[:count]) if w is None else w)
        assert (got[count:] == 0).all()


def test_used_rows_are_refused_for_padded_groups_and_group_shape_checks_its_rank():
    experts = GroupedExperts(DIM, 4, 2).double()
    with pytest.raises(ValueError, match="used_rows is for exact groups"):
        experts(torch.zeros(2, 3, DIM, dtype=torch.float64), None, used_rows=torch.tensor(1))
    with pytest.raises(ValueError, match="rank 4 outside a group of 4"):
        GroupShape(4, 4)


@pytest.mark.parametrize("rank", [0, 3])
def test_dispatcher_local_work_is_the_same_with_the_row_maps(rank):
    """``run_local`` of the gather dispatch at EP4 (8 experts, 2 a rank), rank 0 and 3, with
    padding tokens routed nowhere: the row maps against torch's ops over the whole buffer,
    forward and backward (float64, to rounding)."""
    degree, experts, tokens, k = 4, 8, 6, 3
    g = torch.Generator().manual_seed(rank)
    module = GroupedExperts(DIM, 4, experts // degree).double()
    with init_context(module, seed=rank):
        module.init_weights(0.5)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(degree * tokens)])
    ids[-2:] = -1  # padding tokens
    x = torch.randn(degree * tokens, DIM, generator=g, dtype=torch.float64)
    w = torch.rand(degree * tokens, k, generator=g, dtype=torch.float64)
    upstream = torch.randn(degree * tokens, DIM, generator=g, dtype=torch.float64)
    results = []
    for kernels in (True, False):
        module.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        dispatcher = GatherExpertParallelDispatcher(GroupShape(degree, rank), experts, tokens,
                                                    kernels=kernels)
        out = dispatcher.run_local(module, xi, wi, ids)
        (out * upstream).sum().backward()
        results.append((out, xi.grad, wi.grad, module.w1.grad.clone(), module.w2.grad.clone()))
    assert results[0][0].abs().sum() > 0
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_compiled_code_sees_through_the_row_maps():
    """Under ``torch.compile`` the row maps are not opaque: AOT autograd decomposes them
    (``torch.library.triton_op``; on CUDA inductor then launches their Triton kernels from its
    own code), so neither the forward nor the backward graph calls a ``torchtitan_omni``
    operator, and the compiled gather, SwiGLU and combine give eager's values and
    gradients (float64, CPU: torch's implementation inlined)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    def step(x, weights, order, inverse, count):
        rows = gather_copies(x, order, inverse, count, TOP_K)
        return combine_copies(swiglu_rows(rows, rows * 0.5, count), weights, order, inverse,
                              count)

    _, order, inverse, count = _routing(3, 2, 4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64)
    upstream = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True)
    results = []
    for run in (step, compiled):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = run(xi, wi, order, inverse, count)
        (out * upstream).sum().backward()
        results.append((out, xi.grad, wi.grad))
    assert len(graphs) == 2  # the forward and the backward
    called = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert not [t for t in called if "torchtitan_omni" in t], called
    assert results[0][0].abs().sum() > 0
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


_INTERPRETED = textwrap.dedent("""
    import torch
    from torchtitan_omni.modules import local_copies as lc
    torch.manual_seed(0)
    tokens, k, width = 9, 3, 1100  # 27 rows: a last tile of 3; two column blocks of 1024
    rows = tokens * k
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        for count in (0, 13, rows):
            c = torch.tensor(count)
            src = torch.randn(tokens, width).to(dtype)
            index = torch.randint(0, tokens, (rows,))
            scale = torch.randn(rows).to(dtype)
            for s in (None, scale):
                # rows past count are left as they were (NaN here): not written
                out = torch.full((rows, width), float("nan"), dtype=dtype)
                got = lc._rows_below_triton(src, index, s, c, out=out)
                want = lc._rows_below_torch(src, index, s, c)[:count].float()
                assert torch.allclose(got[:count].float(), want, rtol=tol, atol=0), (dtype, count)
                assert got[count:].isnan().all()
            pos = torch.randperm(rows)
            y = torch.randn(rows, width).to(dtype)
            y[count:] = float("nan")  # rows past count: never read
            w = torch.randn(tokens, k).to(dtype)
            other = torch.randn(tokens, width).to(dtype)
            for weights in (None, w):
                got = lc._slot_sums_triton(y, pos, c, weights, k).float()
                want = lc._slot_sums_torch(y, pos, c, weights, k).float()
                assert torch.allclose(got, want, rtol=tol, atol=tol), (dtype, count)
            got = lc._slot_dots_triton(y, other, pos, c, k)
            want = lc._slot_dots_torch(y, other, pos, c, k)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (dtype, count)
            a, b, g = (torch.randn(rows, width).to(dtype) for _ in range(3))
            a[count:] = float("nan")
            out = torch.full((rows, width), float("nan"), dtype=dtype)
            assert lc._rowwise_triton(0, b, g, c, out=out)[count:].isnan().all()
            pairs = [(lc._rowwise_triton(0, a, b, c), lc._swiglu_torch(a, b, c)),
                     *zip(lc._rowwise_triton(1, a, b, c, g), lc._swiglu_backward_torch(g, a, b, c))]
            for got, want in pairs:
                assert torch.allclose(got[:count].float(), want[:count].float(), rtol=tol,
                                      atol=tol), (dtype, count)
    print("kernels ok")
""")


def test_triton_kernels_in_the_interpreter_match_torch():
    """The Triton kernels run by Triton's CPU interpreter against torch's implementation, in
    float32 (to rounding) and bf16 (to one unit in the last place: the interpreter's bf16
    casts), for no used row, some and all, with NaN in the rows past ``count``."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ok" in done.stdout


def test_a_kernel_wrapped_in_eager_is_still_traceable_when_compiling():
    """Which launcher a row-map kernel gets follows the tracing state of each call: torch's
    ``wrap_triton`` gives the bare kernel in eager calls and a traceable wrapper while
    compiling. A launcher kept from an eager call broke the next compile of the MoE block
    (FakeTensors reached the bare kernel: three GPU tests failed, forty-first session)."""
    triton = pytest.importorskip("triton")
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
    from torch._library.triton import set_wrap_triton_enabled

    from torchtitan_omni.modules import local_copies

    kernel = local_copies._rows_below_kernel
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        pytest.skip("Triton's interpreter is on: its kernels launch as they are")
    with set_wrap_triton_enabled(False):  # eager: triton_op runs the kernel directly
        assert local_copies._launchable(kernel) is kernel
    with set_wrap_triton_enabled(True):  # tracing: the launch must become a graph node
        assert isinstance(local_copies._launchable(kernel), TraceableTritonKernelWrapper)
