"""Row-level problems of JSON-lines files: a line that is not JSON, a row that is not an
object, empty text, an empty conversation, a conversation with nothing to train on, and rows
of one file with different shapes. Under ``skip`` each bad row is skipped, logged once with its
file and line, and counted while the good rows train; under ``error`` the first one stops the
loader with one line naming the file, the line and the problem."""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
import re

import pytest
import torch

from tests.data.helpers import SMALL_PROCESSING, job_config, tokenizer_dir, write_png
from torchtitan_omni.data.bad_samples import REASONS, BadSampleError
from torchtitan_omni.data.jsonl import JsonlFile, UnreadableLine, parse_line
from torchtitan_omni.data.loader import build_omni_dataloader
from torchtitan_omni.data.tokenizer import OmniTokenizer
from torchtitan_omni.errors import DataFileError
from torchtitan_omni.protocols import batch as B


def _chat(user, answer, **media):
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": answer}], **media}


# (line text, reason or None for a good row, what the message must say)
LINES = [
    (json.dumps({"text": "good alpha words"}), None, None),
    ('{"text": "broken" "row"}', "invalid_json", "Expecting ','"),
    (json.dumps(_chat("<image> what?", "good beta answer", images=["img.png"])), None, None),
    ("", None, None),  # a blank line is no row
    ('[1, 2, 3]', "malformed_row", "JSON list, not an object"),
    (json.dumps({"text": ""}), "empty_text", "'text' is an empty string"),
    # images as one string, not a list: a second schema in the same file
    (json.dumps(_chat("<image> and?", "good gamma answer", images="img.png")), None, None),
    (json.dumps({"messages": []}), "empty_conversation", "'messages' is an empty list"),
    (json.dumps({"conversations": [{"from": "human", "value": " "},
                                   {"from": "gpt", "value": ""}]}),
     "empty_conversation", "have empty content"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
     "no_targets", "no assistant turn has content"),
    ('{"text": "cut off', "invalid_json", "Unterminated string"),
    (json.dumps({"text": "good delta words", "meta": {"id": 7}}), None, None),
]
GOOD = ["good alpha words", "good beta answer", "good gamma answer", "good delta words"]


def _expected_counts() -> dict[str, int]:
    counts = dict.fromkeys(REASONS, 0)
    for _, reason, _ in LINES:
        if reason:
            counts[reason] += 1
    return counts


def _bad_lines() -> list[tuple[int, str, str]]:
    """(1-based line number, reason, message text) of every bad line."""
    return [(i + 1, reason, says) for i, (_, reason, says) in enumerate(LINES) if reason]


def _write(root, name, lines, gz=False) -> str:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, name)
    data = "".join(line + "\n" for line in lines).encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    words = " ".join(GOOD) + " what and only a question broken row cut off " * 10
    return OmniTokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok"), texts=[words * 5]))


def _loader(root, tok, *args, infinite=False):
    cfg = job_config("--training.dataset", "custom", "--training.dataset_path", root,
                     "--training.seq_len", "64", "--training.local_batch_size", "1",
                     "--data.buffer_docs", "1", *args)
    processing = {"image": SMALL_PROCESSING["image"]}
    return build_omni_dataloader(1, 0, tok, cfg, processing=processing, infinite=infinite)


def _texts(tok, batches) -> str:
    return " ".join(tok.decode(b[B.INPUT].flatten().tolist()) for b, _ in batches)


@pytest.mark.parametrize("streaming,gz", [(False, False), (True, False), (False, True)])
def test_bad_rows_are_skipped_logged_and_counted(tok, tmp_path, caplog, streaming, gz):
    root = str(tmp_path / "ds")
    name = "train.jsonl.gz" if gz else "train.jsonl"
    path = _write(root, name, [line for line, _, _ in LINES], gz=gz)
    write_png(os.path.join(root, "img.png"), 8, 8)
    args = ["--data.streaming"] if streaming else []
    loader = _loader(root, tok, *args)
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
    assert loader.stats() == _expected_counts()
    texts = _texts(tok, batches)
    assert all(good in texts for good in GOOD), texts  # every good row trained, any schema
    logged = [r.getMessage() for r in caplog.records if "skipping sample" in r.getMessage()]
    assert len(logged) == len(_bad_lines())
    for line, reason, says in _bad_lines():
        hits = [m for m in logged if f"{path} line {line}: {reason}: " in m]
        assert len(hits) == 1 and says in hits[0], (line, logged)


