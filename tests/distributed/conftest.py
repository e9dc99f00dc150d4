"""Session fixtures of the distributed tests: a ``run_train.sh`` run that two modules check."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def colocated_run(tmp_path_factory):
    """llama_omni debug colocated on 2 processes, the replicated encoders of the default layout
    (``test_noncolocated_trainer.py: train_colocated``): the reference of the non-colocated
    runs there and of the balanced encoders' run in ``test_encoder_balance.py``, which would
    each train it (~20 s on 2 cores)."""
    from tests.distributed.test_noncolocated_trainer import train_colocated

    return train_colocated(tmp_path_factory)
