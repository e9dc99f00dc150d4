"""Parts without a gradient before a save (an encoder whose modality is absent, a decoder
without targets yet): the checkpoint holds their zero Adam state and the job resumes.

- unit: pre-created zero state is exactly Adam's lazily created one (same updates after a
  parameter's first gradient), for AdamW with and without amsgrad;
- end to end: the llama_omni debug model trained on images only (its audio encoder and image
  generator get no gradient), saved at step 2, resumes from it and reproduces the
  uninterrupted run's losses of steps 3-4 exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.harness import REPO, run_train
from torchtitan_omni.checkpoint.optimizer_state import complete_optimizer_state


@pytest.mark.parametrize("amsgrad", [False, True])
def test_zero_state_equals_the_lazily_created_one(amsgrad):
    torch.manual_seed(0)
    used, unused = torch.randn(4, 3), torch.randn(5)

    def run(complete: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(used.clone()), torch.nn.Parameter(unused.clone())]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, amsgrad=amsgrad)
        for step in range(4):
            params[0].grad = torch.full_like(params[0], 0.5 + step)
            # the second parameter gets its first gradient at step 2
            params[1].grad = torch.full_like(params[1], -1.0) if step >= 2 else None
            opt.step()
            if step == 0 and complete:
                assert complete_optimizer_state([opt]) == 1
                assert set(opt.state[params[1]]) == set(opt.state[params[0]])
                assert float(opt.state[params[1]]["step"]) == 0.0
        return [p.detach().clone() for p in params]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_before_the_first_step_every_parameter_gets_the_step_0_state(amsgrad):
    # (non-colocated encoders: the encoder ranks' optimizer when no encoder had media yet;
    # torch's state-dict helpers would otherwise step it once with zero gradients)
    def run(complete: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
        params.append(torch.nn.Parameter(torch.ones(1), requires_grad=False))
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, amsgrad=amsgrad)
        if complete:
            assert complete_optimizer_state([opt]) == 2
            assert all(float(opt.state[p]["step"]) == 0.0 for p in params[:2])
            assert ("max_exp_avg_sq" in opt.state[params[0]]) == amsgrad
        for step in range(3):
            for p in params[:2]:
                p.grad = torch.full_like(p, 0.5 + step)
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _losses(folder: str, *extra: str) -> tuple[dict[int, dict[str, float]], str]:
    path = os.path.join(folder, "losses.jsonl")
    run = run_train(
        str(REPO / "train_configs/llama_omni_debug.toml"), 1, "--job.dump_folder", folder,
        "--data.modalities", "image", "--training.steps", "4", "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--debug.deterministic",
        "--debug.seed", "7", *extra,
        env={"TRAIN_FILE": "tests.checkpoint.train_entry", "OMNI_LOSS_FILE": path})
    assert run.returncode == 0, run.output[-4000:]
    with open(path) as f:
        return {r.pop("step"): r for r in map(json.loads, f)}, run.output


@pytest.mark.slow
def test_resume_with_parts_that_had_no_gradient(tmp_path):
    first, _ = _losses(str(tmp_path / "a"))
    assert sorted(first) == [1, 2, 3, 4] and first[4]["text"] > 0
    resumed = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoint", resumed / "checkpoint")
    shutil.rmtree(resumed / "checkpoint" / "step-4")
    again, output = _losses(str(resumed))
    assert "Loading the checkpoint from" in output and "step-2" in output, output[-3000:]
    assert sorted(again) == [3, 4]
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]
