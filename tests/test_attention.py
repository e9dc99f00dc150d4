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
