"""The VQ recipe end to end on a tiny image folder: it trains, holds out the test split, writes
weights the decoder loads, and its report matches a re-evaluation of those weights."""

import importlib.util
import json

import numpy as np
import pytest
from PIL import Image

from tests.harness import REPO
from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.decoders.vq import load_vq, read_vq_args


def _script():
    spec = importlib.util.spec_from_file_location("train_vq", REPO / "scripts" / "train_vq.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _image_folder(root, n_train=12, n_test=4):
    from sklearn.datasets import load_digits

    digits = load_digits().images
    for split, count, offset in (("train", n_train, 0), ("test", n_test, 100)):
        folder = root / "media" / "digits" / split
        folder.mkdir(parents=True)
        for i in range(count):
            arr = (digits[offset + i] * 16).clip(0, 255).astype(np.uint8)
            Image.fromarray(np.stack([arr] * 3, -1)).save(folder / f"{i:03d}.png")
    (root / "media" / "digits" / "val").mkdir()  # a split the recipe leaves alone


def test_recipe_trains_saves_and_reports(tmp_path):
    train_vq = _script()
    _image_folder(tmp_path / "data")
    out = tmp_path / "vq"
    report = train_vq.main(["--data", str(tmp_path / "data"), "--steps", "6", "--batch-size", "4",
                            "--eval-every", "3", "--restart-every", "3", "--warmup", "2",
                            "--out", str(out), "--device", "cpu"])
    assert report["train_images"] == 12 and report["held_out"]["digits"]["images"] == 4
    assert [h["step"] for h in report["history"]] == [0, 3, 6]
    assert json.loads((out / "report.json").read_text())["held_out"] == report["held_out"]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    dec = GenImageDecoder(GenImageArgs(vq=read_vq_args(str(out))), 16)
    load_vq(dec.vq, str(out))
    again = train_vq.main(["--data", str(tmp_path / "data"), "--eval", str(out), "--device", "cpu"])
    assert again["held_out"]["all"]["mse"] == pytest.approx(
        report["held_out"]["all"]["mse"], rel=1e-4
    )


def test_bad_data_is_a_clear_error(tmp_path):
    train_vq = _script()
    with pytest.raises(SystemExit, match="holds 0 image files"):
        train_vq.main(["--data", str(tmp_path), "--steps", "1"])
    with pytest.raises(SystemExit, match="neither 'auto', 'builtin' nor a directory"):
        train_vq.main(["--data", str(tmp_path / "missing"), "--steps", "1"])
