"""Checkpointed state besides model and optimizer: the dataloader position and the RNGs.

Both are per rank, so each is stored under a key naming its rank: DCP treats equal keys from
different ranks as one replicated value and keeps a single copy.

Dataloader: one entry per data-parallel rank (``dp_rank_<r>``, the loader's own
``state_dict()`` pickled) and ``dp_world_size``. Sequence-parallel ranks of one data rank
read the same batches, so their equal entries are rightly stored once. Resuming with the same
number of data ranks hands each rank its own entry. With a different number, every rank gets
all old entries and the loader continues the stream through::

    loader.load_state_dict_resharded(states: list[dict]) -> None

(``states[r]`` is old data rank ``r``'s state; ``OmniDataLoader`` implements it, see
``torchtitan_omni.data.resplit``); a loader without that method cannot be re-split, and
resuming fails with a message that names the way out
(``--checkpoint.exclude_from_loading dataloader`` restarts the data stream).

RNG: torch (CPU and the current CUDA device), Python ``random`` and NumPy, per global rank.
They are restored only under the same layout; under another one the streams would not line up
anyway, and the fresh per-rank seeds of the new run are kept (logged).
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.tools.logging import logger
from torchtitan_omni.errors import CheckpointFormatError

RNG = "rng"
RESHARD_METHOD = "load_state_dict_resharded"


def _dp_key(rank: int) -> str:
    return f"dp_rank_{rank}"


class DataloaderState(Stateful):
    """The dataloader's per-data-rank state, saved so it can be re-split (module docstring)."""

    def __init__(self, loader: Any, dp_rank: int, dp_world_size: int) -> None:
        self.loader = loader
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size

    def state_dict(self) -> dict[str, Any]:
        return {
            _dp_key(self.dp_rank): pickle.dumps(self.loader.state_dict()),
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(pickle.loads(state_dict[_dp_key(self.dp_rank)]))

    def for_loading(self, checkpoint_keys: set[str], prefix: str) -> Stateful:
        """What to hand DCP to restore from a checkpoint with these (flattened) keys."""
        if f"{prefix}.dp_world_size" not in checkpoint_keys:
            raise CheckpointFormatError(
                "the checkpoint holds no torchtitan-omni dataloader state; pass "
                "--checkpoint.exclude_from_loading dataloader to start the data stream afresh"
            )
        old = sum(1 for k in checkpoint_keys if k.startswith(f"{prefix}.dp_rank_"))
        if old == self.dp_world_size:
            return self
        if not callable(getattr(self.loader, RESHARD_METHOD, None)):
            raise CheckpointFormatError(
                f"the checkpoint's dataloader state was saved by {old} data-parallel ranks and "
                f"this run has {self.dp_world_size}; {type(self.loader).__name__} cannot re-split "
                f"it (no {RESHARD_METHOD}). Keep the data-parallel size, or pass "
                "--checkpoint.exclude_from_loading dataloader to restart the data stream"
            )
        logger.info(
            f"Re-splitting the dataloader state of {old} data-parallel ranks over "
            f"{self.dp_world_size} ({type(self.loader).__name__}.{RESHARD_METHOD})"
        )
        return _ReshardedLoad(self.loader, old)


class _ReshardedLoad(Stateful):
    """Loads every old data rank's entry and lets the loader continue the stream."""

    def __init__(self, loader: Any, old_world_size: int) -> None:
        self.loader = loader
        self.old_world_size = old_world_size

    def state_dict(self) -> dict[str, Any]:
        keys = {_dp_key(r): b"" for r in range(self.old_world_size)}
        return {**keys, "dp_world_size": self.old_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = [pickle.loads(state_dict[_dp_key(r)]) for r in range(self.old_world_size)]
        getattr(self.loader, RESHARD_METHOD)(states)


def _capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


class RNGState(Stateful):
    """Every RNG of this rank, saved under the rank's own key."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{self.rank}": pickle.dumps(_capture_rng())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _restore_rng(pickle.loads(state_dict[f"rank_{self.rank}"]))
