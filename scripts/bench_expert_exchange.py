"""The expert-parallel token exchange alone: NCCL with host-read split sizes against torch's
NVSHMEM all-to-all-v with split sizes on the device (``parallelism.expert_exchange``).

At one MoE layer's shape (``--tokens`` per rank, ``--top-k``, ``--experts``, ``--dim``; the
default is Qwen3-30B-A3B at 8K) every rank routes its tokens with a skewed random router,
sorts the copies by expert and exchanges them both ways: ``dispatch`` (to the experts' ranks,
grouped by local expert) and ``combine`` (back). It checks that the device-split exchange
gives the exact dispatcher's rows (bit for bit) and that combine(dispatch(x)) == x, that
forward and backward through grouped-GEMM experts match the exact dispatcher's with the
unspecified buffer rows poisoned with NaN, then times
``--iters`` round trips of each, and how long the host takes to launch them (no host read
means the host runs ahead of the GPU). GPU only; run with torchrun on 2 or more GPUs::

    torchrun --nproc_per_node 2 scripts/bench_expert_exchange.py --out $OUT/exchange.md
"""

from __future__ import annotations

import argparse
import time

import torchtitan_omni  # noqa: F401  (device selection before TorchTitan loads)
import torch
import torch.distributed as dist

from torchtitan_omni.compat import grouped_mm
from torchtitan_omni.distributed.expert_parallel import ExpertParallelDispatcher
from torchtitan_omni.modules.moe import sort_by_expert


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--skew", type=float, default=1.0,
                   help="router logits' scale: 0 is uniform, larger is more imbalanced")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    return p.parse_args()


def routed_copies(args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted token copies ``[tokens * top_k, dim]`` and copies per expert, per rank."""
    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    logits = torch.randn(args.tokens, args.experts, device=device, generator=gen) * args.skew
    indices = logits.topk(args.top_k, dim=-1).indices
    order, counts = sort_by_expert(indices, args.experts)
    x = torch.randn(args.tokens * args.top_k, args.dim, device=device, dtype=torch.bfloat16,
                    generator=gen)
    return x, counts


def experts_forward(grouped: torch.Tensor, local_counts: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """A SwiGLU-less expert MLP (``silu(x w1^T) w2^T``) by grouped GEMM; rows past the
    groups' end are left out of every group."""
    offsets = torch.cumsum(local_counts, 0).to(torch.int32)
    h = torch.nn.functional.silu(grouped_mm(grouped, w1.transpose(-2, -1), offsets))
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


def gradient_check(exact, device_split, x, counts, args) -> str:
    """Forward and backward through experts: the device-split exchange (its buffers filled
    with NaN first, so unspecified rows are as bad as they can be) against the exact one."""
    local = args.experts // dist.get_world_size()
    gen = torch.Generator(device=x.device).manual_seed(7)
    w1 = (torch.randn(local, 768, args.dim, device=x.device, generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(local, args.dim, 768, device=x.device, generator=gen) * 0.02).bfloat16()
    probe = torch.randn(x.shape, device=x.device, generator=gen).bfloat16()
    results = []
    for which in ("exact", "device"):
        xi = x.clone().requires_grad_(True)
        a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        dispatcher = exact if which == "exact" else device_split
        if which == "device":
            device_split.row_exchange(x).poison_received()
        grouped, local_counts, state = dispatcher.dispatch(xi, counts)
        out = dispatcher.combine(experts_forward(grouped, local_counts, a, b), state)
        (out.float() * probe.float()).sum().backward()
        results.append((out.detach(), xi.grad, a.grad, b.grad))
    names = ("out", "grad x", "grad w1", "grad w2")
    diffs = []
    for name, ref, got in zip(names, *results):
        finite = bool(torch.isfinite(got).all())
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
        diffs.append(f"{name} {'finite' if finite else 'NOT FINITE'} rel {err.item():.1e}")
    return ", ".join(diffs)


def timed(fn, iters: int) -> tuple[float, float]:
    """(GPU ms per call, host ms per call to launch it)."""
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    x, counts = routed_copies(args, device)

    exact = ExpertParallelDispatcher(group, args.experts)

    def exact_round_trip():
        grouped, _, state = exact.dispatch(x, counts)
        return exact.combine(grouped, state)

    rows = []
    grouped_ref, local_counts, state = exact.dispatch(x, counts)
    back = exact.combine(grouped_ref, state)
    assert torch.equal(back, x), "exact round trip changed rows"
    ms, host = timed(exact_round_trip, args.iters)
    rows.append(("NCCL, split sizes read on the host (exact)", ms, host, "reference"))

    from torchtitan_omni.distributed.expert_device_splits import (
        DeviceSplitExpertParallelDispatcher, nvshmem_usable,
    )
    usable, why = nvshmem_usable()
    if not usable:
        rows.append(("NVSHMEM all_to_all_vdev", float("nan"), float("nan"), why))
    else:
        device_split = DeviceSplitExpertParallelDispatcher(group, args.experts, x.shape[0])
        grouped, local, state = device_split.dispatch(x, counts)
        used = int(local.sum())
        same_rows = torch.equal(grouped[:used], grouped_ref)
        same_counts = torch.equal(local, local_counts)
        back = device_split.combine(grouped, state)
        same_back = torch.equal(back, x)
        check = f"rows {same_rows}, counts {same_counts}, round trip {same_back}"
        check += "; " + gradient_check(exact, device_split, x, counts, args)

        def device_round_trip():
            g, _, st = device_split.dispatch(x, counts)
            return device_split.combine(g, st)

        ms, host = timed(device_round_trip, args.iters)
        rows.append(("NVSHMEM all_to_all_vdev (device split sizes)", ms, host, check))

    if rank == 0:
        moved = x.numel() * x.element_size() / 2**20
        lines = [
            f"{world} ranks, {args.tokens} tokens x top {args.top_k} per rank, {args.experts} "
            f"experts, dim {args.dim}, skew {args.skew}: {moved:.0f} MiB of copies per rank "
            f"each way; {args.iters} dispatch + combine round trips",
            "",
            "| exchange | GPU ms per round trip | host ms to launch one | check |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {name} | {ms:.2f} | {host:.2f} | {check} |"
                  for name, ms, host, check in rows]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
