"""The trainer end to end on synthetic documents: losses go down, determinism, and the
one-line config errors."""

import subprocess

import pytest

from tests.harness import REPO, run_train

CONFIG = "tests/configs/synthetic.toml"


@pytest.mark.slow
def test_loss_decreases_on_two_ranks():
    run = run_train(CONFIG, 2, "--training.steps", "12", "--job.dump_folder", "outputs/test_trainer_a")
    assert run.returncode == 0, run.output[-3000:]
    losses = run.loss_list()
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


@pytest.mark.slow
def test_deterministic_runs_are_identical():
    args = ("--training.steps", "4", "--debug.deterministic", "--debug.seed", "42")
    a = run_train(CONFIG, 2, *args, "--job.dump_folder", "outputs/test_trainer_b")
    b = run_train(CONFIG, 2, *args, "--job.dump_folder", "outputs/test_trainer_c")
    assert a.returncode == 0 and b.returncode == 0, a.output[-2000:] + b.output[-2000:]
    assert a.loss_list() == b.loss_list() and len(a.loss_list()) == 4


def _check(args, ngpu=1):
    return subprocess.run(
        ["bash", "run_train.sh", *args], cwd=REPO, capture_output=True, text=True,
        env={**__import__("os").environ, "NGPU": str(ngpu), "CONFIG_FILE": CONFIG},
    )


def _one_error_line(proc):
    lines = [l for l in proc.stderr.splitlines() if "config error" in l]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_misspelled_cli_key(tmp_path):
    line = _one_error_line(_check(["--training.stpes", "3"]))
    assert "stpes" in line and "steps" in line


def test_misspelled_toml_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / CONFIG).read_text().replace("seq_len = 32", "seq_lenn = 32"))
    line = _one_error_line(_check(["--job.config_file", str(bad)]))
    assert "seq_lenn" in line and "[training]" in line and "seq_len" in line


def test_wrong_type(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / CONFIG).read_text().replace("steps = 10", 'steps = "ten"'))
    line = _one_error_line(_check(["--job.config_file", str(bad)]))
    assert "training.steps" in line and "int" in line


def test_missing_config_file():
    line = _one_error_line(_check(["--job.config_file", "no/such/file.toml"]))
    assert "not found" in line and "no/such/file.toml" in line


def test_impossible_layout():
    line = _one_error_line(_check(["--parallelism.data_parallel_shard_degree", "2"], ngpu=3))
    assert "world size 3" in line
    line = _one_error_line(_check(["--parallelism.ulysses_degree", "3"], ngpu=3))
    assert "ulysses" in line


def test_negative_expert_capacity_factor():
    line = _one_error_line(_check(["--parallelism.expert_capacity_factor", "-0.5"]))
    assert "parallelism.expert_capacity_factor must be >= 0" in line and "-0.5" in line


def test_llm_layers_out_of_range():
    line = _one_error_line(_check(["--omni.llm_layers", "99"]))
    assert "omni.llm_layers (99)" in line


def test_missing_weights_source_and_bad_data_value():
    line = _one_error_line(_check(["--weights.sources", "llm=/no/such/ckpt"]))
    assert "weights.sources" in line and "/no/such/ckpt" in line


def test_runtime_input_error_is_one_line(tmp_path):
    # A weights folder that exists but holds no checkpoint passes the start-up check and
    # fails while loading: the rank reports one line, no Python traceback of ours.
    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    proc = _check(["--weights.sources", f"llm={empty}", "--training.steps", "1",
                   "--job.dump_folder", str(tmp_path / "out")])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    errors = [l for l in out.splitlines() if "torchtitan-omni: error:" in l]
    assert errors and str(empty) in errors[0], out[-3000:]
    assert "torchtitan_omni/" not in out.split("torchtitan-omni: error:")[-1], out[-3000:]
