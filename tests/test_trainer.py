"""The trainer end to end on synthetic documents: losses go down, determinism, and the
one-line config errors (through ``run_train.sh`` and the trainer's entry point; the
messages of the other bad values through the same start-up check, in this process)."""

import logging
import os
import subprocess
import sys

import pytest

from tests.harness import REPO, run_train

CONFIG = "tests/configs/synthetic.toml"


@pytest.mark.slow
def test_loss_decreases_on_two_ranks():
    run = run_train(
        CONFIG, 2, "--training.steps", "12", "--job.dump_folder", "outputs/test_trainer_a"
    )
    assert run.returncode == 0, run.output[-3000:]
    losses = run.loss_list()
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


#: the deferred-line runs' settings (a linear decay: steps 3 and 4 log different values)
DEFERRED = ("--debug.deterministic", "--debug.seed", "42", "--lr_scheduler.decay_type", "linear")


@pytest.fixture(scope="module")
def four_steps():
    """A deterministic 4-step run logging every step: shared by the determinism and the
    deferred-line tests (one 2-rank run less)."""
    run = run_train(CONFIG, 2, *DEFERRED, "--training.steps", "4", "--metrics.log_freq", "1",
                    "--job.dump_folder", "outputs/test_trainer_deferred_c")
    assert run.returncode == 0, run.output[-2000:]
    return run


@pytest.mark.slow
def test_deterministic_runs_are_identical(four_steps):
    again = run_train(CONFIG, 2, *DEFERRED, "--training.steps", "4", "--metrics.log_freq", "1",
                      "--job.dump_folder", "outputs/test_trainer_b")
    assert again.returncode == 0, again.output[-2000:]
    assert again.loss_list() == four_steps.loss_list() and len(again.loss_list()) == 4


@pytest.mark.slow
def test_deferred_log_lines_carry_their_own_steps_values(four_steps):
    """A log step's line comes at the end of the next step (its values copied behind its
    kernels), the last step's at once. Step 3's line, deferred in a 4-step run, equals step 3
    logged at once as the last of a 3-step run; a 4-step run that logs every other step logs
    steps 1, 2 and 4 (its last) and nothing else."""
    every_other = run_train(CONFIG, 2, *DEFERRED, "--training.steps", "4",
                            "--metrics.log_freq", "2",
                            "--job.dump_folder", "outputs/test_trainer_deferred_a")
    three = run_train(CONFIG, 2, *DEFERRED, "--training.steps", "3", "--metrics.log_freq", "1",
                      "--job.dump_folder", "outputs/test_trainer_deferred_b")
    assert every_other.returncode == 0 and three.returncode == 0, (
        every_other.output[-2000:] + three.output[-2000:])
    assert sorted(every_other.losses) == [1, 2, 4], every_other.losses
    four = four_steps
    assert four.losses[3] == three.losses[3], (four.losses, three.losses)
    assert four.losses[4] == every_other.losses[4], (four.losses, every_other.losses)
    assert four.losses[3] != four.losses[4]


def _check(args, ngpu=1):
    return subprocess.run(
        ["bash", "run_train.sh", *args], cwd=REPO, capture_output=True, text=True,
        env={**__import__("os").environ, "NGPU": str(ngpu), "CONFIG_FILE": CONFIG},
    )


