"""``torchtitan_omni.distributed.process_group.init_process_group``: a standalone tool's group
(torchrun's, or one local process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import torch.distributed as dist\n"
         "from torchtitan_omni.distributed.process_group import init_process_group\n"
         "init_process_group()\n"
         "print(dist.get_world_size(), dist.get_rank())")


def _run(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}],
                         ids=["plain", "left_by_a_one_process_parent"])
def test_one_local_process_without_torchrun(env):
    """No torchrun: one process, also where a parent that made its own one-process group
    left WORLD_SIZE=1 in the environment it passes on (no MASTER_ADDR to rendezvous at)."""
    run = _run(**env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["1", "0"]


def test_a_larger_world_without_an_address_is_not_run_as_one_process():
    """WORLD_SIZE=2 means a launcher: without MASTER_ADDR it stops, naming the variable,
    instead of training alone."""
    run = _run(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    assert run.returncode != 0
    assert "MASTER_ADDR" in run.stderr
