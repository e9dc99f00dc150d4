"""The process group of a standalone tool (generation, conversion): torchrun's, or a single
local process when not launched by torchrun."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchtitan_omni.platform import is_cpu, local_device


def init_process_group() -> None:
    """Join torchrun's process group, or start a one-process group."""
    if dist.is_initialized():
        return
    # torchrun's rendezvous needs MASTER_ADDR; WORLD_SIZE=1 alone may be left by an earlier
    # one-process group of this process (set below), inherited by a child process
    launched = "MASTER_ADDR" in os.environ or os.environ.get("WORLD_SIZE", "1") != "1"
    if not launched:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not is_cpu():
        torch.cuda.set_device(local_device())
    backend = "gloo" if is_cpu() else "cuda:nccl,cpu:gloo"
    if launched:
        dist.init_process_group(backend)
    else:
        # one local process: an in-memory store, so no free port has to be picked (another
        # process could take it between the pick and the bind)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
