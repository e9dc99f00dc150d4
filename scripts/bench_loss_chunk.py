"""One chunk of the text head's chunked cross-entropy (``modules.linear_cross_entropy``): its
loss and logit gradient from the chunk's logits, stored into the group's buffer of logit
gradients, as a compiled loss runs it now (``fusable_loss_and_logit_grad`` compiled, writing
the buffer itself) against how it ran before (the eager form compiled, its gradient then copied
into the buffer), at a chunk of a 152K vocabulary:

    python3 scripts/bench_loss_chunk.py                 # GPU: Qwen3's vocabulary, bf16
    python3 scripts/bench_loss_chunk.py --smoke         # CPU check of the script

Prints one markdown row per implementation: the median device time of ``--iters`` passes
(``bench_attention.time_passes``), the kernels one pass launches, the bandwidth against the
bytes an ideal pass moves (the logits read twice, for the log-sum-exp and for the gradient,
and the gradient written once), and the largest difference of its gradient and the relative
difference of its loss from the eager kernel's (a compiled log-sum-exp may sum in another
order).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts
from bench_attention import cuda_unless_smoke, time_passes  # the benchmarks' one timer

from torchtitan_omni.modules.linear_cross_entropy import (
    chunk_rows,
    fusable_loss_and_logit_grad,
    loss_and_logit_grad,
)


def _kernels_per_pass(step, cuda: bool) -> int:
    # device kernels (and copies) one pass launches, counted by the profiler
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith(("aten::", "Torch-Compiled")))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=0, help="rows of the chunk (0: chunk_rows)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a small chunk on the CPU")
    args = p.parse_args(argv)
    cuda = cuda_unless_smoke("bench_loss_chunk", args.smoke)
    vocab = 97 if args.smoke else args.vocab
    rows = 13 if args.smoke else (args.rows or chunk_rows(vocab))
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    buffer = torch.empty((2 * rows, vocab), device=device, dtype=dtype)
    out = buffer[rows:]
    ref_loss, ref_grad = loss_and_logit_grad(logits, targets)

    before = torch.compile(loss_and_logit_grad)
    now = torch.compile(fusable_loss_and_logit_grad)

    def copied_after():
        loss, grad = before(logits, targets)
        out.copy_(grad)
        return loss

    def written():
        return now(logits, targets, out)[0]

    ideal_bytes = 3 * rows * vocab * logits.element_size()
    results = []
    for name, step in (("eager form compiled, then copied (before)", copied_after),
                       ("fusable form compiled, into the buffer (now)", written)):
        out.fill_(float("nan"))
        loss = step()
        grad_diff = float((out.float() - ref_grad.float()).abs().max())
        loss_diff = float((loss - ref_loss).abs() / ref_loss.abs())
        device_ms, _ = time_passes(step, args.iters, args.warmup, cuda)
        results.append({"name": name, "ms": device_ms, "kernels": _kernels_per_pass(step, cuda),
                        "gbps": ideal_bytes / device_ms / 1e6, "grad diff": grad_diff,
                        "loss rel diff": loss_diff})
    print(f"One chunk: {rows} rows x {vocab} vocabulary, {dtype}, {device}; median of "
          f"{args.iters} passes\n")
    print("| implementation | ms | kernels | GB/s (ideal bytes) | max gradient diff "
          "| loss rel diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['name']} | {r['ms']:.3f} | {r['kernels']} | {r['gbps']:,.0f} | "
              f"{r['grad diff']:.2e} | {r['loss rel diff']:.1e} |")
    return results


if __name__ == "__main__":
    main()
