"""The media datasets of the VeOmni paper in their on-disk layouts, on tiny fixtures read by the
training loader (and, through ``[validation]``, by the validator's loader):

- LLaVA-Video-178K: JSON arrays (and JSON lines) of ``{"id", "data_source", "video",
  "conversations"}`` whose ``<image>`` placeholder stands for the video, the clips under the
  dataset root (``academic_source/...``), split files in ``train/`` and ``val/``;
- VoiceAssistant-400K: Parquet shards of ``question``, ``question_audio`` (a Hugging Face Audio
  struct of embedded WAV/FLAC bytes), ``answer`` and columns to ignore;
- ImageNet (ILSVRC): ``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG`` beside
  ``LOC_synset_mapping.txt`` (or ``synset_mapping.json``), read as image generation.

Each test checks the documents' content: the media items, the expanded placeholders and the
labelled answers; and one bad input per layout gives one line naming its file.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from tests.data.helpers import SMALL_PROCESSING, job_config, tokenizer_dir, write_jsonl, write_mp4
from tests.data.helpers import loader_batches as _batches
from torchtitan_omni.data.bad_samples import BadSampleError
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.errors import DataFileError
from torchtitan_omni.eval.validator import validation_job_config, validation_problem
from torchtitan_omni.protocols import batch as B


def _config(root, tok: str, modalities: str, *extra: str):
    return job_config("--training.dataset_path", str(root), "--model.hf_assets_path", tok,
                      "--training.seq_len", "256", "--training.local_batch_size", "2",
                      "--validation.enable", "--validation.seq_len", "256",
                      "--data.modalities", modalities, "--data.bad_sample_policy", "error",
                      "--data.gen_cfg_drop_prob", "0", *extra)


def _content(tok, batches, modality: str) -> dict:
    """What the documents hold: decoded inputs and targets, media start tokens (and whether
    they are targets), pads placed, and the media tensors of ``modality``."""
    start, pad, _ = tok.special.media_ids(modality)
    out = {"inputs": "", "targets": "", "starts": 0, "start_targets": 0, "pads": 0,
           "placed": 0, "media": []}
    for batch, labels in batches:
        flat, lab = batch[B.INPUT].flatten(), labels.flatten()
        out["inputs"] += tok.decode(flat.tolist())
        out["targets"] += tok.decode(lab[lab != B.IGNORE_INDEX].tolist())
        out["starts"] += int((flat == start).sum())
        out["start_targets"] += int((lab == start).sum())
        out["pads"] += int((flat == pad).sum())
        index = batch.get(B.embed_index_key(modality))
        out["placed"] += int((index >= 0).sum()) if index is not None else 0
        out["media"].append(B.media(batch, modality))
        assert not any(k.startswith("image_") for k in batch if modality != "image"), batch.keys()
    return out


# ----------------------------------------------------------------------------- LLaVA-Video


def _clip(path, seed: int) -> None:
    """Six 32 px frames of a bright square moving right (an mp4 written with PyAV)."""
    frames = np.full((6, 32, 32, 3), 10, np.uint8)
    color = np.random.default_rng(seed).integers(80, 256, 3)
    for t in range(6):
        frames[t, 12:20, 2 + 4 * t:10 + 4 * t] = color
    write_mp4(path, frames, fps=4)


def _llava_video_rows(root, first: int, n: int) -> list[dict]:
    clips = root / "academic_source" / "activitynet"
    clips.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(first, first + n):
        _clip(clips / f"v_{i:04d}.mp4", i)
        rows.append({"id": f"v_{i:04d}", "data_source": "0_30_s_academic_v0_1",
                     "video": f"academic_source/activitynet/v_{i:04d}.mp4", "conversations": [
                         {"from": "human", "value": "<image>\nWhat moves in the video?"},
                         {"from": "gpt", "value": f"Square number {i} moves right."}]})
    return rows


def test_llava_video_json_and_jsonl_with_a_video_root(tmp_path):
    pytest.importorskip("av")
    root = tmp_path / "llava_video"
    (root / "train").mkdir(parents=True)
    (root / "train" / "0_30_s_academic_v0_1_cap_processed.json").write_text(
        json.dumps(_llava_video_rows(root, 0, 3)))
    write_jsonl(root / "train" / "0_30_s_academic_v0_1_oe_qa_processed.jsonl",
                _llava_video_rows(root, 10, 2))
    write_jsonl(root / "val" / "held_out.jsonl", _llava_video_rows(root, 100, 2))
    cfg = _config(root, tokenizer_dir(tmp_path), "video", "--training.dataset", "llava_video")
    tok = build_omni_tokenizer(cfg)
    processing = {"video": SMALL_PROCESSING["video"]}
    got = _content(tok, _batches(cfg, "train", 100, processing), "video")
    assert got["starts"] == 5 and got["start_targets"] == 0  # one video item per row, a prompt
    grids = np.concatenate([m["grid_thw"].numpy() for m in got["media"] if m])
    assert len(grids) == 5 and got["pads"] == got["placed"] == sum(
        int(t * h * w) // 4 for t, h, w in grids)  # merge 2 x 2
    assert "<image>" not in got["inputs"] and got["inputs"].count("What moves in the video?") == 5
    for i in (0, 1, 2, 10, 11):
        assert f"Square number {i} moves right." in got["targets"]
    assert "What moves" not in got["targets"]  # the question is a prompt
    assert validation_problem(cfg) is None
    val = _content(tok, _batches(validation_job_config(cfg), "val", 100, processing), "video")
    assert val["starts"] == 2 and "Square number 101 moves right." in val["targets"]


def test_llava_video_missing_clip_is_one_line(tmp_path):
    pytest.importorskip("av")
    root = tmp_path / "llava_video"
    rows = _llava_video_rows(root, 0, 2)
    rows[1]["video"] = "academic_source/activitynet/gone.mp4"
    (root / "train.json").write_text(json.dumps(rows))
    cfg = _config(root, tokenizer_dir(tmp_path), "video", "--data.no-shuffle")
    with pytest.raises(BadSampleError) as e:
        _batches(cfg, "train", 100, {"video": SMALL_PROCESSING["video"]})
    message = str(e.value)
    assert "\n" not in message and "missing_media" in message
    assert f"{root / 'train.json'} row 1" in message and "gone.mp4" in message


# ----------------------------------------------------------------------------- VoiceAssistant


def _audio_bytes(seconds: float, rate: int, freq: float, fmt: str) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.4 * np.sin(2 * np.pi * freq * t), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def _voice_shard(path, first: int, n: int, corrupt: int | None = None) -> None:
    """A VoiceAssistant-400K shard: the Hugging Face Audio feature in the schema metadata, the
    questions' audio embedded as WAV (even rows) or FLAC (odd rows)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = datasets.Features({
        "split_name": datasets.Value("string"), "index": datasets.Value("int64"),
        "round": datasets.Value("int64"), "question": datasets.Value("string"),
        "question_audio": datasets.Audio(), "answer": datasets.Value("string"),
        "answer_snac": datasets.Value("string"),
    })
    ids = range(first, first + n)
    audio = [{"bytes": _audio_bytes(0.5, 22050 if i % 2 == 0 else 16000, 300 + 40 * i,
                                    "WAV" if i % 2 == 0 else "FLAC"), "path": f"{i}.wav"}
             for i in ids]
    if corrupt is not None:
        audio[corrupt] = {"bytes": b"RIFF....WAVEnot really audio", "path": "broken.wav"}
    table = pa.table({
        "split_name": ["identity"] * n, "index": list(ids), "round": [0] * n,
        "question": [f"Spoken question number {i}?" for i in ids], "question_audio": audio,
        "answer": [f"Answer number {i}." for i in ids],
        "answer_snac": ["# 1234 5678 #" for _ in ids],
    }, schema=features.arrow_schema)
    pq.write_table(table, path)


