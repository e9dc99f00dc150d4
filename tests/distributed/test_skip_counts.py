"""A log line's skipped-sample counts (``data/skipped_<reason>``) are summed over the data
ranks, and counted once per sequence-parallel group (its ranks read the same rows), within
the step-start agreement that every rank joins anyway."""

from __future__ import annotations

import json

import pytest

from tests.harness import REPO, run_train


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "sp2"])
def test_skipped_counts_are_summed_over_data_ranks_once(tmp_path, layout):
    steps = tmp_path / "steps.jsonl"
    extra = ["--parallelism.ulysses_degree", "2"] if layout == "sp2" else []
    run = run_train(REPO / "train_configs" / "llama_omni_debug.toml", 2,
                    "--training.steps", "4", "--lr_scheduler.warmup_steps", "1",
                    "--metrics.log_freq", "2", *extra,
                    "--job.dump_folder", f"outputs/test_skip_counts_{layout}",
                    env={"TRAIN_FILE": "tests.distributed.skip_count_entry",
                         "OMNI_STEP_FILE": str(steps)})
    assert run.returncode == 0, run.output[-4000:]
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    # log_freq 2: steps 1, 2 and 4 log (3 does not: the counts travel on log steps only)
    assert sorted((line["step"], line["rank"]) for line in lines) == [
        (1, 0), (1, 1), (2, 0), (2, 1), (4, 0), (4, 1)]
    for step in (1, 2, 4):
        own = {line["rank"]: line["own"] for line in lines if line["step"] == step}
        counted = [0, 1] if layout == "dp2" else [0]  # SP: one count per group of ranks
        want = {f"data/skipped_{reason}": sum(own[r][reason] for r in counted)
                for reason in own[0]}
        for line in lines:
            if line["step"] == step:
                assert line["line"] == want, (layout, step, line, own)
    assert want["data/skipped_too_long"] >= (7 if layout == "dp2" else 3)
