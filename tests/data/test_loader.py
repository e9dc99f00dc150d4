"""The loader end to end on a small dataset with real media files: the batch contract, media
order vs embed indices, sharding, resumption (workers or not, map-style and streaming) and
every bad-input case."""

import logging
import os
import re

import numpy as np
import pytest
import torch

from tests.data.helpers import (
    SMALL_PROCESSING, job_config, tokenizer_dir, write_jsonl, write_mp4, write_png, write_wav,
)
from torchtitan_omni.data.bad_samples import REASONS, BadSampleError
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.source import RowSource, ShardSpec, find_files
from torchtitan_omni.data.tokenizer import OmniTokenizer
from torchtitan_omni.errors import DataFileError
from torchtitan_omni.protocols import batch as B

N_ROWS = 30


def _image_hw(k):
    return (8, 16, 8, 16)[k % 4], (8, 8, 16, 16)[k % 4]


def _good_rows(root):
    rows = []
    clip = np.stack([np.full((16, 16, 3), 40 * i, np.uint8) for i in range(6)])
    for k in range(N_ROWS):
        kind = k % 5
        if kind == 0:
            rows.append({"text": f"item {k} plain words for language modelling"})
        elif kind == 1:
            h, w = _image_hw(k)
            write_png(os.path.join(root, f"img{k}.png"), h, w, seed=k)
            rows.append({"messages": [
                {"role": "user", "content": f"item {k} <image> and item {k}b <image> what?"},
                {"role": "assistant", "content": f"answer {k}"}],
                "images": [f"img{k}.png", f"img{k}.png"]})
        elif kind == 2:
            write_wav(os.path.join(root, f"a{k}.wav"), 0.3 + 0.1 * (k % 3))
            rows.append({"messages": [{"role": "user", "content": f"item {k} <audio>"},
                                      {"role": "assistant", "content": f"heard {k}"}],
                         "audios": [f"a{k}.wav"]})
        elif kind == 3:
            write_mp4(os.path.join(root, f"v{k}.mp4"), clip, fps=4)
            rows.append({"messages": [{"role": "user", "content": f"item {k} <video>"},
                                      {"role": "assistant", "content": f"moves {k}"}],
                         "videos": [f"v{k}.mp4"]})
        else:
            write_png(os.path.join(root, f"g{k}.png"), 16, 16, seed=100 + k)
            rows.append({"messages": [{"role": "user", "content": f"item {k} draw"},
                                      {"role": "assistant", "content": "<gen_image>"}],
                         "gen_images": [f"g{k}.png"]})
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds"))
    rows = _good_rows(root)
    # two files per split: the loader concatenates them
    write_jsonl(os.path.join(root, "train-a.jsonl"), rows[: N_ROWS // 2])
    write_jsonl(os.path.join(root, "train-b.jsonl"), rows[N_ROWS // 2:])
    tok = OmniTokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok"), texts=[
        "item plain words for language modelling answer heard moves draw what and " * 20]))
    return root, tok


def _loader(root, tok, *args, rank=0, world=1, processing=SMALL_PROCESSING, **kw):
    cfg = job_config("--training.dataset", "custom", "--training.dataset_path", root,
                     "--training.seq_len", "96", "--training.local_batch_size", "2",
                     "--data.buffer_docs", "8", *args)
    return build_omni_dataloader(world, rank, tok, cfg, processing=processing, **kw)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for (ba, la), (bb, lb) in zip(a, b):
        assert ba.keys() == bb.keys()
        for k in ba:
            assert torch.equal(ba[k], bb[k]), k
        assert torch.equal(la, lb)


def test_batch_contract_and_media_order(dataset):
    root, tok = dataset
    sp = tok.special
    seen_modalities = set()
    # no caption drop here: it writes pad tokens into real documents
    for batch, labels in _take(iter(_loader(root, tok, "--data.gen_cfg_drop_prob", "0")), 8):
        bsz, s = batch[B.INPUT].shape
        assert labels.shape == (bsz, s) and s % 8 == 0 and s <= 96
        cu = batch[B.CU_SEQLENS]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == bsz * s
        assert ((cu[1:] - cu[:-1]) > 0).all()
        assert int(batch[B.REAL_TOKENS]) == int((batch[B.INPUT] != sp.pad).sum())
        for key, value in batch.items():
            if B.is_token_aligned(key):
                assert value.shape == (bsz, s), key
        flat = batch[B.INPUT].flatten()
        for m in ("image", "video", "audio", "gen_image"):
            key = B.embed_index_key(m)
            if key not in batch:
                assert not any(k.startswith(m + "_") for k in batch), m
                continue
            seen_modalities.add(m)
            idx = batch[key].flatten()
            placed = idx[idx >= 0]
            assert placed.tolist() == list(range(len(placed)))  # rows in flattened order
            assert (flat[idx >= 0] == sp.media_ids(m)[1]).all()
        if "image_grid_thw" in batch:
            # each image item is the one its placeholder's sample names, in flattened order
            starts = (flat == sp.media_ids("image")[0]).nonzero().flatten().tolist()
            grids = batch["image_grid_thw"].tolist()
            assert len(starts) == len(grids)
            for p, grid in zip(starts, grids):
                text = tok.decode(flat[max(0, p - 12):p].tolist())
                k = int(re.findall(r"item (\d+)", text)[-1])
                h, w = _image_hw(k)
                assert grid == [1, h // 4, w // 4]
            assert batch["image_patches"].shape[0] == sum(t * h * w for t, h, w in grids)
    assert seen_modalities == {"image", "video", "audio", "gen_image"}


def test_shards_are_disjoint_and_cover_the_split(dataset):
    root, _ = dataset
    files = find_files(root, "train")
    for streaming in (False, True):
        src = RowSource(files, streaming=streaming, seed=3)
        seen = []
        for s in range(3):
            seen += [
                (src_.file, src_.row) for _, _, src_ in src.shard_rows(ShardSpec(s, 3), epoch=1)
            ]
        assert len(seen) == len(set(seen)) == N_ROWS
    a = [r for _, r, _ in RowSource(files, seed=3).shard_rows(ShardSpec(0, 1), epoch=0)]
    b = [r for _, r, _ in RowSource(files, seed=3).shard_rows(ShardSpec(0, 1), epoch=1)]
    assert a != b  # a new order each epoch


@pytest.mark.parametrize("workers,streaming", [(0, False), (2, False), (0, True)])
def test_resume_yields_the_same_next_batches(dataset, workers, streaming):
    root, tok = dataset
    args = ["--training.dataloader.num_workers", str(workers), "--data.gen_cfg_drop_prob", "0.5"]
    if streaming:
        args.append("--data.streaming")
    first = _loader(root, tok, *args)
    it = iter(first)
    _take(it, 5)  # more than an epoch of some workers: the buffer spans epochs
    state = first.state_dict()
    expected = _take(it, 4)
    resumed = _loader(root, tok, *args)
    resumed.load_state_dict(state)
    _same(_take(iter(resumed), 4), expected)


def test_two_ranks_read_different_rows(dataset):
    root, tok = dataset
    a = _take(iter(_loader(root, tok, rank=0, world=2)), 2)
    b = _take(iter(_loader(root, tok, rank=1, world=2)), 2)
    assert not torch.equal(a[0][0][B.INPUT], b[0][0][B.INPUT])


def _bad_dataset(root):
    os.makedirs(root, exist_ok=True)
    write_png(os.path.join(root, "ok.png"), 8, 8)
    with open(os.path.join(root, "corrupt.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n not really a png")
    with open(os.path.join(root, "corrupt.wav"), "wb") as f:
        f.write(b"RIFF0000WAVEfmt garbage")
    write_wav(os.path.join(root, "ok.wav"), 0.2)

    def img(content, images):
        return {"messages": [{"role": "user", "content": content},
                             {"role": "assistant", "content": "fine"}], "images": images}

    rows = [
        {"text": "good text one"},  # 0
        img("<image> missing", ["nope.png"]),  # 1 missing_media
        img("<image> corrupt", ["corrupt.png"]),  # 2 corrupt_media
        {
            "messages": [
                {"role": "user", "content": "<audio> bad"},
                {"role": "assistant", "content": "x"},
            ],
            "audios": ["corrupt.wav"],
        },  # 3 corrupt
        img("<img> unknown", ["ok.png"]),  # 4 unknown_placeholder
        img("<image><image> two", ["ok.png"]),  # 5 placeholder_mismatch
        {
            "messages": [
                {"role": "user", "content": "long " * 400},
                {"role": "assistant", "content": "x"},
            ]
        },  # 6 too_long
        img("<image> fine", ["ok.png"]),  # 7
        {
            "messages": [
                {"role": "user", "content": "<video>"},
                {"role": "assistant", "content": "x"},
            ],
            "videos": ["clip.mp4"],
        },  # 8 disabled
        {"nothing": 1},  # 9 malformed_row
    ]
    write_jsonl(os.path.join(root, "train.jsonl"), rows)
    return rows


EXPECTED = {**dict.fromkeys(REASONS, 0), "missing_media": 1, "corrupt_media": 2,
            "unknown_placeholder": 1, "placeholder_mismatch": 1, "too_long": 1,
            "modality_disabled": 1, "malformed_row": 1}
BAD_ROWS = {1, 2, 3, 4, 5, 6, 8, 9}


def test_bad_samples_are_skipped_logged_once_and_counted(dataset, tmp_path, caplog):
    _, tok = dataset
    root = str(tmp_path / "bad")
    _bad_dataset(root)
    no_video = {k: v for k, v in SMALL_PROCESSING.items() if k != "video"}
    loader = _loader(root, tok, "--data.buffer_docs", "1", processing=no_video, infinite=False)
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
    assert batches and loader.stats() == EXPECTED
    logged = [r.getMessage() for r in caplog.records if "skipping sample" in r.getMessage()]
    assert len(logged) == len(BAD_ROWS)
    for row in BAD_ROWS:
        assert sum(f"train.jsonl line {row + 1}:" in m for m in logged) == 1, (row, logged)
    # the good rows all made it
    texts = "".join(tok.decode(b[B.INPUT].flatten().tolist()) for b, _ in batches)
    assert "good text one" in texts and "fine" in texts

    # a second epoch counts again but logs nothing new
    caplog.clear()
    loop = _loader(root, tok, "--data.buffer_docs", "1", processing=no_video)
    it = iter(loop)
    with caplog.at_level(logging.WARNING):
        while loop.stats()["malformed_row"] < 2:
            next(it)
    again = [r.getMessage() for r in caplog.records if "skipping sample" in r.getMessage()]
    assert len(again) == len(BAD_ROWS)


@pytest.mark.parametrize("row,reason", [(1, "missing_media"), (2, "corrupt_media"),
                                        (4, "unknown_placeholder"), (6, "too_long")])
def test_error_policy_names_file_and_row(dataset, tmp_path, row, reason):
    _, tok = dataset
    root = str(tmp_path / "bad")
    rows = _bad_dataset(root)
    write_jsonl(os.path.join(root, "train.jsonl"), [rows[0], rows[row]])
    loader = _loader(root, tok, "--data.bad_sample_policy", "error", "--data.no-shuffle",
                     infinite=False)
    with pytest.raises(BadSampleError) as err:
        list(loader)
    msg = str(err.value)
    assert os.path.join(root, "train.jsonl") in msg and "line 2" in msg and reason in msg


def test_missing_split_and_dataset_errors(dataset, tmp_path):
    root, tok = dataset
    with pytest.raises(FileNotFoundError, match="split 'nosuch'"):
        _loader(root, tok, "--data.split", "nosuch")
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        _loader(str(tmp_path / "absent"), tok)


def test_fixed_length_and_token_budget(dataset):
    root, tok = dataset
    fixed = _take(iter(_loader(root, tok, "--data.pad_to_fixed_length")), 3)
    assert all(b[B.INPUT].shape == (2, 96) for b, _ in fixed)
    budget = _take(iter(_loader(root, tok, "--data.no-packing", "--data.token_budget", "128")), 6)
    for b, _ in budget:
        assert b[B.INPUT].numel() <= 128
        assert len(b[B.CU_SEQLENS]) - 1 <= 2 * b[B.INPUT].shape[0]  # one document (+ pad) per row
    assert len({b[B.INPUT].shape[0] for b, _ in budget}) > 1  # rows vary with lengths


def test_auto_workers():
    from torchtitan_omni.data.loader import auto_workers

    assert auto_workers(16, 1, on_gpu=True) == 4
    assert auto_workers(32, 8, on_gpu=True) == 3
    assert auto_workers(2, 2, on_gpu=True) == 0
    assert auto_workers(64, 1, on_gpu=False) == 0


@pytest.mark.parametrize("streaming", [False, True])
def test_parquet_rows_read_with_datasets(tmp_path, streaming):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"parquet row {k}"} for k in range(5)]
    path = str(tmp_path / "train_0.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    src = RowSource(find_files(str(tmp_path), "train"), streaming=streaming, shuffle=False)
    got = list(src.shard_rows(ShardSpec(0, 1), epoch=0))
    assert [r["text"] for _, r, _ in got] == [r["text"] for r in rows]
    assert [str(s) for _, _, s in got] == [f"{path} row {k}" for k in range(5)]
    broken = tmp_path / "broken" / "train.parquet"
    broken.parent.mkdir()
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataFileError, match=f"cannot read Parquet file {broken}"):
        list(RowSource([str(broken)], streaming=streaming).shard_rows(ShardSpec(0, 1), epoch=0))
