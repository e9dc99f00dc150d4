"""A training process that is killed (SIGKILL) while saving, for the crash-safety tests.

``python -m tests.checkpoint.crash_child FOLDER MODE STATES``: trains one step, saves step 1
completely (its full states go to STATES), trains a second step and dies while saving it:

- ``in_write``: after the data files are written, before DCP writes ``.metadata``;
- ``before_publish``: after DCP finished (``.metadata`` written), before the rename;
- ``async``: an asynchronous save, the process killed while the background write is running.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    folder, mode, states_path = sys.argv[1:4]
    from tests.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", TORCHTITAN_OMNI_DEVICE="cpu")
    import torch
    import torch.distributed as dist

    import torchtitan_omni  # noqa: F401
    from torch.distributed.checkpoint import FileSystemWriter

    import torchtitan_omni.checkpoint.manager as manager_module
    from tests.checkpoint.common import MiniTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    extra = ("--checkpoint.async_mode", "async") if mode == "async" else ()
    t = MiniTrainer(1, folder, "--checkpoint.interval", "1", *extra)
    t.step()
    t.save()
    t.manager.wait_for_async_save()
    torch.save(t.full_states(), states_path)
    t.step()
    if mode == "in_write":
        FileSystemWriter.finish = _die
    elif mode == "before_publish":
        manager_module.publish = _die
    elif mode == "async":
        FileSystemWriter.finish = lambda *a, **k: time.sleep(600)
    else:
        raise SystemExit(f"unknown mode {mode}")
    t.save()
    if mode == "async":
        time.sleep(1.0)  # the background thread is writing; the job is preempted now
        _die()
    raise SystemExit(3)  # not reached: the save kills the process


if __name__ == "__main__":
    main()