def test_voice_assistant_parquet_with_embedded_audio(tmp_path):
    raw = tmp_path / "VoiceAssistant-400K" / "data"
    raw.mkdir(parents=True)
    for k in range(3):
        _voice_shard(raw / f"train-0000{k}-of-00003.parquet", 100 * k, 3)
    root = tmp_path / "voice"
    for split, shards in (("train", (0, 1)), ("val", (2,))):
        (root / split).mkdir(parents=True)
        for k in shards:
            name = f"train-0000{k}-of-00003.parquet"
            os.symlink(raw / name, root / split / name)
    cfg = _config(root, tokenizer_dir(tmp_path), "audio", "--training.dataset",
                  "voice_assistant")
    tok = build_omni_tokenizer(cfg)
    processing = {"audio": SMALL_PROCESSING["audio"]}
    got = _content(tok, _batches(cfg, "train", 100, processing), "audio")
    assert got["starts"] == 6 and got["start_targets"] == 0  # one 0.5 s chunk per question
    lengths = np.concatenate([m["lengths"].numpy() for m in got["media"] if m])
    assert len(lengths) == 6 and got["pads"] == got["placed"] > 0
    for i in (0, 1, 2, 100, 101, 102):
        assert f"Answer number {i}." in got["targets"]
    assert "Spoken question" not in got["inputs"]  # the transcript is not shown
    assert "1234" not in got["inputs"]  # nor the other columns
    assert validation_problem(cfg) is None
    val = _content(tok, _batches(validation_job_config(cfg), "val", 100, processing), "audio")
    assert val["starts"] == 3 and "Answer number 201." in val["targets"]


