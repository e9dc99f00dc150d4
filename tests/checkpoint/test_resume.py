"""Save, then resume through ``run_train.sh``, against an uninterrupted run.

Run A starts from a tiny transformers Llama (``weights.sources``), trains 6 steps on 2 ranks
(FSDP2, two rows each) and saves full checkpoints at steps 3 and 6. Resumes start from a copy
of A's checkpoint folder:

- same layout, with step 6's data file truncated: resume skips it (saying so), continues from
  step 3, and reproduces A's losses of steps 4-6 exactly (``--debug.deterministic``) and A's
  final model and optimizer bit for bit;
- 1 rank (four rows: the same 4 rows per step) and Ulysses SP2 on 2 ranks (one data rank of
  four rows): model, optimizer and the dataloader state re-split from 2 data ranks to 1
  continue A within 1e-5 relative. (4-rank layouts are checked tensor by tensor in
  ``test_reshard.py``; here the budget is two cores.)

Losses are recorded at full precision by ``tests.checkpoint.train_entry``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.common import (
    CONFIG, copy_checkpoints, dcp_tensors, has_module, tiny_hf_llama, train_logged,
)

pytestmark = pytest.mark.slow
FSDP = "--parallelism.data_parallel_shard_degree"
A_LAYOUT = (FSDP, "2", "--training.local_batch_size", "2")


def _train(folder: str, ngpu: int, *overrides: str) -> tuple[dict[int, float], str]:
    losses, output = train_logged(CONFIG, folder, ngpu, *overrides)
    return {step: named["text"] for step, named in losses.items()}, output


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Starts from a tiny transformers Llama (``weights.sources``), as a real run would."""
    folder = str(tmp_path_factory.mktemp("resume_a"))
    hf = str(tmp_path_factory.mktemp("resume_hf"))
    tiny_hf_llama(hf)
    losses, output = _train(folder, 2, *A_LAYOUT, "--weights.sources", f"llm={hf}")
    assert f"Loaded llm from Hugging Face {hf}" in output, output[-3000:]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(os.path.join(folder, "checkpoint"))) == ["step-3", "step-6"]
    return folder, losses, hf


def test_resume_same_layout_is_exact_and_skips_a_truncated_checkpoint(run_a, tmp_path):
    src, losses_a, hf = run_a
    folder = str(tmp_path)
    copy_checkpoints(src, folder)
    step6 = os.path.join(folder, "checkpoint", "step-6")
    victim = sorted(n for n in os.listdir(step6) if n.endswith(".distcp"))[-1]
    os.truncate(os.path.join(step6, victim), os.path.getsize(os.path.join(step6, victim)) - 1)
    losses_b, output = _train(folder, 2, *A_LAYOUT, "--weights.sources", f"llm={hf}")
    assert "weights.sources not loaded: the model comes from the checkpoint" in output
    assert f"skipping step-6: {victim} is" in output and "truncated" in output, output[-4000:]
    assert "Resuming from the last complete checkpoint, step-3" in output
    assert sorted(losses_b) == [4, 5, 6]
    assert [losses_b[s] for s in (4, 5, 6)] == [losses_a[s] for s in (4, 5, 6)]
    a, b = dcp_tensors(os.path.join(src, "checkpoint", "step-6")), dcp_tensors(step6)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


LAYOUTS = {
    "one_rank": (1, ("--training.local_batch_size", "4")),
    "sp2_on_2_ranks": (2, (FSDP, "1", "--parallelism.ulysses_degree", "2",
                           "--training.local_batch_size", "4")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_under_another_layout_matches(run_a, tmp_path, layout):
    if "ulysses" in layout and not has_module("torchtitan_omni.distributed.ulysses"):
        pytest.skip("Ulysses sequence parallel has not landed")
    src, losses_a, _ = run_a
    folder = str(tmp_path)
    copy_checkpoints(src, folder, drop=(6,))
    ngpu, overrides = LAYOUTS[layout]
    losses, output = _train(folder, ngpu, *overrides)
    assert "Re-splitting the dataloader state of 2 data-parallel ranks over 1" in output
    assert "RNG states not restored" in output
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(losses_a[step], rel=1e-5), (step, losses, losses_a)
