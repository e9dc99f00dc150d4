"""The bundled default dataset: a real offline build (every task and split, its tokenizer, and
batches of every modality for the debug model's processing), and the build-once lock."""

import json
import multiprocessing as mp
import os
import time

import pytest

from tests.data.helpers import job_config
from torchtitan_omni.data import default_dataset as dd
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.tokenizer import OmniTokenizer, build_omni_tokenizer
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

DEBUG_PROCESSING = {  # what the CPU debug models declare (patch 8, 32 px generation)
    "image": ImageProcessing(patch_size=8, min_pixels=256, max_pixels=4096),
    "video": VideoProcessing(patch_size=8, min_pixels=256, max_pixels=1024, fps=2.0, max_frames=8),
    "audio": AudioProcessing(chunk_seconds=10.0),
    "gen_image": GenImageProcessing(image_size=32, downsample=4),
}
TASKS = {"text", "digits", "photos", "faces", "video", "speech", "generate"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("default")
    start = time.time()
    path = dd.ensure_default_dataset(root / "omni_default", root / "tokenizer")
    return path, root / "tokenizer", time.time() - start


def test_build_covers_every_task_and_split(built):
    path, tok_dir, seconds = built
    assert seconds < 120
    manifest = json.loads((path / dd.MANIFEST).read_text())
    for split in ("train", "val", "test"):
        assert set(manifest["splits"][split]) == TASKS
        assert all(n > 0 for n in manifest["splits"][split].values())
        for task in TASKS:
            assert (path / f"{split}-{task}.jsonl").is_file()
    tok = OmniTokenizer(str(tok_dir))
    assert 1000 < tok.get_vocab_size() <= 4096
    text = "Describe the image."
    assert tok.decode(tok.encode_text(text)) == text


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_modality_loads_without_skips(built, split):
    path, tok_dir, _ = built
    cfg = job_config("--training.dataset", "omni_default", "--training.dataset_path", str(path),
                     "--model.hf_assets_path", str(tok_dir), "--training.seq_len", "512",
                     "--training.local_batch_size", "2", "--data.split", split)
    loader = build_omni_dataloader(
        1, 0, OmniTokenizer(str(tok_dir)), cfg, processing=DEBUG_PROCESSING
    )
    seen = set()
    it = iter(loader)
    for _ in range(12):
        batch, labels = next(it)
        seen |= {m for m in DEBUG_PROCESSING if B.embed_index_key(m) in batch}
        assert (labels != -100).any()
    assert seen == set(DEBUG_PROCESSING)
    assert sum(loader.stats().values()) == 0


def test_held_out_splits_differ_from_train(built):
    path, _, _ = built

    def rows(name):
        with open(path / name) as f:
            return [json.loads(line) for line in f]

    train = {json.dumps(r["messages"]) for r in rows("train-speech.jsonl")}
    test = rows("test-speech.jsonl")
    assert test and any(json.dumps(r["messages"]) not in train for r in test)
    train_imgs = {r["images"][0] for r in rows("train-digits.jsonl")}
    assert not train_imgs & {r["images"][0] for r in rows("test-digits.jsonl")}


def _fake_build(out, seed=0, vocab_size=0):
    from torchtitan_omni.data.default_dataset.bpe import train_tokenizer

    time.sleep(0.5)
    with open(os.path.join(os.path.dirname(str(out)), "calls.txt"), "a") as f:
        f.write("built\n")
    train_tokenizer(["a tiny corpus"] * 3, os.path.join(out, "tokenizer"), vocab_size=300)
    with open(os.path.join(out, dd.MANIFEST), "w") as f:
        json.dump({"version": dd.VERSION}, f)


def _ensure(args):
    data_dir, tok_dir = args
    from torchtitan_omni.data.default_dataset import build

    # restored after: this also runs in the pytest process, whose later tests build for real
    real, build.build_default_dataset = build.build_default_dataset, _fake_build
    try:
        dd.ensure_default_dataset(data_dir, tok_dir)
    finally:
        build.build_default_dataset = real
    return os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))