@pytest.fixture
def check_here(monkeypatch, capsys):
    """``run_train.sh``'s start-up check (``torchtitan_omni.config.check``) run in this
    process, for ``ngpu`` processes: the same code as :func:`_check` without a Python start-up
    per case. Returns what :func:`_check` returns."""
    from torchtitan_omni.config import check

    def run(args, ngpu=1):
        monkeypatch.setenv("WORLD_SIZE", str(ngpu))
        # as in a fresh process: no handler an earlier test's init_logger() bound to a
        # captured stream that is closed by now
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        capsys.readouterr()
        try:
            code = check.main(["--job.config_file", CONFIG, *args])
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def _one_error_line(proc):
    lines = [l for l in proc.stderr.splitlines() if "config error" in l]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def _train_entry(args):
    """``python3 -m torchtitan_omni.train`` itself (no launcher, no pre-check), one process."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "NGPU")}
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_omni.train", "--job.config_file",
         "train_configs/llama_omni_debug.toml", *args],
        cwd=REPO, capture_output=True, text=True, env=env,
    )


@pytest.mark.parametrize("args, reason", [
    (["--validation.enable", "--validation.freq", "0"], "validation.freq must be >= 1, got 0"),
    (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     'parallelism.pipeline_parallel_schedule = "Interleaved1F1B" is not supported'),
])
def test_refused_key_through_the_trainer_entry(args, reason):
    # Keys the omni trainer does not honour (torchtitan_omni/config/unsupported.py) stop it
    # before anything starts, with one line.
    line = _one_error_line(_train_entry(args))
    assert line.startswith("torchtitan-omni: config error: ") and reason in line


def test_misspelled_cli_key(tmp_path):
    line = _one_error_line(_check(["--training.stpes", "3"]))
    assert "stpes" in line and "steps" in line


def test_without_the_pre_check_the_ranks_refuse_and_name_the_key():
    """``TORCHTITAN_OMNI_PRECHECK=0``: no check before torchrun, so every rank refuses the key
    itself; the job still fails and torchrun's failure summary carries the one line (the
    rank whose output is shown may be killed before it prints)."""
    run = run_train(CONFIG, 2, "--training.stpes", "3")
    assert run.returncode != 0
    # torchrun's summary alone (run_train appends the other ranks' output after it)
    start = run.output.index("Root Cause")
    summary = run.output[start:run.output.index("=" * 20, start)]
    assert ("torchtitan-omni: config error: unknown option --training.stpes: training has no "
            "key 'stpes' (did you mean 'steps'?)") in summary, run.output[-3000:]
    assert "Traceback" not in summary


def test_pre_check_switch_other_than_0_or_1_is_refused():
    proc = subprocess.run(["bash", "run_train.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "CONFIG_FILE": CONFIG,
                               "TORCHTITAN_OMNI_PRECHECK": "false"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "run_train.sh: TORCHTITAN_OMNI_PRECHECK=false is not 0 or 1"


def test_misspelled_toml_key(tmp_path, check_here):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / CONFIG).read_text().replace("seq_len = 32", "seq_lenn = 32"))
    line = _one_error_line(check_here(["--job.config_file", str(bad)]))
    assert "seq_lenn" in line and "[training]" in line and "seq_len" in line


def test_wrong_type(tmp_path, check_here):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / CONFIG).read_text().replace("steps = 10", 'steps = "ten"'))
    line = _one_error_line(check_here(["--job.config_file", str(bad)]))
    assert "training.steps" in line and "int" in line


@pytest.mark.parametrize("args, words", [
    (["--training.steps", "abc"], ["--training.steps", "'abc'"]),
    (["--data.bad_sample_policy", "sometimes"], ["sometimes", "skip", "error"]),
])
def test_bad_cli_value_is_one_line(args, words, check_here):
    line = _one_error_line(check_here(args))
    assert all(w in line for w in words), line


def test_help_lists_launcher_variables_and_keys_without_torchrun():
    proc = _check(["--help"])
    assert proc.returncode == 0, proc.stderr
    for name in ("NGPU", "CONFIG_FILE", "LOG_RANK", "TORCHTITAN_OMNI_DEVICE", "--training.steps",
                 "--parallelism.ulysses-degree"):
        assert name in proc.stdout, name
    assert "[rank0]" not in proc.stdout + proc.stderr  # no torchrun ranks were started


def test_output_locations_line():
    from torchtitan_omni.config.manager import parse_job_config
    from torchtitan_omni.train import output_locations

    cfg = parse_job_config(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", "o",
                            "--metrics.enable_tensorboard", "--checkpoint.no-enable"])
    line = output_locations(cfg)
    assert f"TensorBoard {os.path.join('o', cfg.metrics.save_tb_folder)}" in line
    assert "checkpoints off (--checkpoint.enable)" in line


def test_input_error_line_reaches_the_launcher_summary(tmp_path, monkeypatch):
    # torchrun's failure summary reads the rank's error file: it must show our one line
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchtitan_omni.train import _record_for_launcher

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    line = "torchtitan-omni: error: shard 1 of 2 of train.jsonl is empty"
    _record_for_launcher(line)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    summary = ChildFailedError("torchtitan_omni.train", {0: failure}).format_msg()
    assert f"traceback : {line}" in summary, summary


def test_missing_config_file(check_here):
    line = _one_error_line(check_here(["--job.config_file", "no/such/file.toml"]))
    assert "not found" in line and "no/such/file.toml" in line


def test_impossible_layout(check_here):
    line = _one_error_line(check_here(["--parallelism.data_parallel_shard_degree", "2"], ngpu=3))
    assert "world size 3" in line
    line = _one_error_line(check_here(["--parallelism.ulysses_degree", "3"], ngpu=3))
    assert "ulysses" in line


def test_negative_expert_capacity_factor(check_here):
    line = _one_error_line(check_here(["--parallelism.expert_capacity_factor", "-0.5"]))
    assert "parallelism.expert_capacity_factor must be >= 0" in line and "-0.5" in line


def test_expert_dispatch_chunks_need_capacity(check_here):
    line = _one_error_line(check_here(["--parallelism.expert_dispatch_chunks", "2"]))
    assert "expert_dispatch_chunks is 2 but expert_capacity_factor is 0" in line
    line = _one_error_line(check_here(["--parallelism.expert_dispatch_chunks", "0"]))
    assert "parallelism.expert_dispatch_chunks must be >= 1" in line


def test_llm_blocks_per_fsdp_unit_checked(check_here):
    line = _one_error_line(check_here(["--parallelism.llm_blocks_per_fsdp_unit", "0"], ngpu=2))
    assert "parallelism.llm_blocks_per_fsdp_unit must be >= 1, got 0" in line
    # one rank: no FSDP units to group, refused rather than ignored
    line = _one_error_line(check_here(["--parallelism.llm_blocks_per_fsdp_unit", "2"]))
    assert "llm_blocks_per_fsdp_unit is 2 but the LLM is not FSDP-sharded" in line


def test_ulysses_async_head_chunks_checked(check_here):
    line = _one_error_line(check_here(["--parallelism.ulysses_async_head_chunks", "2"]))
    assert "ulysses_async_head_chunks is 2 but ulysses_async is off" in line
    line = _one_error_line(check_here(["--parallelism.ulysses_async",
                                       "--parallelism.ulysses_async_head_chunks", "-1"]))
    assert "parallelism.ulysses_async_head_chunks must be >= 0" in line
    # without Ulysses both keys would do nothing: refused, not ignored
    line = _one_error_line(check_here(["--parallelism.ulysses_async",
                                       "--parallelism.ulysses_async_head_chunks", "2"]))
    assert "ulysses_async is set but ulysses_degree is 1" in line
    line = _one_error_line(check_here(["--parallelism.ulysses_async"]))
    assert "ulysses_async is set but ulysses_degree is 1" in line
    # a count whose groups would split heads between ranks: named with the attention module
    line = _one_error_line(check_here(["--parallelism.ulysses_degree", "2",
                                       "--parallelism.ulysses_async",
                                       "--parallelism.ulysses_async_head_chunks", "64"], ngpu=2))
    assert "ulysses_async_head_chunks (64) x ulysses_degree (2) must divide" in line
    assert "attention" in line


def test_llm_layers_out_of_range(check_here):
    line = _one_error_line(check_here(["--omni.llm_layers", "99"]))
    assert "omni.llm_layers (99)" in line


def test_missing_weights_source_and_bad_data_value(check_here):
    line = _one_error_line(check_here(["--weights.sources", "llm=/no/such/ckpt"]))
    assert "weights.sources" in line and "/no/such/ckpt" in line


@pytest.mark.slow
def test_runtime_input_error_is_one_line(tmp_path):
    # A weights folder that exists but holds no checkpoint passes the start-up check and
    # fails while loading: the rank reports one line, no Python traceback of ours.
    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    proc = _check(["--weights.sources", f"llm={empty}", "--training.steps", "1",
                   "--lr_scheduler.warmup_steps", "1",
                   "--job.dump_folder", str(tmp_path / "out")])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    errors = [l for l in out.splitlines() if "torchtitan-omni: error:" in l]
    assert errors and str(empty) in errors[0], out[-3000:]
    assert "torchtitan_omni/" not in out.split("torchtitan-omni: error:")[-1], out[-3000:]
