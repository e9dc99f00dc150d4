"""Shared test set-up: CPU device, one thread per process, GPU tests skipped without CUDA."""

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
