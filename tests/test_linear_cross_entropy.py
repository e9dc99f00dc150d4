"""The chunked linear cross-entropy against an unfused float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_omni.modules.linear_cross_entropy import (
    LinearHead,
    chunk_rows,
    group_rows,
    linear_cross_entropy,
)


def _reference(hidden, weight, bias, targets):
    h, w = hidden.double().detach().requires_grad_(), weight.double().detach().requires_grad_()
    b = bias.double().detach().requires_grad_() if bias is not None else None
    loss = F.cross_entropy(F.linear(h, w, b), targets, reduction="sum")
    loss.backward()
    return loss, h.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_matches_unfused_reference(with_bias, rows):
    g = torch.Generator().manual_seed(rows + with_bias)
    n, d, v = 50, 24, 97
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.1).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    loss = linear_cross_entropy(hidden, weight, targets, bias, rows=rows)
    # a non-unit upstream gradient checks that backward scales every gradient
    (loss * 0.5).backward()
    ref_loss, ref_h, ref_w, ref_b = _reference(hidden, weight, bias, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), 0.5 * ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), 0.5 * ref_w, rtol=1e-5, atol=1e-6)
    if with_bias:
        torch.testing.assert_close(bias.grad.double(), 0.5 * ref_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,group", [(7, 7), (7, 21), (7, 20), (5, 1000), (64, 128)])
def test_weight_gradient_by_groups_of_chunks_matches_reference(rows, group):
    # 50 rows: groups of one chunk, of three with a shorter last group, a group rounded down
    # to whole chunks, one group holding every chunk, one chunk holding every row
    g = torch.Generator().manual_seed(rows * 1000 + group)
    n, d, v = 50, 24, 97
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    linear_cross_entropy(hidden, weight, targets, rows=rows, group=group).backward()
    _, ref_h, ref_w, _ = _reference(hidden, weight, None, targets)
    torch.testing.assert_close(weight.grad.double(), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), ref_h, rtol=1e-5, atol=1e-6)


def test_group_rows_are_whole_chunks_within_the_bytes():
    # a 152K vocabulary in bf16: four 882-row chunks of logit gradients in 1 GiB
    rows = chunk_rows(152064)
    assert (rows, group_rows(152064, rows, 2)) == (882, 4 * 882)
    assert group_rows(152064, rows, 4) == 2 * 882
    assert group_rows(10**9, 3, 4) == 3


def test_head_gives_logits_or_loss_and_no_rows_still_backpropagates():
    torch.manual_seed(0)
    head = LinearHead(16, 40, bias=False)
    x = torch.randn(9, 16, requires_grad=True)
    t = torch.randint(0, 40, (9,))
    torch.testing.assert_close(head(x), F.linear(x, head.weight))
    ref = F.cross_entropy(head(x).double(), t, reduction="sum")
    torch.testing.assert_close(head(x, t).double(), ref, rtol=1e-6, atol=1e-6)
    empty = head(x[:0], t[:0])
    empty.backward()
    assert empty.item() == 0.0 and head.weight.grad is not None
    assert torch.count_nonzero(head.weight.grad) == 0


def test_chunk_rows_bounds_the_logits():
    assert chunk_rows(128256) * 128256 * 4 <= 1 << 29
    assert chunk_rows(10**12) == 1


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden \\[N, D\\] and targets \\[N\\]"):
        linear_cross_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_projector_head_loss_matches_its_logits(depth):
    from torchtitan_omni.encoders.projector import MLPProjector

    torch.manual_seed(depth)
    head = MLPProjector(12, 30, hidden_dim=20, depth=depth).double()
    for layer in head.layers:
        torch.nn.init.normal_(layer.bias, std=0.1)
    x = torch.randn(17, 12, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (17,))
    ref = F.cross_entropy(head(x), t, reduction="sum")
    ref_grads = torch.autograd.grad(ref, [x, *head.parameters()])
    loss = head(x, t)
    grads = torch.autograd.grad(loss, [x, *head.parameters()])
    torch.testing.assert_close(loss.double(), ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_heads_sum_the_weight_gradient_as_eager_does(dtype):
    """``compile_loss_heads`` gives a head compiled passes over its weight gradient's float32
    sum (the first product widened, later ones added, the backward's scale into the weight's
    dtype), with three groups of chunks and a non-unit upstream gradient: the same loss and
    gradients as the eager passes, bit for bit (elementwise, one rounding each). Both runs
    use the eager chunk kernel (the compiled one may sum a chunk's log-sum-exp in another
    order)."""
    from torchtitan_omni.distributed.compile import compile_loss_heads
    from torchtitan_omni.modules.linear_cross_entropy import EAGER_SUM, loss_and_logit_grad

    def run(compiled):
        torch.manual_seed(3)
        head = LinearHead(24, 97, bias=False).to(dtype)
        model = torch.nn.Sequential(head)
        if compiled:
            assert compile_loss_heads(model, "inductor") == 1
            assert head.weight_grad_sum is not EAGER_SUM
        x = torch.randn(50, 24, dtype=dtype, requires_grad=True)
        t = torch.randint(0, 97, (50,))
        loss = linear_cross_entropy(x, head.weight, t, rows=7, group=21,
                                    kernel=loss_and_logit_grad, sums=head.weight_grad_sum)
        (loss * 0.37).backward()
        return loss.detach(), x.grad, head.weight.grad

    for eager, compiled in zip(run(False), run(True)):
        assert eager.dtype == compiled.dtype and torch.equal(eager, compiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusable_chunk_kernel_gives_the_eager_kernels_values(dtype):
    """The compiled heads' chunk kernel, run eagerly, against the eager kernel: the same loss
    and the same logit gradient bit for bit (subtracting the one-hot term is the eager
    kernel's scatter-add of -1), returned or written into a given buffer."""
    from torchtitan_omni.modules.linear_cross_entropy import (
        fusable_loss_and_logit_grad,
        loss_and_logit_grad,
    )

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(13, 97, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 97, (13,), generator=g)
    loss, grad = loss_and_logit_grad(logits, targets)
    assert grad.dtype == dtype
    buffer = torch.full((20, 97), float("nan"), dtype=dtype)
    for kernel in (loss_and_logit_grad, fusable_loss_and_logit_grad):
        other_loss, other_grad = kernel(logits, targets)
        assert torch.equal(other_loss, loss) and torch.equal(other_grad, grad)
        into_loss, written = kernel(logits, targets, buffer[4:17])
        assert torch.equal(into_loss, loss) and torch.equal(buffer[4:17], grad)
        assert written.data_ptr() == buffer[4:17].data_ptr()
        assert buffer[:4].isnan().all() and buffer[17:].isnan().all()


def test_compiled_heads_write_each_chunks_gradient_into_its_group():
    """``compile_loss_heads``' compiled chunk kernel writes each chunk's logit gradient into
    its group's buffer (groups of three chunks, a shorter last group, a shorter last chunk):
    the loss and gradients match the float64 reference."""
    from torchtitan_omni.distributed.compile import compile_loss_heads

    torch.manual_seed(7)
    head = LinearHead(24, 97, bias=False)
    assert compile_loss_heads(torch.nn.Sequential(head), "inductor") == 1
    x = torch.randn(50, 24, requires_grad=True)
    t = torch.randint(0, 97, (50,))
    loss = linear_cross_entropy(x, head.weight, t, rows=7, group=21, kernel=head.loss_kernel,
                                sums=head.weight_grad_sum)
    loss.backward()
    ref_loss, ref_h, ref_w, _ = _reference(x, head.weight, None, t)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), ref_w, rtol=1e-5, atol=1e-6)
