"""A checkpoint saved under one layout loads under another: model *and* optimizer tensors are the
saved ones bit for bit, the scheduler and step are restored, and the dataloader state is
re-split over the new number of data ranks.

The session's 4-rank run saves after two training steps (Llama: FSDP4; Qwen3-MoE: FSDP4 x EP2)
and reloads on 4 ranks as FSDP2 x SP2 (x EP2); the 2-rank run reloads as FSDP2 (the MoE with
EP1). The reference is the full state gathered from the saving run.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.workers import RELOADS, available


def _same(saved: dict, loaded: dict, what: str) -> None:
    # (RNG states are restored only under the same layout: not compared here)
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor) and k != "rng"]
    assert any(k.startswith("optimizer.") for k in tensors), "no optimizer state was saved"
    assert set(tensors) == {
        k for k, v in loaded.items() if isinstance(v, torch.Tensor) and k != "rng"
    }, what
    for key in tensors:
        assert torch.equal(saved[key], loaded[key]), f"{what}: {key} differs from the saved one"
    assert loaded["lr_step"] == saved["lr_step"] == 2, what
    assert loaded["step"] == saved["step"] == 2, what
    # Two steps of 4 rows each: every layout continues at row 8 of the stream.
    assert loaded["cursor"] == saved["cursor"] == 8, what


@pytest.mark.slow  # checks the shared 4-rank and 2-rank runs (conftest: ~30 s on 2 cores)
@pytest.mark.parametrize("target", list(RELOADS))
def test_checkpoint_reshards(four_ranks, two_ranks, target):
    world, flavor, overrides = RELOADS[target]
    if not available(overrides) or (flavor == "moe" and "moe" not in four_ranks[0]["saved"]):
        pytest.skip("the parallelism of this layout has not landed")
    saved = four_ranks[0]["saved"][flavor]
    loaded = (four_ranks if world == 4 else two_ranks)[0]["reloads"][target]
    if flavor == "moe":
        assert any(".moe.experts.w1" in k and k.startswith("optimizer.") for k in saved)
    origin = "FSDP4" if flavor == "llama" else "FSDP4 x EP2"
    _same(saved, loaded, f"{origin} -> {target}")
