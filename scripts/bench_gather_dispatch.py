"""One expert-parallel rank's work in the gather expert dispatch, between its exchanges: the
passes over its worst-case buffer with ``modules.local_copies``' row maps over the used rows
only, against the same maps over every row with the rows past the used ones masked (what the
dispatch did before), at one MoE layer's shape, forward and backward, compiled as the trainer
compiles the MoE block.

The buffer holds ``ranks x tokens x top_k`` rows, of which this rank's experts use
``1 / ranks`` on average, so the gap grows with the expert-parallel degree; no communication
runs (the gathered tokens are made on this GPU), so one GPU times an EP4 or EP8 rank's work:

    python3 scripts/bench_gather_dispatch.py                  # GPU: EP2, EP4, EP8 at 8K tokens
    python3 scripts/bench_gather_dispatch.py --smoke          # CPU check of the script

Prints one markdown row per degree: the rows used, the forward and the forward + backward in
ms for each implementation (the median device time of ``--iters`` timed iterations,
``bench_attention.time_passes``), the ratio, and the largest relative difference of the output
and gradients between the two.

At degree 1 (``--degree 1``: no expert parallelism, every row used) a third implementation
runs too, the MoE layer's own local dispatch (``modules.moe``'s ``sort_by_expert``,
``gather_sorted`` and ``combine``, what a run without expert parallelism computes: the same
row maps, with the experts' SwiGLU left to the compiler), and a line under the table gives its
times and the used-rows path's ratio to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts
from bench_attention import cuda_unless_smoke, time_passes  # the benchmarks' one timer


def _inputs(degree, tokens, dim, experts, top_k, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = degree * tokens
    # top-k distinct experts per token from the router's scores, as the MoE layer picks them
    scores = torch.rand(rows, experts, generator=g)
    weights, ids = scores.topk(top_k, dim=-1)
    x = torch.randn(rows, dim, generator=g) * 0.5
    upstream = torch.randn(rows, dim, generator=g)
    return (x.to(device, dtype), (weights / weights.sum(-1, keepdim=True)).to(device, dtype),
            ids.to(device), upstream.to(device, dtype))


def _top_kernels(fn, device: torch.device, top: int = 12) -> str:
    # one forward + backward under torch's profiler: the kernels by device time
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        fn()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run(degree: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Both implementations at one degree: times and the largest relative difference."""
    from torchtitan_omni.distributed.comm import GroupShape
    from torchtitan_omni.distributed.expert_gather import GatherExpertParallelDispatcher
    from torchtitan_omni.modules.init import init_context
    from torchtitan_omni.modules.moe import (
        GroupedExperts, combine, gather_sorted, sort_by_expert, sorted_inverse,
    )

    local = args.experts // degree
    module = GroupedExperts(args.dim, args.hidden, local)
    with init_context(module, seed=0):
        module.init_weights(0.02)
    module = module.to(device, dtype)
    x, w, ids, upstream = _inputs(degree, args.tokens, args.dim, args.experts, args.top_k,
                                  dtype, device, seed=degree)
    row = {"degree": degree, "buffer": degree * args.tokens * args.top_k,
           "used": int(((ids >= 0) & (ids < local)).sum())}
    results = {}

    def local_dispatch(experts, x_all, w_all, ids):
        # the MoE layer's path without expert parallelism (modules.moe.MoE.forward's)
        order, counts = sort_by_expert(ids, args.experts)
        inverse = sorted_inverse(order)
        y = experts(gather_sorted(x_all, order, args.top_k, inverse), counts)
        return combine(y, order, w_all, inverse)

    implementations = {
        name: GatherExpertParallelDispatcher(GroupShape(degree, 0), args.experts, args.tokens,
                                             kernels=kernels).run_local
        for name, kernels in (("every", False), ("used", True))}
    if degree == 1:
        implementations["local"] = local_dispatch
    for name, local_work in implementations.items():
        torch.compiler.reset()  # each (degree, implementation) compiles afresh
        if not args.no_compile:
            local_work = torch.compile(local_work, fullgraph=True)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()

        def forward(work=local_work, xi=xi, wi=wi):
            with torch.no_grad():
                return work(module, xi, wi, ids)

        def both(work=local_work, xi=xi, wi=wi):
            module.zero_grad(set_to_none=True)
            xi.grad = wi.grad = None
            out = work(module, xi, wi, ids)
            out.backward(upstream)
            return out

        cuda = device.type == "cuda"
        row[f"{name} fwd"] = time_passes(forward, args.iters, args.warmup, cuda)[0]
        row[f"{name} fwd+bwd"] = time_passes(both, args.iters, args.warmup, cuda)[0]
        if args.profile:
            row[f"{name} kernels"] = _top_kernels(both, device)
        out = both()
        results[name] = [out.detach(), xi.grad, wi.grad, module.w1.grad, module.w2.grad]
    row["ratio"] = row["every fwd+bwd"] / row["used fwd+bwd"]
    row["max rel diff"] = max(_rel(a, b) for a, b in zip(results["used"], results["every"]))
    if "local" in results:
        row["local ratio"] = row["local fwd+bwd"] / row["used fwd+bwd"]
        row["local max rel diff"] = max(_rel(a, b) for a, b in zip(results["used"],
                                                                   results["local"]))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degree", type=int, action="append",
                        help="expert-parallel degrees (repeatable; default 2, 4, 8)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=768, help="each expert's hidden size")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager (default: compiled)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each implementation's top kernels (one fwd + bwd)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: small shapes, float32, eager")
    args = parser.parse_args(argv)
    if cuda_unless_smoke("bench_gather_dispatch", args.smoke):
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        args.tokens, args.dim, args.hidden, args.experts, args.top_k = 16, 16, 8, 8, 2
        args.no_compile = True
    rows = [run(d, args, device, dtype) for d in (args.degree or [2, 4, 8])]
    print(f"One rank's gather-dispatch work, {args.tokens} tokens a rank, D {args.dim}, "
          f"H {args.hidden}, {args.experts} experts, top {args.top_k}, {dtype}, "
          f"{'eager' if args.no_compile else 'compiled'}; ms, median of {args.iters}\n")
    print("| EP | buffer rows | used | every row fwd | used rows fwd | every row fwd+bwd "
          "| used rows fwd+bwd "
          "| ratio | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['degree']} | {r['buffer']:,} | {r['used']:,} | {r['every fwd']:.2f} | "
              f"{r['used fwd']:.2f} | {r['every fwd+bwd']:.2f} | {r['used fwd+bwd']:.2f} "
              f"| {r['ratio']:.2f}x | {r['max rel diff']:.1e} |")
    for r in rows:
        if "local ratio" in r:
            print(f"\nEP{r['degree']}, the MoE layer's local dispatch: fwd "
                  f"{r['local fwd']:.2f} ms, fwd+bwd {r['local fwd+bwd']:.2f} ms; the used-rows "
                  f"path {r['local ratio']:.2f}x its speed (max rel diff "
                  f"{r['local max rel diff']:.1e})")
    for r in rows if args.profile else []:
        for name in ("every", "used") + (("local",) if "local ratio" in r else ()):
            print(f"\nEP{r['degree']}, {name}: top kernels of one forward + backward\n")
            print(r[f"{name} kernels"])
    return rows


if __name__ == "__main__":
    main()
