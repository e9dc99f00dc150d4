"""Loss curves from TensorBoard logs: reading (resumed launches too), smoothing, the plots and
summary of ``scripts/reproduce_convergence.py --plot``, and ``--compare`` on runs whose
differences are known. The logs are written here with ``SummaryWriter``."""

from __future__ import annotations

import os

import pytest

from tests.harness import load_script
from torchtitan_omni.eval import curves as C

TRAIN = {"loss_metrics/global_avg_loss": 10.0, "loss_metrics/text": 6.0,
         "loss_metrics/gen_image": 4.0, "loss_metrics/global_max_loss": 11.0}
VAL = {"validation/loss": 9.0, "validation/loss/text": 5.0, "validation/loss/gen_image": 4.0,
       "validation/mix/image": 4.5, "validation/mix/text_only": 5.5}


def _write(folder, steps, scale=lambda tag, step: 1.0):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step in steps:
        for tag, start in TRAIN.items():
            writer.add_scalar(tag, start / step * scale(tag, step), step)
        if step % 5 == 0:
            for tag, start in VAL.items():
                writer.add_scalar(tag, start / step * scale(tag, step), step)
    writer.close()


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "run_a"
    # two launches, as a resumed run writes them: the second's steps 5-6 replace the first's
    _write(folder / "tb" / "20250101-0000", range(1, 7), lambda tag, step: 2.0)
    _write(folder / "tb" / "20250101-0100", range(5, 11))
    return folder


def test_read_scalars_merges_launches(run):
    scalars = C.read_scalars(str(run))
    assert sorted(scalars["loss_metrics/text"]) == list(range(1, 11))
    assert scalars["loss_metrics/text"][4] == pytest.approx(2 * 6.0 / 4)  # first launch only
    assert scalars["loss_metrics/text"][6] == pytest.approx(6.0 / 6)  # replaced by the resume
    assert sorted(scalars["validation/mix/image"]) == [5, 10]
    with pytest.raises(FileNotFoundError, match="enable_tensorboard"):
        C.read_scalars(str(run / "nothing"))


def test_smoothing_is_debiased_ema():
    assert C.smooth([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]
    assert C.smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert C.smooth([0.0, 2.0], 0.5) == pytest.approx([0.0, 0.5 * 2.0 / 0.75])
    with pytest.raises(ValueError):
        C.smooth([1.0], 1.0)


def test_plot_writes_a_figure_per_loss_and_mix_and_a_summary(run):
    pytest.importorskip("matplotlib")
    script = load_script("reproduce_convergence")
    assert script.main(["--plot", str(run)]) == 0
    pngs = sorted(os.listdir(run / "curves"))
    assert pngs == ["loss_gen_image.png", "loss_text.png", "loss_total.png",
                    "val_mix_image.png", "val_mix_text_only.png"]
    assert all((run / "curves" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    summary = (run / "summary.md").read_text()
    assert "| `validation/mix/image` | 5-10 (2) | 0.9000 | 0.4500 | 0.4500 (10) |" in summary
    assert "Validation loss fell: 1.8000 -> 0.9000." in summary
    assert "global_max_loss" not in summary
    assert "![loss_text.png](curves/loss_text.png)" in summary


def _run_b_scale(tag, step):
    """run_a's final values, except the text loss 10% higher at step 10."""
    if step < 5:
        return 2.0
    return 1.1 if tag == "loss_metrics/text" and step == 10 else 1.0


def test_compare_reports_the_known_differences(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    other = tmp_path / "run_b"
    _write(other / "tb" / "x", range(1, 11), _run_b_scale)
    result = C.compare_runs([C.read_scalars(str(run)), C.read_scalars(str(other))])
    (mx, mean, n), = result["loss_metrics/text"]
    assert (mx, mean, n) == (pytest.approx(0.1), pytest.approx(0.01), 10)
    assert result["validation/mix/image"] == [(0.0, 0.0, 2)]
    script = load_script("reproduce_convergence")
    out = tmp_path / "cmp"
    assert script.main(["--compare", str(run), str(other), "--out", str(out),
                        "--labels", "sp1", "sp2"]) == 0
    printed = capsys.readouterr().out
    line = next(l for l in printed.splitlines() if l.strip().startswith("loss_metrics/text "))
    assert "sp2" in line and "max 1.000e-01" in line and "mean 1.000e-02" in line
    assert "(10 steps)" in line
    assert "compare_validation_mix_image.png" in os.listdir(out)
    assert len([f for f in os.listdir(out) if f.endswith(".png")]) == len(result)
