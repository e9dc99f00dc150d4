"""Throughput of Ulysses sequence parallel: SP1 vs SP2/SP4 at a long sequence, sync vs async
(without head groups, and with the heads pipelined in groups).

A Llama-shaped foundation (no encoders) trains on synthetic packed documents with the
framework's own ``parallelize_omni`` (FSDP2 over dp_shard x sp, bf16 params and fp32
reductions, full activation checkpointing by default). For every SP degree that divides the
world size (and each Ulysses mode for SP > 1) it times ``--steps`` optimizer steps after
``--warmup`` and prints, and writes as a markdown table, the real tokens per second per GPU
(every SP group of ranks works on one sequence of ``--seq-len`` tokens, so the figures
compare directly) and the peak memory.

GPU (the lead's one command, 2 or 4 GPUs)::

    torchrun --nproc_per_node 4 scripts/bench_parallel.py --seq-len 65536 --out bench_sp.md

CPU smoke test (tiny shapes, gloo)::

    TORCHTITAN_OMNI_DEVICE=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 \\
        scripts/bench_parallel.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torchtitan_omni  # noqa: F401  (device selection before TorchTitan loads)
import torch
import torch.distributed as dist

from torchtitan_omni.components.loss import OmniLoss
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.parallelize import parallelize_omni
from torchtitan_omni.distributed.sequence import shard_sequence
from torchtitan_omni.distributed.ulysses import (
    NCCL_HIGH_PRIORITY_ENV, AsyncUlyssesRunner, prefer_high_priority_exchanges,
)
from torchtitan_omni.distributed.utils import all_reduce, clip_grad_norm_
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.platform import is_cpu, local_device
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta
from torchtitan_omni.protocols.plan import OmniParallelPlan, PartLayout

PLAN = OmniParallelPlan(
    parts=(
        PartLayout(
            "llm", fsdp_units=("tok_embeddings", "layers.*", "output"), ac_units=("layers.*",)
        ),
    ),
    sequence_parallel_attention=("llm.layers.*.attention",),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--doc-len", type=int, default=0, help="mean document length (0: seq-len / 4)")
    p.add_argument(
        "--sp", default="", help="comma-separated SP degrees (default: all dividing the world)"
    )
    p.add_argument("--modes", default="sync,async1,async",
                   help="sync, async (head groups: as many as fit) or asyncN (N head groups)")
    p.add_argument("--ac", default="full", choices=["none", "full"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="", help="write the table (markdown) here (rank 0)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps (CPU check)")
    args = p.parse_args()
    if args.smoke:
        args.seq_len, args.dim, args.layers, args.heads, args.kv_heads = 64, 32, 2, 4, 1
        args.ffn, args.vocab, args.steps, args.warmup = 64, 128, 2, 1
    return args


def head_groups(mode: str) -> int | None:
    """``--modes`` entry -> async Ulysses' head groups: "sync" None, "async" 0 (as many as
    fit), "asyncN" N (``async1``: the runner without head groups)."""
    if mode == "sync":
        return None
    if not mode.startswith("async") or not (mode[5:] or "0").isdigit():
        raise SystemExit(f"--modes: {mode!r} is not sync, async or asyncN (N head groups)")
    return int(mode[5:] or 0)


def job_config(args, sp: int, mode: str):
    from torchtitan_omni.config.merge import default_job_config

    cfg = default_job_config()
    cfg.parallelism.ulysses_degree = sp
    groups = head_groups(mode)
    cfg.parallelism.ulysses_async = groups is not None
    cfg.parallelism.ulysses_async_head_chunks = groups or 0
    cfg.activation_checkpoint.mode = args.ac
    return cfg


def packed_batch(args, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One row of random documents (lengths around ``--doc-len``), identical on the ranks of
    an SP group (same seed)."""
    g = torch.Generator().manual_seed(seed)
    mean = args.doc_len or max(8, args.seq_len // 4)
    tokens = torch.randint(0, args.vocab, (1, args.seq_len), generator=g)
    positions = torch.zeros_like(tokens)
    bounds, start = [0], 0
    while start < args.seq_len:
        n = min(
            int(torch.randint(mean // 2, mean * 3 // 2 + 1, (1,), generator=g)),
            args.seq_len - start,
        )
        positions[0, start:start + n] = torch.arange(n)
        start += n
        bounds.append(start)
    labels = torch.roll(tokens, -1, 1)
    labels[0, torch.tensor(bounds[1:]) - 1] = B.IGNORE_INDEX  # no target across documents
    batch = {B.INPUT: tokens, B.POSITION_IDS: positions,
             B.CU_SEQLENS: torch.tensor(bounds, dtype=torch.int32)}
    return batch, labels


def build(args, dims: OmniParallelDims, cfg, device) -> OmniModel:
    llm_args = Llama3Args(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                          n_kv_heads=args.kv_heads, vocab_size=args.vocab, ffn_hidden_dim=args.ffn,
                          rope_scaling=None, max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = OmniModel(Llama3(llm_args), plan=PLAN)
    model = parallelize_omni(model, dims, cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model


def step(model, dims, batch, labels, device, loss_fn, opt) -> None:
    sp_rank = dims.get_mesh("sp").get_local_rank() if dims.sp_enabled else 0
    cu = batch[B.CU_SEQLENS]
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    batch, labels = shard_sequence(batch, labels, sp_rank, dims.sp)
    labels = labels.to(device)
    count = all_reduce((labels != B.IGNORE_INDEX).sum(), dims.get_optional_mesh("loss"))
    meta = AttentionMeta(cu.to(device), max_seqlen, batch[B.POSITION_IDS].to(device))
    out = model(batch[B.INPUT].to(device), meta, labels)
    loss, _ = loss_fn(out.losses, {"text": count}, {}, 1)
    loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_config(args, world: int, sp: int, mode: str, device) -> dict:
    dims = OmniParallelDims(
        dp_shard=-1, dp_replicate=1, cp=sp, tp=1, pp=1, ep=1, etp=1, world_size=world
    )
    dims.build_mesh()
    model = build(args, dims, job_config(args, sp, mode), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    loss_fn = OmniLoss()
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    sync = (lambda: None) if is_cpu() else torch.cuda.synchronize
    if not is_cpu():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        batch, labels = packed_batch(args, seed=1000 * i + dp_rank)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        step(model, dims, batch, labels, device, loss_fn, opt)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    # every rank's step time; the slowest bounds the step
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    tokens_per_step = dims.dp_shard * args.seq_len  # each SP group trains one sequence
    mem = 0.0 if is_cpu() else torch.cuda.max_memory_allocated() / 2**30
    # the head groups the async runner resolved when it was installed
    runner = next((m.runner for m in model.modules()
                   if isinstance(getattr(m, "runner", None), AsyncUlyssesRunner)), None)
    if runner is not None:
        groups = runner.head_chunks
        mode = f"async, {groups} head group{'s' if groups > 1 else ''}"
    del model, opt
    if not is_cpu():
        torch.cuda.empty_cache()
    return {"sp": sp, "mode": mode if sp > 1 else "-",
            "step_s": float(t), "tok_s_gpu": tokens_per_step / float(t) / world, "mem_gib": mem}


def table(args, world: int, rows: list[dict], device_name: str, priority: str) -> str:
    base = next((r["tok_s_gpu"] for r in rows if r["sp"] == 1), None)
    lines = [
        f"Llama-shaped dim={args.dim} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"ffn={args.ffn} vocab={args.vocab}, seq_len={args.seq_len}, AC={args.ac}, "
        f"{world} x {device_name}, median of {args.steps} steps after {args.warmup}, "
        f"{NCCL_HIGH_PRIORITY_ENV}={priority}",
        "",
        "| SP | Ulysses | step (s) | tokens/s/GPU | vs SP1 | peak mem (GiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rel = f"{r['tok_s_gpu'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['sp']} | {r['mode']} | {r['step_s']:.3f} | {r['tok_s_gpu']:,.0f} | "
                     f"{rel} | {r['mem_gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    backend = "gloo" if is_cpu() else "nccl"
    device = local_device()
    if not is_cpu():
        torch.cuda.set_device(device)
    modes = [m.strip() for m in args.modes.split(",")]
    priority = os.environ.get(NCCL_HIGH_PRIORITY_ENV, "unset")
    if any(head_groups(m) is not None for m in modes):
        # as the trainer does for async Ulysses; one process group for every row, so the sync
        # rows run with the same streams
        priority = prefer_high_priority_exchanges()
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    degrees = [int(s) for s in args.sp.split(",")] if args.sp else \
        [d for d in (1, 2, 4, 8) if world % d == 0 and args.heads % d == 0]
    rows = []
    for sp in degrees:
        for mode in (modes if sp > 1 else ["sync"]):
            try:
                rows.append(run_config(args, world, sp, mode, device))
            except torch.OutOfMemoryError:
                rows.append({"sp": sp, "mode": mode, "step_s": float("nan"),
                             "tok_s_gpu": float("nan"), "mem_gib": float("nan")})
                torch.cuda.empty_cache()
            if rank == 0:
                r = rows[-1]
                print(f"SP{sp} {r['mode']}: {r['tok_s_gpu']:,.0f} tokens/s/GPU, "
                      f"{r['step_s']:.3f} s/step, {r['mem_gib']:.1f} GiB", flush=True)
    name = "CPU (gloo)" if is_cpu() else torch.cuda.get_device_name(device)
    if rank == 0:
        text = table(args, world, rows, name, priority)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