def test_voice_assistant_undecodable_audio_is_one_line(tmp_path):
    (tmp_path / "data").mkdir()
    shard = tmp_path / "data" / "train-00000-of-00001.parquet"
    _voice_shard(shard, 0, 3, corrupt=1)
    cfg = _config(tmp_path / "data", tokenizer_dir(tmp_path), "audio", "--data.no-shuffle")
    with pytest.raises(BadSampleError) as e:
        _batches(cfg, "train", 100, {"audio": SMALL_PROCESSING["audio"]})
    message = str(e.value)
    assert "\n" not in message and "corrupt_media" in message
    assert f"{shard} row 1" in message and "inline audio bytes of 'broken.wav'" in message


# ----------------------------------------------------------------------------- ImageNet

_CLASSES = {"n01440764": ("tench", (200, 40, 40)), "n01443537": ("goldfish", (40, 40, 200))}
_MAPPING = ("n01440764 tench, Tinca tinca\n"
            "n01443537 goldfish, Carassius auratus\n"
            "n02085620 Chihuahua\n")  # a class without images: fine


def _imagenet(root, per_class: dict[str, int]) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in per_class.items():
        for wnid, (_, color) in _CLASSES.items():
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for k in range(n):
                noise = rng.integers(-20, 20, (40, 48, 3))
                pixels = np.clip(np.array(color) + noise, 0, 255).astype(np.uint8)
                name = f"{wnid}_{k}.JPEG" if split == "train" else f"ILSVRC2012_val_{k:08d}.JPEG"
                Image.fromarray(pixels).save(folder / name)  # JPEG, by the extension
    (root / "LOC_synset_mapping.txt").write_text(_MAPPING)


def _check_generation(tok, batches, images: int) -> None:
    """Every generated image follows its class's caption and shows the class's color."""
    got = _content(tok, batches, "gen_image")
    assert got["starts"] == got["start_targets"] == images  # <gen_image_start> is a target
    assert got["inputs"].count("Draw a tench.") + got["inputs"].count("Draw a goldfish.") == images
    start = tok.special.media_ids("gen_image")[0]
    seen = 0
    for (batch, _), media in zip(batches, got["media"]):
        flat = batch[B.INPUT].flatten()
        for p, pixels in zip((flat == start).nonzero().flatten().tolist(),
                             media.get("pixels", [])):
            prompt = tok.decode(flat[max(0, p - 12):p].tolist())
            red, blue = float(pixels[0].mean()), float(pixels[2].mean())
            assert ("tench" in prompt) == (red > blue) and ("goldfish" in prompt) == (blue > red)
            seen += 1
    assert seen == images


def test_imagenet_class_folders_as_image_generation(tmp_path):
    root = tmp_path / "imagenet"
    _imagenet(root, {"train": 3, "val": 1})
    cfg = _config(root, tokenizer_dir(tmp_path), "gen_image", "--training.dataset", "imagenet")
    tok = build_omni_tokenizer(cfg)
    processing = {"gen_image": SMALL_PROCESSING["gen_image"]}
    _check_generation(tok, _batches(cfg, "train", 100, processing), 6)
    assert validation_problem(cfg) is None
    _check_generation(tok, _batches(validation_job_config(cfg), "val", 100, processing), 2)
    streaming = _config(root, cfg.model.hf_assets_path, "gen_image", "--data.streaming")
    _check_generation(tok, _batches(streaming, "train", 100, processing), 6)
    # the mapping as JSON {wnid: names}
    os.remove(root / "LOC_synset_mapping.txt")
    (root / "synset_mapping.json").write_text(json.dumps(
        {"n01440764": "tench, Tinca tinca", "n01443537": ["goldfish", "Carassius auratus"]}))
    _check_generation(tok, _batches(cfg, "val", 100, processing), 2)


