"""Crash safety: a save killed at any point, a truncated file or a missing completion marker is
never resumed from; resume takes the newest complete checkpoint, says so and names what it
skipped. Also: asynchronous saves are published, ``keep_latest_k`` purges only published ones,
and an explicit ``load_step`` of a broken checkpoint fails clearly."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.common import MiniTrainer
from tests.harness import REPO, run_distributed

INTERVAL = ("--checkpoint.interval", "1")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def _resume(folder: str, *overrides: str) -> tuple[dict, list[str]]:
    """Full states after resuming from ``folder``, and what was logged meanwhile."""
    logs = _Records()
    logging.getLogger().addHandler(logs)
    try:
        t = MiniTrainer(1, folder, *INTERVAL, *overrides)
        assert t.manager.load()
        states = t.full_states()
        t.manager.close()
    finally:
        logging.getLogger().removeHandler(logs)
    return states, list(logs.lines)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ----------------------------------------------------------------- scenarios (one 1-rank run)
def _killed(folders: dict) -> dict:
    """Resume from each folder a killed process left (``crash_child``)."""
    return {mode: _resume(folder) for mode, folder in folders.items()}


def _damaged(folder: str):
    """Save steps 1-3, truncate a data file of step 3, delete step 2's marker, resume."""
    t = MiniTrainer(1, folder, *INTERVAL)
    saved = {}
    for _ in range(3):
        t.step()
        t.save()
        saved[t.state.step] = t.full_states()
    t.manager.close()
    step3 = os.path.join(folder, "step-3")
    data = sorted(n for n in os.listdir(step3) if n.endswith(".distcp"))[0]
    os.truncate(os.path.join(step3, data), os.path.getsize(os.path.join(step3, data)) // 2)
    os.remove(os.path.join(folder, "step-2", "omni_manifest.json"))
    loaded, logs = _resume(folder)
    try:
        MiniTrainer(1, folder, *INTERVAL, "--checkpoint.load_step", "3").manager.load(step=3)
        explicit = None
    except ValueError as e:
        explicit = str(e)
    return saved[1], loaded, logs, data, explicit


def _async_keep_latest(folder: str):
    """Four asynchronous saves with keep_latest_k=2, then resume."""
    t = MiniTrainer(1, folder, *INTERVAL, "--checkpoint.async_mode", "async",
                    "--checkpoint.keep_latest_k", "2")
    for _ in range(4):
        t.step()
        t.save()
    final = t.full_states()
    t.manager.close()  # waits for the last asynchronous save and the purge
    listing = sorted(os.listdir(folder))
    loaded, _ = _resume(folder)
    return final, listing, loaded


def _scenarios(rank, world_size, killed, damaged, async_folder):
    return {"killed": _killed(killed), "damaged": _damaged(damaged),
            "async": _async_keep_latest(async_folder)}


MODES = ("in_write", "before_publish", "async")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    folders = {m: str(root / m) for m in MODES}
    states = {m: str(root / f"{m}.pt") for m in MODES}
    procs = {m: subprocess.Popen(  # killed while saving step 2; concurrently, to save time
        [sys.executable, "-m", "tests.checkpoint.crash_child", folders[m], m, states[m]],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for m in MODES}
    codes, errors = {}, {}
    for mode, proc in procs.items():
        _, errors[mode] = proc.communicate(timeout=300)
        codes[mode] = proc.returncode
    listings = {
        m: sorted(os.listdir(folders[m])) if os.path.isdir(folders[m]) else [] for m in MODES
    }
    (result,) = run_distributed(_scenarios, 1, folders, str(root / "damaged"), str(root / "async"))
    return {"codes": codes, "errors": errors, "listings": listings, "states": states,
            "folders": folders, **result}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_killed_saves_are_never_resumed(scenarios, mode):
    assert scenarios["codes"][mode] == -9, f"{mode}: exit {scenarios['codes'][mode]}\n" \
        + scenarios["errors"][mode][-3000:]
    assert scenarios["listings"][mode] == ["saving-2.tmp", "step-1"]
    loaded, logs = scenarios["killed"][mode]
    _same(torch.load(scenarios["states"][mode], weights_only=False), loaded)  # RNG included
    text = "\n".join(logs)
    assert "skipping saving-2.tmp: an interrupted save (never published)" in text, text
    assert "Resuming from the last complete checkpoint, step-1" in text
    assert not os.path.exists(os.path.join(scenarios["folders"][mode], "saving-2.tmp"))


@pytest.mark.slow
def test_truncated_and_unmarked_checkpoints_are_skipped(scenarios):
    saved1, loaded, logs, data, explicit = scenarios["damaged"]
    _same(saved1, loaded)
    text = "\n".join(logs)
    assert f"skipping step-3: {data} is" in text and "(truncated or overwritten)" in text, text
    assert "skipping step-2: no completion marker omni_manifest.json" in text, text
    assert "Resuming from the last complete checkpoint, step-1" in text, text
    assert explicit is not None and "checkpoint.load_step=3" in explicit and data in explicit


@pytest.mark.slow
def test_async_saves_are_published_and_only_published_ones_purged(scenarios):
    final, listing, loaded = scenarios["async"]
    assert listing == ["step-3", "step-4"], listing
    _same(final, loaded)


def test_manifest_is_verified_without_a_process_group(tmp_path):
    """``verify``/``scan`` work on a plain folder (what the converter and tools use)."""
    from torchtitan_omni.checkpoint import completion

    (tmp_path / "step-5").mkdir()
    (tmp_path / "saving-6.tmp").mkdir()
    complete, skipped = completion.scan(str(tmp_path))
    assert complete == []
    assert skipped == ["saving-6.tmp: an interrupted save (never published)",
                       "step-5: no completion marker omni_manifest.json (the save did not finish)"]
    with pytest.raises(ValueError, match="no complete DCP checkpoint"):
        completion.resolve_checkpoint(str(tmp_path))