def test_concurrent_ensure_builds_once(tmp_path):
    args = (str(tmp_path / "omni_default"), str(tmp_path / "tok"))
    with mp.get_context("fork").Pool(3) as pool:
        assert pool.map(_ensure, [args] * 3) == [True] * 3
    assert (tmp_path / "calls.txt").read_text().count("built") == 1
    assert dd.is_built(args[0])
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    _ensure(args)  # idempotent
    assert (tmp_path / "calls.txt").read_text().count("built") == 1


def test_tokenizer_builder_triggers_the_build(tmp_path, monkeypatch):
    from torchtitan_omni.data.default_dataset import build

    monkeypatch.setattr(build, "build_default_dataset", _fake_build)
    cfg = job_config("--training.dataset", "omni_default", "--training.dataset_path",
                     str(tmp_path / "ds"), "--model.hf_assets_path", str(tmp_path / "tok"))
    tok = build_omni_tokenizer(cfg)
    assert isinstance(tok, OmniTokenizer) and tok.special.bos == 0
    assert dd.is_built(tmp_path / "ds") and (tmp_path / "tok" / "tokenizer.json").is_file()
    off = job_config("--training.dataset", "omni_default", "--training.dataset_path",
                     str(tmp_path / "other"), "--data.no-build_if_missing")
    with pytest.raises(FileNotFoundError, match="build_default_dataset.py"):
        dd.maybe_build_default(off)


def test_long_context_builder_fills_rows_that_fit(built, tmp_path):
    """scripts/build_long_context_dataset.py: one long document per row, with images and
    video, that the training pipeline encodes within seq_len."""
    from tests.harness import REPO, load_script

    builder = load_script("build_long_context_dataset")
    path, tok_dir, _ = built
    out = tmp_path / "long"
    manifest = builder.main([
        "--config", str(REPO / "train_configs" / "llama_omni_debug.toml"), "--seq-len", "2048",
        "--out", str(out), "--rows", "3", "--workload", "toy", "--image-every", "256",
        "--video-every", "512",
        "--training.dataset_path", str(path), "--model.hf_assets_path", str(tok_dir),
    ])
    assert manifest["rows"] == 3
    assert (
        0.85 * 2048 < manifest["tokens_per_row"]["min"] <= manifest["tokens_per_row"]["max"] <= 2048
    )
    assert manifest["images_per_row"] >= 3 and manifest["videos_per_row"] >= 1
    # the toy workload's summary: thumbnails, a small share of the tokens
    assert manifest["workload"] == "toy" and set(manifest["modalities"]) == {"image", "video"}
    assert 0 < manifest["media_share"] < 0.1
    assert manifest["modalities"]["image"]["items"] == round(3 * manifest["images_per_row"])
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["text"].count("<image>") == len(row["images"])
        assert row["text"].count("<video>") == len(row["videos"])
        assert all((out / p).is_file() for p in row["images"] + row["videos"])
    # the text workload: the same paragraphs in documents of the same length, no media
    text = builder.main([
        "--config", str(REPO / "train_configs" / "llama_omni_debug.toml"), "--seq-len", "2048",
        "--out", str(tmp_path / "text"), "--rows", "3", "--workload", "text",
        "--training.dataset_path", str(path), "--model.hf_assets_path", str(tok_dir),
    ])
    assert text["workload"] == "text" and text["media_share"] == 0 and not text["modalities"]
    assert 0.85 * 2048 < text["tokens_per_row"]["min"] <= text["tokens_per_row"]["max"] <= 2048
    text_rows = [json.loads(line) for line in (tmp_path / "text" / "train.jsonl").read_text()
                 .splitlines()]
    assert len(text_rows) == 3
    assert all(not r.get("images") and not r.get("videos") for r in text_rows)
    assert all("<image>" not in r["text"] and "<video>" not in r["text"] for r in text_rows)
