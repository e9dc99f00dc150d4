"""The realistic benchmark workload (scripts/build_long_context_dataset.py --workload
realistic): media of real sizes as the 8B config processes them, the stated media share,
determinism, and rows the training pipeline loads as they were counted."""

import json
import os

import pytest
import soundfile as sf

from tests.data.helpers import job_config
from tests.harness import REPO, load_script
import torchtitan_omni.models  # noqa: F401  (registers the specs)
from torchtitan_omni.data import default_dataset as dd
from torchtitan_omni.data.default_dataset import realistic
from torchtitan_omni.data.loader import build_omni_dataloader, model_processing
from torchtitan_omni.data.media import load_video
from torchtitan_omni.data.tokenizer import OmniTokenizer
from torchtitan_omni.errors import OmniInputError

CONFIG = str(REPO / "train_configs" / "llama_omni_8B.toml")
SEQ = 8192
POOL = "6,3,4"  # small: the cache is made once per test session


@pytest.fixture(scope="module")
def bundled():
    """The repository's bundled dataset and tokenizer (built once if missing)."""
    data = dd.ensure_default_dataset(REPO / "data" / "omni_default", REPO / "assets" / "tokenizer")
    return str(data), str(REPO / "assets" / "tokenizer")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("media_cache"))


def _build(out, bundled, cache, *extra):
    builder = load_script("build_long_context_dataset")
    data, tok = bundled
    return builder.main([
        "--config", CONFIG, "--seq-len", str(SEQ), "--out", str(out), "--workload", "realistic",
        "--rows", "3", "--pool", POOL, "--media-cache", cache, "--jobs", "2", "--quiet",
        "--training.dataset_path", data, "--model.hf_assets_path", tok, *extra,
    ])


@pytest.fixture(scope="module")
def built(tmp_path_factory, bundled, cache):
    out = tmp_path_factory.mktemp("realistic") / "8k"
    return out, _build(out, bundled, cache)


def test_rows_hold_the_stated_media_share_of_real_sized_media(built):
    out, manifest = built
    assert manifest["workload"] == "realistic" and manifest["media_share_target"] == 0.5
    assert 0.4 <= manifest["media_share"] <= 0.6
    for r in manifest["per_row"]:
        assert 0.4 <= r["media_share"] <= 0.6
        assert 0.9 * SEQ <= r["tokens"] <= SEQ
        assert set(r["modalities"]) == {"image", "video", "audio"}
    mods = manifest["modalities"]
    # per placeholder: begin + the item's pads + end
    assert 256 <= mods["image"]["item_tokens"]["min"] - 2
    assert mods["image"]["item_tokens"]["max"] - 2 <= 1280  # the 8B processing's bound
    assert 16 <= mods["video"]["frames"]["min"] <= mods["video"]["frames"]["max"] <= 32
    assert 10.0 <= mods["audio"]["seconds"]["min"] <= mods["audio"]["seconds"]["max"] <= 30.0
    total = manifest["text_tokens"] + sum(m["tokens"] for m in mods.values())
    assert total == manifest["tokens"] == sum(r["tokens"] for r in manifest["per_row"])
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    for row, stats in zip(rows, manifest["per_row"]):
        for m, key in (("image", "images"), ("video", "videos"), ("audio", "audios")):
            assert row["text"].count(f"<{m}>") == len(row[key]) == stats["modalities"][m]["items"]


def test_media_files_have_the_stated_sizes(built, cache):
    """Independently of the builder's counts: the files' own sizes, the frames the pipeline's
    video reader samples at the 8B config's fps, and the clips' durations."""
    _, manifest = built
    root = manifest["media_cache"]
    index = json.loads(open(os.path.join(root, "media.json")).read())
    from PIL import Image

    for e in index["image"]:
        with Image.open(os.path.join(root, e["path"])) as img:
            assert img.size == (e["width"], e["height"])
            assert all(448 <= s <= 1024 for s in img.size)
    video_cfg = model_processing(job_config("--job.config_file", CONFIG))["video"]
    for e in index["video"]:
        frames = load_video(e["path"], root, video_cfg.fps, video_cfg.max_frames, 2).frames
        assert 16 <= len(frames) <= 32 and len(frames) == e["frames"] // 2
        assert 224 <= min(frames.shape[1:3]) and max(frames.shape[1:3]) <= 448
    for e in index["audio"]:
        assert 10.0 <= sf.info(os.path.join(root, e["path"])).duration <= 30.0


def test_builds_are_deterministic(built, bundled, cache, tmp_path):
    out, manifest = built
    again = _build(tmp_path / "again", bundled, cache)
    assert (tmp_path / "again" / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()
    assert again["per_row"] == manifest["per_row"]
    # the media themselves, made again from nothing by one process
    fresh = realistic.MediaCache(str(tmp_path / "fresh"), 0,
                                 os.path.join(bundled[0], "media", "speech", "train"))
    entries = fresh.ensure({"image": 2, "video": 1, "audio": 1}, jobs=1)
    old = os.path.join(cache, "seed0")
    for items in entries.values():
        for e in items:
            with open(os.path.join(fresh.root, e["path"]), "rb") as a, \
                    open(os.path.join(old, e["path"]), "rb") as b:
                assert a.read() == b.read(), e["path"]


def test_every_row_loads_through_the_training_pipeline(built, bundled):
    """The real loader and processors (not the builder's cached counts) give each row as one
    document of the counted length, with no sample skipped."""
    out, manifest = built
    cfg = job_config("--job.config_file", CONFIG, "--training.dataset", "long_context",
                     "--training.dataset_path", str(out), "--training.seq_len", str(SEQ),
                     "--training.local_batch_size", "1", "--data.modalities", "image,video,audio",
                     "--data.buffer_docs", "1", "--data.no-shuffle",
                     "--model.hf_assets_path", bundled[1])
    loader = build_omni_dataloader(1, 0, OmniTokenizer(bundled[1]), cfg)
    it = iter(loader)
    seen = sorted(int(next(it)[0]["real_tokens"]) for _ in manifest["per_row"])
    assert seen == sorted(r["tokens"] for r in manifest["per_row"])
    assert sum(loader.stats().values()) == 0


def test_bad_input_is_one_line(bundled, cache, tmp_path):
    builder = load_script("build_long_context_dataset")
    with pytest.raises(OmniInputError, match="unknown modality 'smell'"):
        builder.parse_weights("image,smell")
    with pytest.raises(OmniInputError, match="weight of video must be > 0"):
        builder.parse_weights("image:2,video:0")
    assert builder.parse_weights("image:2,audio") == {"image": 2.0, "audio": 1.0}
    with pytest.raises(OmniInputError, match="--pool must be 3 positive counts"):
        builder.parse_pool("4,4")
    empty = tmp_path / "no_dataset"
    empty.mkdir()
    with pytest.raises(OmniInputError, match="train-text.jsonl not found: build the bundled"):
        _build(tmp_path / "out", (str(empty), bundled[1]), cache, "--training.dataset", "x")
    with pytest.raises(OmniInputError, match="run: python scripts/build_default_dataset.py"):
        _build(tmp_path / "out", (str(empty), bundled[1]), cache, "--data.no-build_if_missing")