def test_imagenet_split_is_one_task_of_generation_rows(tmp_path):
    # eval_metrics reads the held-out split with read_split: the class folders of "val" are one
    # task (not a task per class), and every row is an image-generation row
    from torchtitan_omni.eval.tasks import kind_of, read_split

    root = tmp_path / "imagenet"
    _imagenet(root, {"val": 2})
    items = read_split(str(root), "val")
    assert len(items) == 2 * len(_CLASSES)
    assert {item.task for item in items} == {"val"}
    assert {kind_of(item.sample) for item in items} == {"generation"}
    assert sorted(item.sample.turns[0].text for item in items) == sorted(
        ["Draw a goldfish."] * 2 + ["Draw a tench."] * 2)


def test_imagenet_class_folder_missing_from_the_mapping_is_one_line(tmp_path):
    root = tmp_path / "imagenet"
    _imagenet(root, {"train": 1})
    (root / "train" / "n09999999").mkdir()
    cfg = _config(root, tokenizer_dir(tmp_path), "gen_image")
    with pytest.raises(DataFileError) as e:
        build_omni_dataloader(1, 0, None, cfg, processing={})
    message = str(e.value)
    assert "\n" not in message and str(root / "train" / "n09999999") in message
    assert str(root / "LOC_synset_mapping.txt") in message
    # a mapping line without a name, and a flat val folder (Kaggle's), are named too
    (root / "LOC_synset_mapping.txt").write_text(_MAPPING + "n09999999\n")
    with pytest.raises(DataFileError, match=r"LOC_synset_mapping.txt line 4: expected"):
        build_omni_dataloader(1, 0, None, cfg, processing={})
    (root / "LOC_synset_mapping.txt").write_text(_MAPPING)
    (root / "val").mkdir()
    (root / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(b"")
    with pytest.raises(DataFileError, match=r"val holds files beside its class folders"):
        build_omni_dataloader(1, 0, None, cfg, split="val", processing={})


# ----------------------------------------------------------------------------- row shapes


def test_row_shapes_of_the_new_layouts():
    from torchtitan_omni.data.bad_samples import BadSample, Source
    from torchtitan_omni.data.sample import parse_row

    src = Source("rows.json", 4)

    def chat(question, **media):
        return {"conversations": [{"from": "human", "value": question},
                                  {"from": "gpt", "value": "An answer."}], **media}

    # LLaVA-Video: <image> for each video, in every turn; other placeholders stay
    got = parse_row(chat("<image>\nWhat happens?", video="a.mp4"), src)
    assert got.turns[0].text == "<video>\nWhat happens?" and got.media == {"video": ["a.mp4"]}
    got = parse_row({"text": "<image> then <image> <audio>", "videos": ["a.mp4", "b.mp4"],
                     "audio": "x.wav"}, src)
    assert got.text == "<video> then <video> <audio>"
    got = parse_row(chat("<image> beside <video>", image="i.png", video="a.mp4"), src)
    assert got.turns[0].text == "<image> beside <video>"  # images present: read as written
    with pytest.raises(BadSample, match=r"rows.json row 4: placeholder_mismatch: 2 <image>"):
        parse_row(chat("<image><image>", video="a.mp4"), src)
    # VoiceAssistant-400K: the audio is the question, the transcript is not shown
    got = parse_row({"question": "Hi?", "question_audio": {"bytes": b"x", "path": "q.wav"},
                     "answer": "Hello.", "index": 3}, src)
    assert [(t.role, t.text) for t in got.turns] == [("user", "<audio>"),
                                                     ("assistant", "Hello.")]
    assert got.media == {"audio": [{"bytes": b"x", "path": "q.wav"}]}
    with pytest.raises(BadSample, match=r"row 4: malformed_row: 'question_audio' with an "
                                        r"'answer' of type NoneType"):
        parse_row({"question_audio": b"x", "answer": None}, src)
    with pytest.raises(BadSample, match=r"both 'question_audio' and an audio list"):
        parse_row({"question_audio": b"x", "audio": "y.wav", "answer": "a"}, src)
