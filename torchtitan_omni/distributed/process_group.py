"""The process group of a standalone tool (generation, conversion): torchrun's, or a single
local process when not launched by torchrun."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from torchtitan_omni.platform import is_cpu, local_device


def init_process_group() -> None:
    """Join torchrun's process group, or start a one-process group on a free local port."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    if not is_cpu():
        torch.cuda.set_device(local_device())
    dist.init_process_group("gloo" if is_cpu() else "cuda:nccl,cpu:gloo")
