"""Peak host and device memory while loading Hugging Face weights into the sharded model,
against the size of one rank's shard.

    # GPU host, 8 ranks, the largest llama_omni flavor that fits:
    torchrun --nproc_per_node 8 scripts/bench_loading.py --model llama_omni --flavor auto
    # CPU smoke test (one process):
    TORCHTITAN_OMNI_DEVICE=cpu python scripts/bench_loading.py \
        --model llama_omni --flavor debugmodel

Rank 0 first writes an HF-format checkpoint of random weights (``--dtype``, bfloat16 by default,
one folder per part with a Hugging Face adapter, 2 GB shards) under ``--dir``, unless a
previous run left one for the same model and flavor. Every rank then builds the model as the
trainer does (meta device, ``parallelize_omni``, local shards materialized; the random init is
skipped: loading overwrites it) and loads every part through ``weights.sources``. Reported per
rank: the local shard's bytes, peak host RSS and peak device memory (allocated) during the load
above what the shard already took, bytes read, time. Host RSS includes the memory-mapped
checkpoint pages this rank touched.

``--flavor auto`` picks the largest flavor whose per-rank shard fits in 80% of the device's
memory (host RAM on CPU), whose largest tensor fits in host memory, and whose checkpoint fits
on the disk of ``--dir``. Arguments after ``--`` override the job config
(``-- --parallelism.data_parallel_shard_degree 4``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.getcwd())

import torchtitan_omni  # noqa: F401  (device selection before TorchTitan loads)
import torch
import torch.distributed as dist

from torchtitan_omni.checkpoint.hf_export import ShardedWriter, exportable_parts
from torchtitan_omni.checkpoint.hf_loader import expected_hf_shape
from torchtitan_omni.distributed.process_group import init_process_group
from torchtitan_omni.job_model import model_on_meta, train_spec_of
from torchtitan_omni.checkpoint.parts import state_tensors
from torchtitan_omni.checkpoint.sharding import local_tensor
from torchtitan_omni.checkpoint.weights import load_initial_weights
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.utils import barrier
from torchtitan_omni.platform import CpuDeviceModule, is_cpu, local_device

GiB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _config(args, flavor: str | None, overrides: list[str]):
    """The job config: ``--config`` or ``--model`` (+ flavor) with the ``--`` overrides."""
    from torchtitan_omni.config.manager import parse_config
    from torchtitan_omni.config.manager import OmniConfigManager

    flags = (["--model.name", args.model] if args.model else []) + \
        (["--model.flavor", flavor] if flavor else []) + list(overrides)
    if args.config:
        return parse_config(args.config, flags)
    return OmniConfigManager().parse_args(flags)


def _numel(model) -> tuple[int, int]:
    """Total elements of the model's state tensors, and of the largest one."""
    sizes = [t.numel() for t in state_tensors(model).values()]
    return sum(sizes), max(sizes)


def _device_bytes() -> int:
    if is_cpu():
        return CpuDeviceModule().get_device_properties().total_memory
    return torch.cuda.get_device_properties(local_device()).total_memory


def pick_flavor(args, overrides: list[str], world: int) -> str:
    """The largest flavor that fits (see the module docstring)."""
    from torchtitan_omni.job_model import model_on_meta, train_spec_of

    spec = train_spec_of(_config(args, None, overrides))
    os.makedirs(args.dir, exist_ok=True)
    disk = shutil.disk_usage(args.dir).free
    device, host = _device_bytes(), CpuDeviceModule().get_device_properties().total_memory
    best, best_numel = None, -1
    for flavor in spec.model_args:
        cfg = _config(args, flavor, overrides)
        total, largest = _numel(model_on_meta(cfg))
        shard = total * DTYPES[cfg.training.dtype].itemsize / world
        ckpt = total * DTYPES[args.dtype].itemsize
        # the writer holds one float32 tensor and its cast; a rank holds its shard
        fits = shard < 0.8 * device and largest * 6 < 0.5 * host and ckpt < 0.8 * disk
        if dist.get_rank() == 0:
            print(
                f"flavor {flavor}: {total / 1e9:.2f}B elements, shard {shard / GiB:.2f} GiB/rank, "
                f"checkpoint {ckpt / GiB:.2f} GiB: {'fits' if fits else 'does not fit'}"
            )
        if fits and total > best_numel:
            best, best_numel = flavor, total
    if best is None:
        raise SystemExit("no flavor fits this machine")
    return best


