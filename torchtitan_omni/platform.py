"""Device selection at start-up: CUDA with NCCL, or CPU with gloo.

TorchTitan 0.2.2 decides ``torchtitan.tools.utils.device_type`` when it is first imported and
falls back to ``"cuda"`` on a machine without a GPU; several of its modules copy that value
(``from torchtitan.tools.utils import device_type, device_module``) as ``import torchtitan``
loads them. ``torchtitan_omni/__init__.py`` therefore calls :func:`select_device` first thing.

This module is the only place where torchtitan-omni changes TorchTitan's globals. On CPU it
sets, in ``torchtitan.tools.utils`` and in each module listed in :data:`_COPIES` (the ones
that hold a copy):

- ``device_type = "cpu"``, so meshes are built on CPU and ``init_process_group`` picks gloo
  (``Backend.default_device_backend_map["cpu"]``);
- ``device_module`` = :class:`CpuDeviceModule`, a small stand-in for ``torch.cuda`` that gives
  TorchTitan's memory monitor the process's peak resident memory, and accepts the
  ``set_device``/``synchronize``/``empty_cache`` calls the trainer makes.

Everything else that differs on CPU is handled by subclasses and options, not patches: FSDP
collectives use plain sums (gloo has no PREMUL_SUM/AVG; ``torchtitan_omni.distributed
.parallelize``), CPU runs stay in float32 (``OmniTrainer``), and TorchTitan's barrier with
``device_ids`` works on gloo as it is.

The device is chosen by ``TORCHTITAN_OMNI_DEVICE`` (``auto``, ``cuda`` or ``cpu``; default
``auto``: CUDA when a GPU is visible, else CPU). ``run_train.sh`` sets it.
"""

from __future__ import annotations

import importlib
import os
import platform as _platform
import resource
from dataclasses import dataclass

import torch

DEVICE_ENV = "TORCHTITAN_OMNI_DEVICE"
_VALID = ("auto", "cuda", "cpu")

_selected: str | None = None

# TorchTitan 0.2.2 modules that hold their own copy of the device type or module.
_COPIES = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.tools.profiling": ("device_module",),
}


@dataclass(frozen=True)
class _CpuDeviceProperties:
    name: str
    total_memory: int


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 0


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is KiB on Linux; it cannot be reset, so it is only the fallback.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CpuDeviceModule:
    """The subset of the ``torch.cuda`` API that TorchTitan's trainer calls, for CPU.

    Memory figures are host memory: "reserved" and "active" peaks are both the peak resident
    set size since the last reset (Linux resets it through ``/proc/self/clear_refs``).
    """

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:  # one CPU "device" per process
        del device

    def synchronize(self, device=None) -> None:
        del device

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_device_name(self, device=None) -> str:
        del device
        return f"CPU ({_platform.processor() or _platform.machine()})"

    def get_device_properties(self, device=None) -> _CpuDeviceProperties:
        return _CpuDeviceProperties(self.get_device_name(device), _total_memory_bytes())

    def memory_stats(self, device=None) -> dict[str, int]:
        del device
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def max_memory_allocated(self, device=None) -> int:
        del device
        return _peak_rss_bytes()

    def reset_peak_memory_stats(self, device=None) -> None:
        del device
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
        except OSError:
            pass


def _resolve(requested: str) -> str:
    if requested not in _VALID:
        raise ValueError(
            f"{DEVICE_ENV}={requested!r} is not one of {', '.join(_VALID)}"
        )
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but no CUDA device is visible")
    return requested


def select_device() -> str:
    """Choose the device type once per process and adapt TorchTitan to it.

    Returns ``"cuda"`` or ``"cpu"``; calling it again returns the first choice.
    """
    global _selected
    if _selected is not None:
        return _selected
    choice = _resolve(os.environ.get(DEVICE_ENV, "auto").strip().lower() or "auto")

    if choice == "cpu":
        cpu_module = CpuDeviceModule()
        for module_name, names in _COPIES.items():
            module = importlib.import_module(module_name)
            for name in names:
                setattr(module, name, "cpu" if name == "device_type" else cpu_module)
    _selected = choice
    return choice


def device_type() -> str:
    """The device type chosen at start-up (``"cuda"`` or ``"cpu"``)."""
    return select_device()


def is_cpu() -> bool:
    """True when training runs on CPU with gloo."""
    return select_device() == "cpu"


def local_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` on GPU, ``cpu`` on CPU."""
    if is_cpu():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
