"""Resuming the omni loader under another number of data-parallel ranks (or loader workers):
the stream goes on without repeating or skipping a row.

Loaders are built directly with ``dp_rank`` / ``dp_world_size`` and their states go through
what ``OmniCheckpointManager`` does (``DataloaderState``: per-rank pickled entries, then
``load_state_dict`` or ``load_state_dict_resharded``), without process groups. Every plain-text
row carries a marker (``row 17``); the documents of every batch (``cu_seqlens``) are decoded
and the markers counted.
"""

from __future__ import annotations

import os
import pickle
import re
from collections import Counter

import pytest
import torch

from tests.data.helpers import SMALL_PROCESSING, job_config, tokenizer_dir, write_jsonl, write_png
from torchtitan_omni.checkpoint.stateful import DataloaderState
from torchtitan_omni.data.dataset import OmniDataset
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.resplit import runs_decode, runs_encode
from torchtitan_omni.protocols import batch as B

N_TEXT = 97
BAD = 13  # a malformed row: counted as skipped, never yielded
ROWS = [r for r in range(N_TEXT) if r != BAD]
WORDS = "alpha beta gamma delta epsilon zeta eta theta"


def _text(k: int) -> str:
    return f"row {k} " + " ".join(WORDS.split()[: 1 + (k * 7) % 8] * (1 + k % 3))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from torchtitan_omni.data.tokenizer import OmniTokenizer

    texts = [" ".join(_text(k) for k in range(N_TEXT)) + " draw a red seven " * 5]
    return OmniTokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok"), texts=texts))


@pytest.fixture(scope="module")
def text_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("text"))
    rows = [{"text": _text(k)} for k in range(N_TEXT)]
    write_jsonl(os.path.join(root, "train-text.jsonl"), [r for k, r in enumerate(rows) if k != BAD])
    write_jsonl(os.path.join(root, "train-bad.jsonl"), [{"nothing": BAD}])
    return root


def _loader(root, tok, rank, world, *args, workers=0, infinite=False, processing=None):
    cfg = job_config("--training.dataset", "custom", "--training.dataset_path", root,
                     "--training.seq_len", "64", "--training.local_batch_size", "2",
                     "--data.buffer_docs", "4", "--training.dataloader.num_workers", str(workers),
                     *args)
    return build_omni_dataloader(world, rank, tok, cfg, processing=processing or {},
                                 infinite=infinite)


def _loaders(root, tok, world, *args, **kw):
    return [_loader(root, tok, r, world, *args, **kw) for r in range(world)]


def _save(loaders) -> dict:
    """The dataloader entries a checkpoint holds (per data rank, as the manager writes them)."""
    saved = {}
    for r, loader in enumerate(loaders):
        saved.update(DataloaderState(loader, r, len(loaders)).state_dict())
    return saved


def _resume(saved: dict, loaders) -> None:
    """Load as the manager does: own entry under the same size, else every entry re-split."""
    keys = {f"dataloader.{k}" for k in saved}
    for r, loader in enumerate(loaders):
        state = DataloaderState(loader, r, len(loaders)).for_loading(keys, "dataloader")
        state.load_state_dict(saved)


def _markers(batch, tok) -> list[int]:
    """The row marker of every document of a batch (padding documents have none)."""
    flat = batch[B.INPUT].flatten()
    cu = batch[B.CU_SEQLENS].tolist()
    found = []
    for a, b in zip(cu[:-1], cu[1:]):
        doc = flat[a:b]
        rows = re.findall(r"row (\d+)\b", tok.decode(doc.tolist()))
        if not rows:
            assert (doc == tok.special.pad).all(), tok.decode(doc.tolist())
            continue
        assert len(rows) == 1, rows
        found.append(int(rows[0]))
    return found


def _take(iters, counts, tok) -> list[int]:
    seen = []
    for it, n in zip(iters, counts):
        for _ in range(n):
            batch, _ = next(it)
            seen += _markers(batch, tok)
    return seen


def _drain(loaders, tok) -> list[int]:
    return [m for loader in loaders for batch, _ in loader for m in _markers(batch, tok)]


def _once(seen: list[int]) -> None:
    counts = Counter(seen)
    repeated = sorted(r for r, c in counts.items() if c > 1)
    missing = sorted(set(ROWS) - set(counts))
    assert not repeated and not missing and set(counts) == set(ROWS), (
        f"repeated {repeated}, missing {missing}")


def _skipped(loaders) -> int:
    return sum(loader.stats()["malformed_row"] for loader in loaders)


