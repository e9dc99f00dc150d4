"""Packing and batching: attention never crosses documents (packed forward vs per-document
reference forwards in float64), row filling, the token-budget batcher, padding rules."""

import random

import numpy as np
import pytest
import torch

from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import Document
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.modules.rope import RotaryEmbedding
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta

PAD = 0


def _doc(rng, n):
    tokens = np.asarray([rng.randrange(1, 50) for _ in range(n)], dtype=np.int64)
    return Document(tokens, np.ones(n, dtype=bool))


def _docs(seed, lengths):
    rng = random.Random(seed)
    return [_doc(rng, n) for n in lengths]


def test_packed_attention_equals_per_document_reference():
    torch.manual_seed(0)
    dim, heads = 16, 4
    rope = RotaryEmbedding(dim // heads, 64)
    rope.init_weights()
    attn = SelfAttention(dim, heads, 2, rope=rope).double()
    emb = torch.nn.Embedding(50, dim).double()

    docs = _docs(1, [7, 12, 3, 9, 20, 5, 11])
    plan = BatchPlan(seq_len=32, rows=2, packing=True, multiple=4)
    rows = [[docs[i] for i in row] for row in plan.select([len(d) for d in docs])]
    assert sum(len(r) for r in rows) >= 4  # several documents share rows
    batch, labels = collate(
        rows, plan.row_length(max(sum(len(d) for d in r) for r in rows)), PAD, {}
    )
    cu = batch[B.CU_SEQLENS]
    meta = AttentionMeta(cu, int((cu[1:] - cu[:-1]).max()), batch[B.POSITION_IDS])
    with torch.no_grad():
        packed = attn(emb(batch[B.INPUT]), meta)
        for r, row in enumerate(rows):
            offset = 0
            for d in row:
                x = emb(torch.from_numpy(d.tokens))[None]
                single = AttentionMeta(torch.tensor([0, len(d)], dtype=torch.int32), len(d),
                                       torch.arange(len(d))[None])
                ref = attn(x, single)[0]
                torch.testing.assert_close(
                    packed[r, offset : offset + len(d)], ref, rtol=1e-10, atol=1e-12
                )
                offset += len(d)
    # Perturbing one document changes no other document's outputs.
    tokens = batch[B.INPUT].clone()
    tokens[0, 0] = (tokens[0, 0] + 1) % 50
    with torch.no_grad():
        changed = attn(emb(tokens), meta)
    first_len = len(rows[0][0])
    assert not torch.equal(changed[0, :first_len], packed[0, :first_len])
    torch.testing.assert_close(changed[0, first_len:], packed[0, first_len:], rtol=0, atol=0)
    torch.testing.assert_close(changed[1], packed[1], rtol=0, atol=0)


def test_collate_positions_cu_seqlens_and_labels():
    docs = _docs(2, [5, 3, 6])
    batch, labels = collate([[docs[0], docs[1]], [docs[2]]], 10, PAD, {})
    assert batch[B.CU_SEQLENS].tolist() == [0, 5, 8, 10, 16, 20]
    assert batch[B.CU_SEQLENS].dtype == torch.int32
    assert batch[B.POSITION_IDS][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert batch[B.POSITION_IDS][1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert int(batch[B.REAL_TOKENS]) == 14
    assert labels[0, :4].tolist() == docs[0].tokens[1:].tolist()
    assert labels[0, 4] == -100 and labels[0, 7] == -100  # document ends
    assert (labels[0, 8:] == -100).all() and (batch[B.INPUT][0, 8:] == PAD).all()


def test_packing_fills_rows_and_keeps_oldest_first():
    plan = BatchPlan(seq_len=16, rows=2, packing=True)
    lengths = [9, 4, 15, 7, 3, 2, 16]
    rows = plan.select(lengths)
    assert rows[0][0] == 0  # the oldest document opens the first row
    for row in rows:
        assert sum(lengths[i] for i in row) <= 16
    used = [i for r in rows for i in r]
    assert len(used) == len(set(used))
    assert sum(lengths[i] for i in rows[0]) == 16  # 9 + 7 fills the row exactly


def test_token_budget_batcher_without_packing():
    plan = BatchPlan(seq_len=64, token_budget=96, packing=False, multiple=8)
    rng = random.Random(0)
    lengths = [rng.randint(4, 60) for _ in range(40)]
    remaining = list(range(len(lengths)))
    batches = 0
    while remaining:
        rows = plan.select([lengths[i] for i in remaining])
        assert rows and rows[0] == [0]  # the oldest is never left behind
        picked = [remaining[r[0]] for r in rows]
        row_len = plan.row_length(max(lengths[i] for i in picked))
        assert len(picked) * row_len <= 96 and row_len % 8 == 0
        remaining = [i for i in remaining if i not in picked]
        batches += 1
    assert batches < len(lengths)  # several short documents share a batch


def test_token_budget_with_packing_sets_rows():
    plan = BatchPlan(seq_len=32, token_budget=100, packing=True)
    assert plan.packed_rows == 3
    with pytest.raises(ValueError, match="token_budget"):
        BatchPlan(seq_len=32, token_budget=16, packing=True)


def test_row_length_multiple_fixed_and_capped():
    plan = BatchPlan(seq_len=36, multiple=8)
    assert plan.row_length(9) == 16 and plan.row_length(33) == 36  # capped at seq_len
    ulysses = BatchPlan(seq_len=48, multiple=12)
    assert all(ulysses.row_length(n) % 12 == 0 for n in range(1, 49))
    assert BatchPlan(seq_len=36, fixed_length=True).row_length(3) == 36


@pytest.mark.parametrize("multiple", [8, 12])
def test_long_rows_round_to_few_lengths_with_little_padding(multiple):
    plan = BatchPlan(seq_len=1 << 20, multiple=multiple)
    lengths = {n: plan.row_length(n) for n in range(1, 40_000)}
    for n, padded in lengths.items():
        assert padded % multiple == 0 and n <= padded
        assert padded - n < max(multiple, n / 32)  # short rows: the plain multiple
    assert lengths[300] == -(-300 // multiple) * multiple
    # 4K-8K rows: a few dozen lengths (each a cuDNN plan / compile shape), not one per 8 tokens
    assert len({lengths[n] for n in range(4096, 8193)}) <= 40
