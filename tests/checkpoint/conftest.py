"""Session fixtures of the checkpoint tests: tiny transformers checkpoints, and the one 4-rank
and one 2-rank run (``tests/checkpoint/workers.py``) whose results several test modules check
(computed once per session under pytest-xdist too: ``once_per_session``; the tests only read
the folders they name)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.common import expected_state, file_count, tiny_hf_llama, tiny_hf_moe
from tests.checkpoint.workers import TOKENS, run_four, run_two
from tests.harness import once_per_session, run_distributed


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """Tiny transformers checkpoints (Llama: sharded with an index; Qwen3-MoE), their logits on
    ``TOKENS`` and our tensors as the adapters assemble them from the files."""
    return once_per_session(tmp_path_factory, "checkpoint_hf", lambda: _hf(tmp_path_factory))


def _hf(tmp_path_factory):
    from torchtitan_omni.foundations.hf_adapters import Llama3HFAdapter, Qwen3MoeHFAdapter
    from tests.checkpoint.spec import tiny_llama, tiny_moe

    llama = str(tmp_path_factory.mktemp("hf_llama"))
    moe = str(tmp_path_factory.mktemp("hf_moe"))
    models = {"llama": tiny_hf_llama(llama), "moe": tiny_hf_moe(moe)}
    assert file_count(llama) > 1 and os.path.isfile(
        os.path.join(llama, "model.safetensors.index.json")
    )
    with torch.no_grad():
        logits = {k: m(TOKENS).logits for k, m in models.items()}
    return {
        "folders": {"llama": llama, "moe": moe}, "logits": logits,
        "expected": {"llama": expected_state(llama, Llama3HFAdapter(tiny_llama())),
                     "moe": expected_state(moe, Qwen3MoeHFAdapter(tiny_moe()))},
    }


@pytest.fixture(scope="session")
def checkpoint_folders(tmp_path_factory):
    return once_per_session(
        tmp_path_factory, "checkpoint_folders",
        lambda: {k: str(tmp_path_factory.mktemp(f"ckpt_{k}")) for k in ("llama", "moe")})


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory, hf, checkpoint_folders):
    """Per rank: HF loading layouts, the saved training states, their 4-rank reloads."""
    return once_per_session(
        tmp_path_factory, "four_ranks",
        lambda: run_distributed(run_four, 4, hf["folders"], checkpoint_folders))


@pytest.fixture(scope="session")
def convert_root(tmp_path_factory):
    return once_per_session(tmp_path_factory, "convert_root",
                            lambda: str(tmp_path_factory.mktemp("convert")))


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, hf, checkpoint_folders, four_ranks, convert_root):
    """Per rank: HF loading layouts, 2-rank reloads of the 4-rank checkpoints, export/import."""
    return once_per_session(
        tmp_path_factory, "two_ranks",
        lambda: run_distributed(run_two, 2, hf["folders"], checkpoint_folders, convert_root))
