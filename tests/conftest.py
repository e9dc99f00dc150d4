"""Shared test set-up: CPU device, one thread per process, GPU tests skipped without CUDA; and
``run_train.sh`` runs that test modules of two folders check (session fixtures)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHTITAN_OMNI_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # "tests.*" fixtures importable

import pytest
import torch

import torchtitan_omni  # noqa: F401  (select the device before TorchTitan loads)

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def part_layout_runs(tmp_path_factory):
    """llama_omni debug through ``run_train.sh`` on 2 ranks under Ulysses SP2, 4 steps, in the
    default layout and in the mixed ``[parallelism.parts]`` one
    (``tests/checkpoint/test_resume_part_layouts.py: train_layouts``). Shared: the resume tests
    there and the tables' launcher test of ``tests/distributed/test_part_layouts.py`` would
    each train the same two runs (~20 s each on 2 cores)."""
    from tests.checkpoint.test_resume_part_layouts import train_layouts
    from tests.harness import once_per_session

    return once_per_session(tmp_path_factory, "part_layout_runs",
                            lambda: train_layouts(tmp_path_factory))

