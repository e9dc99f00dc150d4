"""The optimizer step's cost at one GPU's share of a model: the part of a training step that
grows with parameters, not with tokens.

A MoE step at 8K tokens per GPU holds a part that does not grow with tokens (issue 12: 0.20 s
of 0.42 s at EP2, 0.12 s of 0.43 s at EP4 on the 30B-A3B 12-layer cut). Much of it is work
per parameter, and the largest such work is the optimizer: TorchTitan's fused AdamW over the
rank's fp32 shard, and gradient clipping (a norm over every gradient, then a scale). This
times both on one GPU for the shard a rank holds (each parameter split over ``--world`` ranks:
under expert parallel with FSDP every parameter, expert or dense, is split over all ranks),
with the model's own parameter shapes (its meta-device build), so the share of the step they
take is measured rather than guessed:

    python3 scripts/bench_optimizer.py --world 2 --world 4     # GPU
    python3 scripts/bench_optimizer.py --smoke                 # CPU check of the script

Prints one markdown row per world size: parameters per rank, the fused AdamW step, the
clipping norm, the clipping scale, clipping as TorchTitan runs it (both), AdamW and clipping
together, AdamW with the clipping scale inside its kernel (``grad_scale``, the hook torch's
fused AdamW has for it), the trainer's optimizer (``LocalShardAdamW``, the scale inside its
step) as it is, with ``compile.components`` holding "optimizer" (the large tensors' update
compiled; the share of elements it covers) and with that update's moments in bf16
(``optimizer.moments_dtype``), each also as GPU time with the host ahead of the
GPU (in brackets: how a training step runs it, its launches queued behind the backward), and
the memory bandwidth each reached (bytes
an ideal kernel moves: AdamW reads parameter, gradient and both moments and writes three back,
28 bytes per parameter; the norm reads the gradient; the scale reads and writes it).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts
from bench_attention import cuda_unless_smoke  # the benchmarks' GPU check

#: bytes an ideal kernel moves per fp32 parameter: AdamW (read p, g, m, v; write p, m, v),
#: the clipping norm (read g) and the clipping scale (read and write g)
ADAMW_BYTES, NORM_BYTES, SCALE_BYTES = 28, 4, 8


def shard_numels(spec_name: str, flavor: str, llm_layers: int, world: int) -> list[int]:
    """Each parameter's element count on one of ``world`` ranks (the model built on the meta
    device, its foundation cut to ``llm_layers`` blocks; 0 keeps the flavor's)."""
    import scripts.omni_flavors  # noqa: F401  (the omni specs and the benchmark flavors)
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan_omni.protocols.model import apply_llm_layers

    spec = get_train_spec(spec_name)
    args = copy.deepcopy(spec.model_args[flavor])
    problem = apply_llm_layers(args.llm_args, llm_layers)
    if problem:
        raise SystemExit(f"bench_optimizer: --llm-layers {llm_layers}: {problem}")
    with torch.device("meta"):
        model = spec.model_cls(args)
    return [-(-p.numel() // world) for p in model.parameters() if p.requires_grad]


def _timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def _gpu_timed(fn, device: torch.device, iters: int, lead_ms: float = 150.0) -> float:
    """Median milliseconds of the GPU's work in ``fn`` with the host ahead of it, as in a
    training step, where the optimizer's launches queue behind the backward: matmuls keep the
    GPU busy for about ``lead_ms`` while the host queues ``fn``, and CUDA events time what
    follows them. On CPU, :func:`_timed`."""
    if device.type != "cuda":
        return _timed(fn, device, iters)
    busy = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    busy @ busy
    end.record()
    torch.cuda.synchronize()
    matmuls = max(1, int(lead_ms / max(start.elapsed_time(end), 1e-3)))
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        for _ in range(matmuls):
            busy @ busy
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(numels: list[int], device: torch.device, iters: int, max_norm: float = 1.0) -> dict:
    """Time TorchTitan's optimizer setting (AdamW, fused, the MoE configs' hyper-parameters)
    and gradient clipping over parameters of these sizes."""
    params = [torch.zeros(n, device=device, requires_grad=True) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    grads = [p.grad for p in params]
    # clipping's two halves, as torch.nn.utils.clip_grad_norm_ runs them
    norm_ms = _timed(lambda: torch.nn.utils.get_total_norm(grads, foreach=True), device, iters)
    over = torch.tensor(1.001 * max_norm, device=device)  # a norm that makes it scale
    scale_ms = _timed(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, over,
                                                                   foreach=True), device, iters)
    clip_ms = _timed(lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True),
                     device, iters)
    adamw_ms = _timed(opt.step, device, iters)
    # the clipping scale inside the fused kernel: torch's fused AdamW divides each gradient by
    # the optimizer's ``grad_scale`` (the hook GradScaler uses), so clipping would need only
    # its norm; same kernel launches, one read less of every gradient
    opt.grad_scale = torch.tensor(1.001, device=device)
    scaled_ms = _timed(opt.step, device, iters)
    del opt.grad_scale
    del opt
    # the trainer's optimizer, the clipping coefficient inside its step: torch's fused kernel
    # for every tensor, then with ``compile.components`` holding "optimizer" (the large
    # tensors' update compiled, one kernel each)
    from torchtitan_omni.components.optimizer import LocalShardAdamW

    ours = LocalShardAdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                           fused=True)
    coef = torch.tensor(1 / 1.001, device=device)

    def trainer_step() -> None:
        ours.scale_grads_in_next_step(coef)
        ours.step()

    trainer_ms = _timed(trainer_step, device, iters)
    trainer_gpu_ms = _gpu_timed(trainer_step, device, iters)
    ours.compile_updates()
    compiled_ms = _timed(trainer_step, device, iters)
    compiled_gpu_ms = _gpu_timed(trainer_step, device, iters)
    compiled_share = ours.compiled_numel
    ours.state.clear()  # its moments' memory, for the next optimizer's
    # the same with the compiled update's moments in bf16 (``optimizer.moments_dtype``)
    low = LocalShardAdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          fused=True)
    low.compile_updates()
    low.keep_moments_in(torch.bfloat16)

    def low_step() -> None:
        low.scale_grads_in_next_step(coef)
        low.step()

    bf16_moments_ms = _timed(low_step, device, iters)
    bf16_moments_gpu_ms = _gpu_timed(low_step, device, iters)
    total = sum(numels)

    def gbps(nbytes: int, ms: float) -> float:
        return nbytes * total / ms / 1e6

    return {"params": total, "adamw_ms": adamw_ms, "scaled_ms": scaled_ms,
            "trainer_ms": trainer_ms, "compiled_ms": compiled_ms,
            "trainer_gpu_ms": trainer_gpu_ms, "compiled_gpu_ms": compiled_gpu_ms,
            "compiled_share": compiled_share / total, "bf16_moments_ms": bf16_moments_ms,
            "bf16_moments_gpu_ms": bf16_moments_gpu_ms,
            "norm_ms": norm_ms,
            "scale_ms": scale_ms, "clip_ms": clip_ms, "adamw_gbps": gbps(ADAMW_BYTES, adamw_ms),
            "norm_gbps": gbps(NORM_BYTES, norm_ms), "scale_gbps": gbps(SCALE_BYTES, scale_ms)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="qwen3_moe_omni")
    parser.add_argument("--flavor", default="30B-A3B")
    parser.add_argument("--llm-layers", type=int, default=12)
    parser.add_argument("--world", type=int, action="append",
                        help="ranks each parameter is split over (repeatable; default 2)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: the debug flavor, 2 foundation layers")
    args = parser.parse_args(argv)
    worlds = args.world or [2]
    if cuda_unless_smoke("bench_optimizer", args.smoke):
        device = torch.device("cuda")
    else:
        device, args.flavor, args.llm_layers, args.iters = torch.device("cpu"), "debugmodel", 2, 2
    print(f"{args.spec} {args.flavor}, {args.llm_layers or 'all'} foundation layers, fp32 "
          f"parameters and moments, AdamW fused (lr 1e-5, betas 0.9/0.95, weight decay 0.1), "
          f"clipping at max_norm 1.0 (foreach); median of {args.iters} runs, ms and GB/s\n")
    print("| ranks | parameters per rank | AdamW step | clip norm | clip scale | clip (both) | "
          "AdamW + clip | AdamW, scale inside | trainer's AdamW, scale inside (GPU, host "
          "ahead) | the same, update compiled (GPU, host ahead; share) | the same, its "
          "moments in bf16 (GPU) | AdamW GB/s | norm GB/s | scale GB/s |")
    print("| --- " * 14 + "|")
    for world in worlds:
        r = measure(shard_numels(args.spec, args.flavor, args.llm_layers, world), device,
                    args.iters)
        print(f"| {world} | {r['params'] / 1e6:,.1f}M | {r['adamw_ms']:.1f} | {r['norm_ms']:.1f} | "
              f"{r['scale_ms']:.1f} | {r['clip_ms']:.1f} | {r['adamw_ms'] + r['clip_ms']:.1f} | "
              f"{r['scaled_ms']:.1f} | {r['trainer_ms']:.1f} ({r['trainer_gpu_ms']:.1f}) | "
              f"{r['compiled_ms']:.1f} ({r['compiled_gpu_ms']:.1f}; {r['compiled_share']:.0%}) | "
              f"{r['bf16_moments_ms']:.1f} ({r['bf16_moments_gpu_ms']:.1f}) | "
              f"{r['adamw_gbps']:,.0f} | {r['norm_gbps']:,.0f} | {r['scale_gbps']:,.0f} |",
              flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
