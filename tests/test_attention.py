"""Attention building blocks against independent references: varlen vs per-document dense
attention with an explicit mask (float64), and KV-cached decoding vs a full forward."""

import torch

from torchtitan_omni.modules.attention import KVCache, SelfAttention, varlen_attention
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.protocols.modules import AttentionMeta


def _dense_reference(q, k, v, cu, causal):
    # float64 softmax attention with an explicit block-diagonal (causal) mask
    t, h, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    doc = torch.zeros(t, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc[a:b] = i
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_varlen_matches_masked_dense_reference():
    torch.manual_seed(0)
    q = torch.randn(23, 4, 8, dtype=torch.float64)
    k, v = torch.randn(23, 2, 8, dtype=torch.float64), torch.randn(23, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 5, 6, 17, 23], dtype=torch.int32)
    for causal in (True, False):
        out = varlen_attention(q, k, v, cu, 11, causal=causal)
        torch.testing.assert_close(out, _dense_reference(q, k, v, cu, causal))


def test_kv_cache_decoding_matches_full_forward():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 32, 10000.0)
    attn = SelfAttention(32, 4, 2, rope=rope)
    with init_context(attn, seed=1):
        attn.init_weights(0.2)
    rope.init_weights(torch.device("cpu"))
    x = torch.randn(2, 9, 32)
    pos = torch.arange(9).expand(2, 9)
    full = attn(x, AttentionMeta(torch.tensor([0, 9, 18], dtype=torch.int32), 9, pos))
    cache = KVCache()
    pieces = [attn(x[:, :5], AttentionMeta(None, 0, pos[:, :5], kv_cache=cache))]
    for i in range(5, 9):
        pieces.append(attn(x[:, i:i + 1], AttentionMeta(None, 0, pos[:, i:i + 1], kv_cache=cache)))
    assert len(cache) == 9
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-6)


def test_block_masked_path_matches_reference():
    # the traceable CPU path (used inside torch.compile) on the same layout
    from torchtitan_omni.modules.attention import _attention_block_masked

    torch.manual_seed(1)
    q = torch.randn(23, 4, 8, dtype=torch.float64)
    k, v = torch.randn(23, 2, 8, dtype=torch.float64), torch.randn(23, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 5, 6, 17, 23], dtype=torch.int32)
    for causal in (True, False):
        out = _attention_block_masked(q, k, v, cu, causal, None)
        torch.testing.assert_close(out, _dense_reference(q, k, v, cu, causal))


def test_row_attention_is_exact_for_single_document_rows():
    # two rows, each one document then padding: whole-row causal attention gives the real
    # tokens exactly what per-document attention gives them
    from torchtitan_omni.modules.attention import row_attention
    from torchtitan_omni.protocols.batch import whole_rows

    torch.manual_seed(2)
    b, s, real = 2, 16, (11, 16)
    q = torch.randn(b, s, 4, 8, dtype=torch.float64)
    k, v = (
        torch.randn(b, s, 2, 8, dtype=torch.float64),
        torch.randn(b, s, 2, 8, dtype=torch.float64),
    )
    cu = torch.tensor([0, 11, 16, 32], dtype=torch.int32)
    assert whole_rows(cu, b, torch.tensor(sum(real)))
    ref = _dense_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, True)
    out = row_attention(q, k, v, causal=True).flatten(0, 1)
    keep = torch.cat([torch.arange(real[0]), s + torch.arange(real[1])])
    torch.testing.assert_close(out[keep], ref[keep])


def test_whole_rows_reads_the_layout():
    from torchtitan_omni.protocols.batch import whole_rows

    def cu(*b):
        return torch.tensor(b, dtype=torch.int32)

    assert whole_rows(cu(0, 90, 100), 1, torch.tensor(90))  # one document, padding
    assert whole_rows(cu(0, 100), 1, torch.tensor(100))  # one full document
    assert whole_rows(cu(0, 90, 100, 180, 200), 2, torch.tensor(170))
    assert not whole_rows(cu(0, 50, 90, 100), 1, torch.tensor(90))  # two documents
    assert not whole_rows(cu(0, 50, 100), 1, torch.tensor(100))  # two documents, no padding
    assert not whole_rows(cu(0, 90, 100, 150, 180, 200), 2, torch.tensor(170))
    assert not whole_rows(cu(0, 100), 1, torch.tensor(0))  # a row of padding only
    assert not whole_rows(cu(0, 100), 1, None)


def test_flash_varlen_operator_traces_as_one_op_with_its_backward_op():
    """The CUDA path's operator (``flash_varlen``, FlashAttention-2 varlen through aten) checked
    without a GPU, on meta tensors through aten's own fake kernels: its outputs' shapes (the
    logsumexp ``[heads, tokens]`` in float32, the RNG state and its unused companion), the
    gradients of q, k and v (k/v keeping their two heads), and under ``torch.compile`` (sizes
    dynamic, so ``max_seqlen`` is symbolic) one opaque op in the forward graph and its backward
    op in the backward graph, so a checkpointed compiled block recomputes it rather than
    keeping what an autograd.Function took (docs/performance.md, forty-third session)."""
    from torch._dynamo.backends.common import aot_autograd

    from torchtitan_omni.modules.attention import flash_varlen

    def inputs(tokens):
        made = [torch.empty(tokens, heads, 64, dtype=torch.bfloat16, device="meta",
                            requires_grad=True) for heads in (4, 2, 2)]
        return (*made, torch.empty(3, dtype=torch.int32, device="meta"))

    q, k, v, cu = inputs(10)
    out, lse, rng, unused = flash_varlen(q, k, v, cu, 6, True, None)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (4, 10), torch.float32)
    assert (rng.shape, rng.dtype, unused.shape) == ((2,), torch.uint64, ())
    out.float().sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, cu, s: flash_varlen(q, k, v, cu, s, True, None)[0],
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True, dynamic=True)
    q, k, v, cu = inputs(12)
    compiled(q, k, v, cu, 8).float().sum().backward()
    ops = [sorted({str(n.target) for n in gm.graph.nodes if "torchtitan_omni" in str(n.target)})
           for gm in graphs]
    assert ops == [["torchtitan_omni.flash_varlen.default"],
                   ["torchtitan_omni.flash_varlen_backward.default"]], ops
    assert k.grad.shape == (12, 2, 64)
