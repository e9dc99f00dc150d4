"""What CUDA graphs would save on the vision tower: eager against graphed forward + backward.

The toy rows' vision calls are launch-bound (docs/performance.md: 666 kernels for 4.6 ms of GPU
work in the forward, 1,181 in the backward). A CUDA graph replays a whole pass with one launch.
Before graphing the encoders inside the trainer (their FSDP-gathered parameters move between
steps, so that needs static copies), this prices the win on one GPU with the tower's
parameters resident: Qwen2-VL-7B's vision tower (675M parameters, bf16), patch embedding,
32 blocks and merger, on

- the toy rows' items (7 images and one 2-frame clip of 16 patches each: 144 patches), and
- realistic items (12 images of 1,024 patches), where the kernels are long and graphs should
  not matter.

The graphed tower comes from ``torch.cuda.make_graphed_callables`` (forward and backward
captured for one input shape). Its output and parameter gradients are checked against the
eager tower's before timing. Prints, per case: GPU ms and host ms (to issue forward +
backward) eager and graphed.

    python3 scripts/bench_encoder_graphs.py            # one GPU
    python3 scripts/bench_encoder_graphs.py --smoke    # CPU: the eager path on a tiny tower
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn as nn

from torchtitan_omni.encoders.blocks import packed_meta
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder, merge_window_positions
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.protocols.modules import AttentionMeta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling scripts
from bench_attention import cuda_unless_smoke, time_passes  # the benchmarks' one timer

#: (name, grid_thw rows) of each case
CASES = {
    "toy: 7 images + 1 clip, 16 patches each": [[1, 4, 4]] * 7 + [[2, 4, 4]],
    "realistic: 12 images of 1,024 patches": [[1, 32, 32]] * 12,
}
SMOKE_CASES = {"smoke: 3 items": [[1, 2, 2], [1, 2, 4], [2, 2, 2]]}


class GraphableTower(nn.Module):
    """The vision tower's patch embedding, blocks and merger as a function of tensors only
    (what ``make_graphed_callables`` takes): the attention metadata that the encoder builds on
    the host is passed in as its tensors, with ``max_seqlen`` fixed per instance."""

    def __init__(self, encoder: VisionEncoder, max_seqlen: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.max_seqlen = max_seqlen

    def forward(self, patches: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=self.max_seqlen,
                             position_ids=cu_seqlens, causal=False, rope_tables=(cos, sin))
        enc = self.encoder
        return enc.merger(enc.blocks(enc.patch_embed(patches), meta))


def tower_inputs(encoder: VisionEncoder, grid: list[list[int]], device: torch.device,
                 generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], int]:
    """(patches, cu_seqlens, cos, sin) of random patches laid out as ``grid``, and the
    longest attention segment, built as ``VisionEncoder.lm_encode`` builds them."""
    n = sum(t * h * w for t, h, w in grid)
    patches = torch.randn(n, encoder.args.patch_dim, device=device, generator=generator)
    positions = merge_window_positions(grid, encoder.args.merge_size, device)
    segments = [h * w for t, h, w in grid for _ in range(t)]
    meta = packed_meta(segments, device, positions, encoder.rope.tables(positions))
    cos, sin = meta.rope_tables
    return (patches, meta.cu_seqlens, cos, sin), meta.max_seqlen


def forward_backward(fn: Callable, inputs: tuple, grad: torch.Tensor,
                     params: list[nn.Parameter]) -> Callable[[], None]:
    """One training pass of ``fn`` on ``inputs`` (gradients of ``params`` cleared first)."""
    def step() -> None:
        for p in params:
            p.grad = None
        fn(*inputs).backward(grad)
    return step


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_case(name: str, grid: list[list[int]], args: VisionArgs, device: torch.device,
             dtype: torch.dtype, iters: int, warmup: int) -> list[dict]:
    torch.manual_seed(0)
    encoder = VisionEncoder(args, llm_dim=args.dim)
    with init_context(encoder, seed=0):
        encoder.init_weights()
    encoder.to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    inputs, max_seqlen = tower_inputs(encoder, grid, device, gen)
    inputs = (inputs[0].to(dtype), *inputs[1:])
    tower = GraphableTower(encoder, max_seqlen)
    params = [p for p in tower.parameters() if p.requires_grad]
    # the wrapper computes what the encoder's own entry point computes
    media = {"patches": inputs[0], "grid_thw": torch.tensor(grid)}
    with torch.no_grad():
        out = tower(*inputs)
        via_encoder = encoder.lm_encode(media, "image")
    grad = torch.randn(out.shape, device=device, dtype=dtype, generator=gen)
    cuda = device.type == "cuda"
    rows = [{"case": name, "mode": "eager", "patches": inputs[0].shape[0],
             "vs_lm_encode": relative_difference(out.detach(), via_encoder)}]
    rows[0]["gpu_ms"], rows[0]["host_ms"] = time_passes(
        forward_backward(tower, inputs, grad, params), iters, warmup, cuda)
    if not cuda:
        return rows
    # the reference: eager output and gradients
    for p in params:
        p.grad = None
    ref_out = tower(*inputs)
    ref_out.backward(grad)
    # no autograd graph may outlive its pass: capture fails on an accumulate-grad node left
    # from an eager pass on the default stream (cudaErrorStreamCaptureImplicit, 2026-11-27)
    ref_out = ref_out.detach()
    ref_grads = [p.grad.clone() for p in params]
    # the noise floor of the graphed pass's check: a second eager pass (bf16 gradients whose
    # kernels accumulate in a varying order, e.g. the attention backward's dq)
    for p in params:
        p.grad = None
    tower(*inputs).backward(grad)
    rows[0]["grad_diff"] = max(relative_difference(p.grad, g) for p, g in zip(params, ref_grads))
    graphed = torch.cuda.make_graphed_callables(tower, inputs)
    for p in params:
        p.grad = None
    got = graphed(*inputs)
    got.backward(grad)
    got = got.detach()
    row = {"case": name, "mode": "CUDA graph", "patches": inputs[0].shape[0],
           "out_diff": relative_difference(got, ref_out),
           "grad_diff": max(relative_difference(p.grad, g) for p, g in zip(params, ref_grads))}
    row["gpu_ms"], row["host_ms"] = time_passes(
        forward_backward(graphed, inputs, grad, params), iters, warmup, cuda)
    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny tower on CPU (eager only)")
    args = p.parse_args(argv)
    cuda = cuda_unless_smoke("bench_encoder_graphs", args.smoke)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tower_args = VisionArgs() if cuda else VisionArgs.debug()
    rows = []
    for name, grid in (CASES if cuda else SMOKE_CASES).items():
        rows.extend(run_case(name, grid, tower_args, device, dtype, args.iters, args.warmup))
    print("| case | patches | mode | GPU ms (fwd+bwd) | host ms | check |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "out_diff" in r:
            check = f"output / gradients vs eager {r['out_diff']:.1e} / {r['grad_diff']:.1e}"
        else:
            check = f"output vs lm_encode {r['vs_lm_encode']:.1e}"
            if "grad_diff" in r:
                check += f"; gradients vs a second eager pass {r['grad_diff']:.1e}"
        print(f"| {r['case']} | {r['patches']:,} | {r['mode']} | {r['gpu_ms']:.2f} | "
              f"{r['host_ms']:.2f} | {check} |")
    return rows


if __name__ == "__main__":
    main()