@pytest.mark.parametrize("old,steps,new,workers", [
    (2, (3, 2), 1, (0, 0)),
    (2, (2, 3), 3, (0, 0)),
    (1, (3,), 2, (0, 0)),
    (2, (1, 2), 2, (0, 2)),   # same data ranks, other number of workers
    (1, (4,), 3, (2, 0)),     # workers on the old side
])
def test_resplit_covers_the_epoch_once(text_root, tok, old, steps, new, workers):
    first = _loaders(text_root, tok, old, workers=workers[0])
    seen = _take([iter(l) for l in first], steps, tok)
    assert seen and len(seen) < len(ROWS)
    saved = _save(first)
    resumed = _loaders(text_root, tok, new, workers=workers[1])
    if old != new:
        _resume(saved, resumed)
        assert resumed[0].dataset._resplit["buffered"]  # buffered documents are dealt out
    else:  # same data ranks, other workers: the manager refuses, the loader can re-split
        with pytest.raises(ValueError, match="loader workers"):
            _resume(saved, resumed)
        resumed = _loaders(text_root, tok, new, workers=workers[1])
        states = [pickle.loads(saved[f"dp_rank_{r}"]) for r in range(old)]  # loader.state_dict()s
        for loader in resumed:
            loader.load_state_dict_resharded(states)
    after = _drain(resumed, tok)
    _once(seen + after)
    assert _skipped(resumed) == 1  # the bad row counted once, whoever read it


def test_chained_resplits_2_3_2(text_root, tok):
    first = _loaders(text_root, tok, 2)
    seen = _take([iter(l) for l in first], (2, 1), tok)
    second = _loaders(text_root, tok, 3)
    _resume(_save(first), second)
    seen += _take([iter(l) for l in second], (1, 0, 2), tok)
    third = _loaders(text_root, tok, 2)
    _resume(_save(second), third)
    _once(seen + _drain(third, tok))
    assert _skipped(third) == 1


def test_a_resplit_state_resumes_exactly(text_root, tok):
    """A re-split loader's own state (owed rows, exclusions) restores under the same size."""
    first = _loaders(text_root, tok, 2, infinite=True)
    _take([iter(l) for l in first], (2, 1), tok)
    second = _loaders(text_root, tok, 3, infinite=True)
    _resume(_save(first), second)
    iters = [iter(l) for l in second]
    _take(iters, (1, 1, 1), tok)
    saved = _save(second)
    expected = [[next(it) for _ in range(6)] for it in iters]  # into the next epoch
    third = _loaders(text_root, tok, 3, infinite=True)
    _resume(saved, third)
    for loader, want in zip(third, expected):
        it = iter(loader)
        for batch, labels in want:
            got, got_labels = next(it)
            assert got.keys() == batch.keys()
            assert all(torch.equal(got[k], batch[k]) for k in batch)
            assert torch.equal(got_labels, labels)


def _dataset_state(loader) -> dict:
    inner = pickle.loads(loader.state_dict()[f"dp_rank_{loader.dp_rank}"])
    return inner["dataset_state"]


def _buffered(loaders) -> list[int]:
    """Rows of the documents the loaders have read but not yet yielded."""
    out = []
    for loader in loaders:
        src = loader.dataset.source
        for e, q, _, s, n in _dataset_state(loader)["buffer"]:
            row, _ = src.row(int(src._order(e)[q * n + s]))
            out.append(int(re.findall(r"row (\d+)", row["text"])[0]))
    return out


@pytest.mark.parametrize("chain", [False, True])
def test_resplit_when_one_shard_has_wrapped(text_root, tok, chain):
    first = _loaders(text_root, tok, 2, infinite=True)
    it0, it1 = iter(first[0]), iter(first[1])
    seen = _take([it1], [1], tok)
    while _dataset_state(first[0])["epoch"] == 0:  # shard 0 moves into epoch 1
        seen += _markers(next(it0)[0], tok)
    seen += _take([it0], [2], tok)
    st0 = _dataset_state(first[0])
    assert st0["epoch"] == 1 and st0["cursor"] > 0 and _dataset_state(first[1])["epoch"] == 0
    new = _loaders(text_root, tok, 3, infinite=True)
    _resume(_save(first), new)
    plan = new[0].dataset._resplit
    assert plan["epoch"] == 0 and plan["exclude"]["epoch"] == 1  # rows of epoch 1 read by shard 0
    assert {k[0] for k in plan["buffered"]} == {0, 1}  # documents of both epochs buffered
    iters = [iter(l) for l in new]
    if chain:  # 3 -> 2 while the new shards still owe rows of epoch 0 (and exclude epoch 1's)
        seen += _markers(next(iters[0])[0], tok)  # new shard 0 moves on, 1 and 2 do not
        states = [_dataset_state(l) for l in new]
        assert all(st["epoch"] == 0 and st["pending"]["next"] == 0 for st in states[1:])
        again = _loaders(text_root, tok, 2, infinite=True)
        _resume(_save(new), again)
        assert again[0].dataset._resplit["exclude"]["epoch"] == 1
        new, iters = again, [iter(l) for l in again]

    def counts():
        return Counter(seen + _buffered(new))

    checked = set()
    for _ in range(200):  # lockstep: one batch of each new rank at a time
        epochs = [_dataset_state(l)["epoch"] for l in new]
        if min(epochs) >= 1 and max(epochs) == 1 and "A" not in checked:
            # epoch 0 complete, epoch 1 partly read: every row once or twice
            c = counts()
            assert set(c) == set(ROWS) and set(c.values()) <= {1, 2}, c
            checked.add("A")
        if min(epochs) >= 2:
            # epochs 0 and 1 complete, epoch 2 partly read: every row two or three times
            assert max(epochs) == 2
            c = counts()
            assert set(c) == set(ROWS) and set(c.values()) <= {2, 3}, c
            checked.add("B")
            break
        for it in iters:
            seen += _markers(next(it)[0], tok)
    assert checked == {"A", "B"}