def test_the_run_goes_on_past_bad_rows_and_resumes(tok, tmp_path):
    """An infinite loader cycles epochs over the good rows, counting the bad ones each epoch,
    and a loader restored from its state yields the same next batches."""
    root = str(tmp_path / "ds")
    _write(root, "train.jsonl", [line for line, _, _ in LINES])
    write_png(os.path.join(root, "img.png"), 8, 8)
    first = _loader(root, tok, infinite=True)
    it = iter(first)
    while first.stats()["invalid_json"] < 4:  # two epochs
        next(it)
    state = first.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = _loader(root, tok, infinite=True)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for batch, labels in expected:
        got, got_labels = next(again)
        assert got.keys() == batch.keys()
        assert all(torch.equal(got[k], batch[k]) for k in batch)
        assert torch.equal(got_labels, labels)
    assert resumed.stats()["invalid_json"] >= 4  # counters are part of the state


def test_a_shard_without_usable_rows_stops_with_one_line(tok, tmp_path):
    """Skipping could go on for ever: an epoch of bad rows only is an input error (one line)."""
    root = str(tmp_path / "ds")
    path = _write(root, "train.jsonl", [line for line, reason, _ in LINES if reason])
    with pytest.raises(DataFileError, match="no usable sample in a whole epoch") as err:
        next(iter(_loader(root, tok, infinite=True)))
    assert path in str(err.value) and "\n" not in str(err.value)


def test_error_policy_in_a_loader_worker_is_one_line(tok, tmp_path):
    """torch re-raises a worker's exception with the worker's traceback as its message; the
    loader gives back the one-line message."""
    root = str(tmp_path / "ds")
    path = _write(root, "train.jsonl", [LINES[0][0], LINES[1][0]])
    loader = _loader(root, tok, "--data.bad_sample_policy", "error", "--data.no-shuffle",
                     "--training.dataloader.num_workers", "1")
    with pytest.raises(BadSampleError) as err:
        list(loader)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"bad sample ({path} line 2: invalid_json: "), msg


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("index", [i for i, (_, reason, _) in enumerate(LINES) if reason])
def test_error_policy_names_file_line_and_problem(tok, tmp_path, index, streaming):
    line, reason, says = LINES[index]
    root = str(tmp_path / "ds")
    # a good row, a blank line, then the bad one: line 3 is the file's second row
    path = _write(root, "train.jsonl", [LINES[0][0], "", line])
    args = ["--data.bad_sample_policy", "error", "--data.no-shuffle"]
    loader = _loader(root, tok, *args, *(["--data.streaming"] if streaming else []))
    with pytest.raises(BadSampleError) as err:
        list(loader)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{path} line 3: {reason}: " in msg and says in msg, msg


def test_rows_of_one_file_may_differ_in_shape(tok, tmp_path):
    """Rows are parsed one by one, with no file schema: media as a string and as a list,
    content as a string and as parts, keys present in some rows only, a key's type varying."""
    root = str(tmp_path / "ds")
    os.makedirs(root)
    write_png(os.path.join(root, "img.png"), 8, 8)
    rows = [
        _chat("<image> one?", "shape one", images="img.png"),
        _chat("<image> two?", "shape two", images=["img.png"]),
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "img.png"},
                                                   {"type": "text", "text": "three?"}]},
                      {"role": "assistant", "content": "shape three"}]},
        {"text": "shape four", "id": 4},
        {"text": "shape five", "id": "five", "extra": [1, {"x": None}]},
    ]
    _write(root, "train.jsonl", [json.dumps(r) for r in rows])
    loader = _loader(root, tok, "--data.bad_sample_policy", "error")
    texts = _texts(tok, list(loader))
    assert all(f"shape {n}" in texts for n in ("one", "two", "three", "four", "five")), texts


def test_json_array_file_and_line_numbers(tmp_path):
    """A ``.json`` file holding one array is read as rows; JSON lines keep line numbers."""
    rows = [{"text": "a"}, {"text": "b"}]
    array = tmp_path / "train.json"
    array.write_text(json.dumps(rows, indent=2))
    assert [JsonlFile(str(array)).row(i) for i in range(2)] == [(r, None) for r in rows]
    lines = _write(str(tmp_path), "x.jsonl", ["", json.dumps(rows[0]), "  ", json.dumps(rows[1])])
    f = JsonlFile(lines)
    assert len(f) == 2 and f.row(1) == (rows[1], 4)
    assert list(f.stream()) == [(rows[0], 2), (rows[1], 4)]
    assert pickle.loads(pickle.dumps(f)).row(0) == (rows[0], 2)  # spawned loader workers


def test_undecodable_line_and_unreadable_file(tmp_path):
    bad = parse_line(b'{"text": "caf\xe9"}')
    assert isinstance(bad, UnreadableLine) and "not UTF-8" in bad.describe()
    broken = tmp_path / "train.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40])
    with pytest.raises(DataFileError, match=re.escape(str(broken))):
        len(JsonlFile(str(broken)))