def write_random_checkpoint(
    model, folder: str, dtype: torch.dtype, shard_bytes: int
) -> dict[str, str]:
    """One HF folder of random tensors per part with an adapter; returns part -> folder."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for part, adapter in exportable_parts(model).items():
        tensors = state_tensors(model.get_submodule(part))
        target = os.path.join(folder, part)
        writer = ShardedWriter(target, shard_bytes)
        for name, source in adapter.sources().items():
            shape = expected_hf_shape(tuple(tensors[name].shape), source)
            for key in source.keys:
                if key in writer.weight_map or key in writer.pending:
                    continue  # tied weights
                writer.add(key, (torch.randn(shape, generator=g) * 0.02).to(dtype))
        writer.close()
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(adapter.hf_config(), f, indent=2)
        out[part] = target
    return out


def _local_bytes(model) -> int:
    seen, total = set(), 0
    for t in state_tensors(model).values():
        local = local_tensor(t)
        if local.numel() and local.data_ptr() not in seen:  # tied weights count once
            seen.add(local.data_ptr())
            total += local.numel() * local.element_size()
    return total


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    from torchtitan.tools.logging import init_logger

    init_logger()
    argv = sys.argv[1:]
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a registered model spec (or give --config)")
    parser.add_argument("--config", help="a job TOML instead of --model")
    parser.add_argument(
        "--flavor", default="auto", help="a flavor, or auto (the largest that fits)"
    )
    parser.add_argument(
        "--dir", default="./bench_out/hf_random", help="where the checkpoint is written"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--json", help="append the per-rank results to this JSON-lines file")
    args = parser.parse_args(argv)
    if not (args.model or args.config):
        parser.error("give --model or --config")

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    flavor = pick_flavor(args, overrides, world) if args.flavor == "auto" else args.flavor
    cfg = _config(args, flavor, overrides)
    folder = os.path.join(args.dir, f"{cfg.model.name}-{cfg.model.flavor}-{args.dtype}")
    marker = os.path.join(folder, "complete")
    if rank == 0 and not os.path.exists(marker):
        shutil.rmtree(folder, ignore_errors=True)
        begin = time.monotonic()
        parts = write_random_checkpoint(model_on_meta(cfg), folder, DTYPES[args.dtype],
                                        int(args.shard_gb * GiB))
        open(marker, "w").close()
        print(
            f"wrote {', '.join(parts)} to {folder} in {time.monotonic() - begin:.0f}s", flush=True
        )
    barrier()
    sources = [f"{p}={os.path.join(folder, p)}" for p in exportable_parts(model_on_meta(cfg))]

    dims = OmniParallelDims.from_config(cfg.parallelism, world)
    model = train_spec_of(cfg).parallelize_fn(model_on_meta(cfg), dims, cfg)
    model.to_empty(device=local_device())
    with torch.no_grad():  # touch every page: the shard is resident before the load starts
        for t in state_tensors(model).values():  # (no random init: loading overwrites it)
            local_tensor(t).zero_()
    shard = _local_bytes(model)
    host = CpuDeviceModule()
    host.reset_peak_memory_stats()
    rss_before = _rss()
    dev_before = 0
    if not is_cpu():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        dev_before = torch.cuda.memory_allocated()
    begin = time.monotonic()
    reports = load_initial_weights(model, sources)
    if not is_cpu():
        torch.cuda.synchronize()
    seconds = time.monotonic() - begin
    result = {
        "rank": rank, "world": world, "model": cfg.model.name, "flavor": cfg.model.flavor,
        "device": "cpu" if is_cpu() else torch.cuda.get_device_name(local_device()),
        "shard_gib": shard / GiB, "checkpoint_gib": sum(r.checkpoint_bytes for r in reports) / GiB,
        "read_gib": sum(r.bytes_read for r in reports) / GiB, "seconds": seconds,
        "host_rss_before_gib": rss_before / GiB, "host_peak_gib": host.max_memory_allocated() / GiB,
    }
    result["host_peak_over_before_gib"] = result["host_peak_gib"] - result["host_rss_before_gib"]
    if not is_cpu():
        result["device_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        result["device_peak_over_before_gib"] = (
            torch.cuda.max_memory_allocated() - dev_before
        ) / GiB
    line = "  ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
    )
    print(f"[rank {rank}] {line}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