def test_shards_more_than_one_epoch_apart_are_refused(text_root, tok):
    first = _loaders(text_root, tok, 2, infinite=True)
    it0 = iter(first[0])
    iter(first[1])
    while _dataset_state(first[0])["epoch"] < 2:
        next(it0)
    new = _loader(text_root, tok, 0, 1, infinite=True)
    with pytest.raises(ValueError, match="more than one epoch apart"):
        _resume(_save(first), [new])


def test_streaming_is_refused(text_root, tok):
    first = _loaders(text_root, tok, 2, "--data.streaming")
    new = _loader(text_root, tok, 0, 1, "--data.streaming")
    with pytest.raises(ValueError, match="streaming dataset's position cannot be re-split"):
        _resume(_save(first), [new])


def test_runs_round_trip():
    import numpy as np

    for values in ([], [5], [3, 4], [0, 2, 3, 5, 6, 7, 8, 20, 40, 60], list(range(7, 1000, 3))):
        runs = runs_encode(np.array(values, dtype=np.int64))
        assert runs_decode(runs).tolist() == values
    assert len(runs_encode(np.arange(10, 10**6, 4))) == 1


# --------------------------------------------------------------------------- exact processing
N_GEN = 60


@pytest.fixture(scope="module")
def gen_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gen"))
    rows = []
    for k in range(N_GEN):
        write_png(os.path.join(root, f"g{k}.png"), 16, 16, seed=k)
        rows.append({"caption": f"row {k} draw a red seven", "gen_image": f"g{k}.png"})
    write_jsonl(os.path.join(root, "train.jsonl"), rows)
    return root


def _record(loaders, log: list) -> None:
    """Record every document the loaders' datasets build: (key, tokens, labels)."""
    for loader in loaders:
        ds: OmniDataset = loader.dataset
        build = ds._documents

        def documents(ref, row, source, build=build):
            docs = build(ref, row, source)
            log.extend((d.key, tuple(d.tokens.tolist()), tuple(d.labels().tolist())) for d in docs)
            return docs

        ds._documents = documents


def _gen_loaders(root, tok, world):
    return _loaders(root, tok, world, "--data.gen_cfg_drop_prob", "0.5",
                    processing={"gen_image": SMALL_PROCESSING["gen_image"]})


def test_resplit_processes_every_row_as_the_uninterrupted_run(gen_root, tok):
    """Buffered documents are rebuilt and owed rows read with the old shards' RNG (caption
    drop included): the documents are those of the uninterrupted run, each built once (a
    buffered one once more, on rebuild)."""
    reference: list = []
    whole = _gen_loaders(gen_root, tok, 2)
    _record(whole, reference)
    assert sum(1 for loader in whole for _ in loader) > 2
    want = {key: (t, l) for key, t, l in reference}
    assert len(want) == len(reference) == N_GEN
    dropped = sum(tok.special.pad in t for t, _ in want.values())
    assert 0 < dropped < N_GEN  # some captions dropped, some kept

    before: list = []
    first = _gen_loaders(gen_root, tok, 2)
    _record(first, before)
    for loader, n in zip(first, (1, 2)):
        it = iter(loader)
        for _ in range(n):
            next(it)
    buffered = [tuple(k) for l in first for k in _dataset_state(l)["buffer"]]
    assert buffered
    after: list = []
    second = _gen_loaders(gen_root, tok, 3)
    _record(second, after)
    _resume(_save(first), second)
    assert runs_decode(second[0].dataset._resplit["owed"]).size > 20  # rows nobody read yet
    assert sum(1 for loader in second for _ in loader)
    built = Counter(key for key, _, _ in before + after)
    assert set(built) == set(want)
    assert all(n == 1 + (key in buffered) for key, n in built.items()), built
    for key, t, l in before + after:
        assert (t, l) == want[key], key
