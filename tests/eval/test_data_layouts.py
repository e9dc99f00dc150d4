"""The real-data layouts docs/convergence.md tells recipes to use, on tiny fixtures, read by
the training loader and, through ``[validation]``, by the validator's loader:

- FineWeb-style Parquet shards (``text`` plus FineWeb's other columns) as ``train/`` and
  ``val/`` folders of symlinks to the chosen shards;
- ShareGPT4V-style conversations: one JSON array file (``id``, ``image`` relative to the
  dataset root, ``conversations`` with ``from``/``value``; some rows without an image), the
  images in sub-folders, with a held-out JSON file for validation; or ``train.json`` and
  ``val.json`` in that folder.
"""

from __future__ import annotations

import json
import os


from tests.data.helpers import SMALL_PROCESSING, job_config, tokenizer_dir, write_png
from tests.data.helpers import loader_batches as _batches
from torchtitan_omni.eval.validator import validation_job_config, validation_problem


def _fineweb_shard(path, start: int, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Web page number {i} says hello world to a small corpus of words." for i in
             range(start, start + rows)]
    pq.write_table(pa.table({
        "text": texts, "id": [f"<urn:uuid:{i}>" for i in range(start, start + rows)],
        "dump": ["CC-MAIN-2024-10"] * rows, "url": [f"https://example.org/{i}" for i in
                                                     range(start, start + rows)],
        "date": ["2024-02-21T00:00:00Z"] * rows, "file_path": ["s3://x.warc.gz"] * rows,
        "language": ["en"] * rows, "language_score": [0.9] * rows,
        "token_count": [12] * rows,
    }), path)


def test_fineweb_parquet_shards_as_train_and_val_folders(tmp_path):
    raw = tmp_path / "fineweb" / "sample" / "10BT"
    raw.mkdir(parents=True)
    for k in range(3):
        _fineweb_shard(raw / f"00{k}_00000.parquet", 100 * k, 20)
    root = tmp_path / "corpus"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    for k in (0, 1):
        os.symlink(raw / f"00{k}_00000.parquet", root / "train" / f"00{k}_00000.parquet")
    os.symlink(raw / "002_00000.parquet", root / "val" / "002_00000.parquet")
    cfg = job_config("--training.dataset", "fineweb", "--training.dataset_path", str(root),
                     "--model.hf_assets_path", tokenizer_dir(tmp_path),
                     "--training.seq_len", "64", "--training.local_batch_size", "2",
                     "--validation.enable", "--validation.seq_len", "64")
    train = _batches(cfg, "train", 100, {})
    assert sum(int(b["real_tokens"]) for b, _ in train) > 0 and len(train) >= 5
    assert validation_problem(cfg) is None
    val = _batches(validation_job_config(cfg), cfg.validation.split, 100, {})
    assert val and all((labels != -100).any() for _, labels in val)
    assert len(val) < len(train)  # one shard of three


def test_sharegpt4v_json_array_with_image_folders(tmp_path):
    root = tmp_path / "sharegpt4v"
    images = root / "coco" / "train2017"
    images.mkdir(parents=True)

    def rows(first: int, n: int) -> list:
        out = []
        for i in range(first, first + n):
            name = f"{i:012d}.jpg"
            write_png(images / name, 24, 32, seed=i)  # PIL writes it by its extension: JPEG
            out.append({"id": name[:-4], "image": f"coco/train2017/{name}", "conversations": [
                {"from": "human", "value": "<image>\nWhat do you see in this image?"},
                {"from": "gpt", "value": f"A noisy picture number {i}."}]})
        out.append({"id": f"text-{first}", "conversations": [
            {"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello."}]})
        return out

    (root / "sharegpt4v_instruct_gpt4-vision_cap100k.json").write_text(json.dumps(rows(0, 6)))
    (root / "held_out.json").write_text(json.dumps(rows(100, 3)))
    train_file = str(root / "sharegpt4v_instruct_gpt4-vision_cap100k.json")
    cfg = job_config("--training.dataset", "sharegpt4v", "--training.dataset_path", train_file,
                     "--model.hf_assets_path", tokenizer_dir(tmp_path),
                     "--training.seq_len", "128", "--training.local_batch_size", "2",
                     "--validation.enable", "--validation.seq_len", "128",
                     "--validation.dataset_path", str(root / "held_out.json"),
                     "--data.modalities", "image", "--data.bad_sample_policy", "error")
    processing = {"image": SMALL_PROCESSING["image"]}
    train = _batches(cfg, "train", 100, processing)
    assert sum(int(b["image_grid_thw"].shape[0]) for b, _ in train if "image_grid_thw" in b) == 6
    assert validation_problem(cfg) is None
    val = _batches(validation_job_config(cfg), cfg.validation.split, 100, processing)
    assert sum(int(b["image_grid_thw"].shape[0]) for b, _ in val if "image_grid_thw" in b) == 3
    # or as a folder of split files next to the image folders
    os.rename(train_file, root / "train.json")
    os.rename(root / "held_out.json", root / "val.json")
    folder = job_config("--training.dataset", "sharegpt4v", "--training.dataset_path", str(root),
                        "--model.hf_assets_path", cfg.model.hf_assets_path,
                        "--training.seq_len", "128", "--validation.enable",
                        "--validation.seq_len", "128", "--data.bad_sample_policy", "error")
    for split, images in (("train", 6), ("val", 3)):
        got = _batches(validation_job_config(folder) if split == "val" else folder, split, 100,
                       processing)
        assert sum(int(b["image_grid_thw"].shape[0]) for b, _ in got
                   if "image_grid_thw" in b) == images


def test_missing_validation_path_is_one_line(tmp_path):
    cfg = job_config("--validation.enable", "--validation.dataset_path", str(tmp_path / "nope"))
    problem = validation_problem(cfg)
    assert problem.startswith("validation.dataset_path") and "nope" in problem
    assert "\n" not in problem
    assert validation_problem(cfg, check_data=False) is None  # a spec with its own loader
    cfg = job_config("--validation.enable", "--validation.freq", "0")
    assert validation_problem(cfg) == "validation.freq must be >= 1, got 0"
    cfg = job_config("--validation.enable", "--validation.seq_len", "30")
    assert validation_problem(cfg, ulysses_degree=4).startswith("validation.seq_len (30)")


def test_held_out_file_next_to_the_bundled_dataset_is_read_as_is(tmp_path):
    """A validation file given while training on the bundled dataset is read as a plain file
    (never taken for a bundled dataset folder to build)."""
    from torchtitan_omni.eval.validator import HELD_OUT, validation_dataset

    held_out = tmp_path / "val-text.jsonl"
    held_out.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(4)))
    cfg = job_config("--training.dataset", "omni_default", "--validation.enable",
                     "--validation.dataset_path", str(held_out),
                     "--model.hf_assets_path", tokenizer_dir(tmp_path))
    assert validation_dataset(cfg) == (HELD_OUT, str(held_out))
    val = _batches(validation_job_config(cfg), cfg.validation.split, 100, {})
    assert sum(int((labels != -100).sum()) for _, labels in val) > 0
    assert sorted(os.listdir(tmp_path)) == ["tok", "val-text.jsonl"]  # nothing built
    bundled = job_config("--training.dataset", "omni_default", "--validation.enable")
    assert validation_dataset(bundled) == ("omni_default", bundled.training.dataset_path)
