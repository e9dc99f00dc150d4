"""Test helpers: run a function on N gloo processes, and run ``run_train.sh`` end to end.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` CPU processes with a gloo
process group and returns each rank's return value (``fn`` must be a module-level function);
each rank is forked from a server that imported torch and the package once per session.
``run_train(config, ngpu, *overrides)`` runs the real launcher and parses the per-step losses.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the fork server imports once, so that each rank, a fork of it, starts in well under a
#: second instead of importing them itself (~5 s of CPU a rank; 2-4 ranks share 2 cores)
PRELOAD = ["torchtitan_omni"]
#: the environment the fork server imports them in (the package selects its device on import)
_SERVER_ENV = {"TORCHTITAN_OMNI_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


def _context():
    """The forkserver context, its server running: started (once per session, again if it
    died) with :data:`PRELOAD` imported on CPU. A rank forked from it starts with the server's
    environment, not the caller's, so :func:`_worker` takes the caller's; and all ranks share
    the server's string hash seed (a set of names iterates alike on every rank, where
    torchrun's processes each have their own: ``run_train`` tests still see that)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, _SERVER_ENV):
        forkserver.ensure_running()
    return ctx


def _worker(rank, world_size, port, fn, args, out_dir, env):
    os.environ.clear()
    os.environ.update(env)  # the caller's environment, as a spawned process would have it
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), TORCHTITAN_OMNI_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    import torchtitan_omni  # noqa: F401  (CPU device for TorchTitan, if PRELOAD failed)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:  # report every failure to the parent
        torch.save(
            {"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt")
        )
        raise
    finally:
        dist.destroy_process_group()


def recorded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or ``{"error": traceback}`` if it raises: one case of a
    multi-case distributed run fails alone (ranks fail alike), and its test shows why."""
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001  (recorded, reported by the test)
        return {"error": traceback.format_exc()}


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.
    Ranks still running after ``timeout`` seconds (all ranks together) are killed and
    reported as hung."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context()
        port, env = free_port(), dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out_dir, env))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        # one deadline for all ranks: ranks left waiting in a collective that a failed rank
        # never joined hang together, and joining each for ``timeout`` would wait N times it
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result" + (" (hung)" if r in hung else ""))
                results.append(None)
                continue
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                errors.append(f"rank {r}:\n{rec['error']}")
            results.append(rec.get("result"))
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


def once_per_session(tmp_path_factory, name: str, compute):
    """``compute()``, once per test session also under pytest-xdist: a session fixture's
    modules may run on different workers, each of which would compute it again (runs of
    tens of seconds). The first worker to get here computes it, the others wait for it and
    load its result (pickled beside the workers' temporary folders, which it may name): xdist's
    documented way to run a session fixture once. Without xdist, just ``compute()``."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker
    with FileLock(str(shared / f"{name}.lock")):
        cached = shared / f"{name}.pkl"
        if cached.exists():
            return pickle.loads(cached.read_bytes())
        result = compute()
        cached.write_bytes(pickle.dumps(result))
        return result


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.eE+na]+)\s*\(([^)]*)\)")


@dataclass
class TrainRun:
    """What one ``run_train.sh`` call printed, and the losses it logged on rank 0."""

    returncode: int
    output: str
    losses: dict[int, float] = field(default_factory=dict)
    named: dict[int, dict[str, float]] = field(default_factory=dict)

    def loss_list(self) -> list[float]:
        return [self.losses[s] for s in sorted(self.losses)]

    def refusal(self, key: str) -> str:
        """The one-line start-up refusal naming ``key`` (the run failed, printing
        ``torchtitan-omni: error: <key>...`` and no traceback of this project's code after it)."""
        assert self.returncode != 0, self.output[-2000:]
        lines = [line for line in self.output.splitlines()
                 if f"torchtitan-omni: error: {key}" in line]
        assert lines, self.output[-2000:]
        assert "torchtitan_omni/" not in self.output.split("torchtitan-omni: error:")[-1]
        return lines[0]


def parse_losses(output: str) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Per-step total and named losses from the trainer's console lines."""
    losses, named = {}, {}
    for line in _ANSI.sub("", output).splitlines():
        m = _STEP.search(line)
        if not m:
            continue
        step = int(m.group(1))
        losses[step] = float(m.group(2))
        parts = {}
        for item in m.group(3).split("  "):
            if ":" in item:
                k, v = item.split(":", 1)
                parts[k.strip()] = float(v)
        named[step] = parts
    return losses, named


def run_train(config: str, ngpu: int = 1, *overrides: str, env: dict | None = None,
              timeout: float = 900.0) -> TrainRun:
    """Run ``./run_train.sh`` on CPU with ``NGPU=ngpu`` (without its config pre-check unless
    ``env`` sets ``TORCHTITAN_OMNI_PRECHECK=1``) and parse the per-step losses. The
    console shows rank 0; when the run fails, the end of every other rank's output (from
    ``LOG_DIR``) is appended to ``output``, so a failure on another rank can be read too."""
    full_env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="omni_ranks_") as log_dir:
        # no pre-check process: the ranks run the same check, and a Python start that imports
        # TorchTitan is 5-12 s of a 2-core machine (tests/test_trainer.py covers the pre-check
        # and its absence)
        full_env.update(NGPU=str(ngpu), CONFIG_FILE=str(config), TORCHTITAN_OMNI_DEVICE="cpu",
                        LOG_RANK="0", LOG_DIR=log_dir, PYTHONUNBUFFERED="1",
                        PYTHONFAULTHANDLER="1", TORCHTITAN_OMNI_PRECHECK="0")
        full_env.update(env or {})
        proc = subprocess.run(
            ["bash", str(REPO / "run_train.sh"), "--metrics.log_freq", "1", *overrides],
            cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=timeout,
        )
        output = proc.stdout
        if proc.returncode != 0:
            output += _other_ranks_output(Path(log_dir))
    losses, named = parse_losses(proc.stdout)
    return TrainRun(proc.returncode, output, losses, named)


def _other_ranks_output(log_dir: Path, chars: int = 1500) -> str:
    """The last ``chars`` of each non-zero rank's stdout and stderr under torchrun's log dir."""
    parts = []
    for path in sorted(log_dir.glob("*/attempt_*/*/std*.log")):
        rank = path.parent.name
        text = path.read_text(errors="replace").strip()
        if rank != "0" and text:
            parts.append(f"\n--- rank {rank} {path.stem} (last {chars} characters) ---\n"
                         f"{text[-chars:]}")
    return "".join(parts)


def python() -> str:
    return sys.executable


def load_script(name: str):
    """Import ``scripts/<name>.py`` (not a package) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def metrics_processor(*overrides: str):
    """The omni trainer's metrics processor for one rank without TensorBoard, its job config
    parsed from ``overrides`` (TorchTitan's command-line form)."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from torchtitan_omni.components.metrics import OmniMetricsProcessor

    job = ConfigManager().parse_args(["--metrics.no-enable_tensorboard", *overrides])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return OmniMetricsProcessor(job, dims)
