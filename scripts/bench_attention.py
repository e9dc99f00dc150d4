"""Which attention kernel to use for packed (document-masked) sequences: a GPU measurement.

For the LLM (causal, GQA) and the vision tower (bidirectional, items of their own), on the
layouts training produces, it times forward + backward of every candidate torch offers and
checks each against a float32 per-document reference:

- ``varlen_fa2``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2, one launch for
  all documents), what ``torchtitan_omni.modules.attention`` ran for packed documents until
  2026-11-27;
- ``varlen_aten``: the same kernels through ``aten._flash_attention_forward`` / ``_backward``
  behind one operator with its own backward, without ``varlen_attn``'s two custom-op layers:
  what ``torchtitan_omni.modules.attention.varlen_attention`` runs on CUDA now (its
  ``flash_varlen``, called here; its host cost per call is what the launch-bound encoders pay
  32 times a pass: the "host ms" column);
- ``sdpa_cudnn`` / ``sdpa_flash`` / ``sdpa_efficient``: ``scaled_dot_product_attention`` over
  whole rows with one backend (exact only when a row is one document, or for equal-length
  items batched together), k/v repeated to the query heads;
- ``sdpa_cudnn_kv_heads``: the same cuDNN call with k/v keeping their own (grouped) heads;
- ``cudnn_ragged``: cuDNN's ragged (cu_seqlens) attention through ``aten._cudnn_attention_*``;
- ``per_doc_cudnn``: one cuDNN SDPA call per document;
- ``flex_doc``: FlexAttention (compiled) with a document block mask;
- ``sdpa_grouped``: items of equal length stacked into one SDPA batch per length (encoders).

    python3 scripts/bench_attention.py --out attention.json

Prints a table (median ms of forward + backward on the GPU, median host ms to issue them,
TFLOP/s of the useful attention work, max relative error) and writes JSON. Needs CUDA; on CPU
it only checks its own plumbing (``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------- layouts
def layouts(smoke: bool) -> list[dict]:
    """The (name, shape, document lengths) cases that training produces."""
    rng = random.Random(0)

    def packed(total: int, lo: int, hi: int) -> list[int]:
        out = []
        while sum(out) < total:
            out.append(min(rng.randint(lo, hi), total - sum(out)))
        return out

    if smoke:
        return [
            dict(name="llm single doc", hq=4, hkv=2, d=16, causal=True, docs=[120, 8]),
            dict(name="llm packed", hq=4, hkv=2, d=16, causal=True, docs=[30, 50, 48]),
            dict(name="vision items", hq=4, hkv=4, d=16, causal=False, docs=[16, 16, 32]),
        ]
    llm = dict(hq=32, hkv=8, d=128, causal=True)
    vis = dict(hq=16, hkv=16, d=80, causal=False)
    return [
        # one long document per row, padded to the row's end (long-context rows)
        dict(name="llm 8K one doc", docs=[7800, 392], **llm),
        dict(name="llm 32K one doc", docs=[31200, 1568], **llm),
        # one rank's share under Ulysses SP4 at 64K: a quarter of the heads, the whole row
        dict(name="llm 64K one doc, SP4 heads", docs=[62400, 3136], hq=8, hkv=2, d=128,
             causal=True),
        # SFT-style packing: many documents of 0.5-4K tokens
        dict(name="llm 8K packed 0.5-4K", docs=packed(8192, 512, 4096), **llm),
        dict(name="llm 32K packed 0.5-4K", docs=packed(32768, 512, 4096), **llm),
        # vision tower: 12 images of 1,024 patches (448 px), or mixed sizes (448-1,000 px)
        dict(name="vision 12 x 1024", docs=[1024] * 12, **vis),
        dict(name="vision mixed 256-5120", docs=[rng.choice([1024, 2304, 4096, 5120, 1296, 256])
                                                 for _ in range(8)], **vis),
        # video: 16 temporal patches of a 448 px clip (1,024 patches each)
        dict(name="vision video 16 x 1024", docs=[1024] * 16, **vis),
        # the toy rows' calls: 56 px images and clip frames of 16 patches (host-bound)
        dict(name="vision toy 9 x 16", docs=[16] * 9, **vis),
    ]


def attention_flops(docs: list[int], hq: int, d: int, causal: bool) -> float:
    """Forward + backward FLOPs of the useful attention work (3.5x the forward's 4 S^2 H D)."""
    per = sum(n * n for n in docs) * 4 * hq * d * (0.5 if causal else 1.0)
    return 3.5 * per


# ----------------------------------------------------------------- candidates
def _cu(docs: list[int], device) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=device
    )


def _expand(k: torch.Tensor, hq: int) -> torch.Tensor:
    return k.repeat_interleave(hq // k.shape[1], dim=1) if k.shape[1] != hq else k


def _fold_kv_grad(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of kv heads that ``_expand`` repeated ``n_rep`` times, summed onto each
    source head."""
    return g if n_rep == 1 else g.unflatten(1, (-1, n_rep)).sum(2)


def reference(q, k, v, docs, causal) -> torch.Tensor:
    """Per-document float32 attention: the ground truth. Memory-efficient float32 kernel where
    it runs (the math kernel's score matrix of a 32K document is over 100 GiB), else math."""
    hq = q.shape[1]
    k, v = _expand(k, hq), _expand(v, hq)
    outs, start = [], 0
    for n in docs:
        # 4-D: the fused float32 kernels take [batch, heads, L, D] only
        qd, kd, vd = (t[start:start + n].float().transpose(0, 1)[None] for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                                             torch.nn.attention.SDPBackend.MATH]):
            outs.append(
                F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)[0].transpose(0, 1)
            )
        start += n
    return torch.cat(outs)


def make_candidates(case: dict) -> dict[str, Attn]:
    """Every kernel that can run this case exactly."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    docs, causal, hq = case["docs"], case["causal"], case["hq"]
    single = causal and len(docs) <= 2  # one document then padding (causal: padding unseen)
    out: dict[str, Attn] = {}

    def varlen(q, k, v):
        from torch.nn.attention.varlen import varlen_attn

        cu = _cu(docs, q.device)
        kw = {"window_size": (-1, 0) if causal else (-1, -1)}
        try:
            return varlen_attn(q, k, v, cu, cu, max(docs), max(docs), enable_gqa=True, **kw)
        except TypeError:
            return varlen_attn(
                q, _expand(k, hq), _expand(v, hq), cu, cu, max(docs), max(docs), **kw
            )

    out["varlen_fa2"] = varlen

    def varlen_aten(q, k, v):
        from torchtitan_omni.modules.attention import varlen_attention

        return varlen_attention(q, k, v, _cu(docs, q.device), max(docs), causal=causal)

    out["varlen_aten"] = varlen_aten

    def sdpa_rows(backend, expand=True):
        def run(q, k, v):
            with sdpa_kernel(backend):
                qb, kb, vb = ((_expand(t, hq) if expand else t).transpose(0, 1).unsqueeze(0)
                              for t in (q, k, v))
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)[0].transpose(
                    0, 1
                )
        return run

    if single or len(docs) == 1:
        out["sdpa_cudnn"] = sdpa_rows(SDPBackend.CUDNN_ATTENTION)
        if case["hkv"] != hq:  # k/v with their own heads: does cuDNN serve the groups itself?
            out["sdpa_cudnn_kv_heads"] = sdpa_rows(SDPBackend.CUDNN_ATTENTION, expand=False)
        out["sdpa_flash"] = sdpa_rows(SDPBackend.FLASH_ATTENTION)
        out["sdpa_efficient"] = sdpa_rows(SDPBackend.EFFICIENT_ATTENTION)

    def per_doc(q, k, v):
        outs, start = [], 0
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for n in docs:
                qd, kd, vd = (_expand(t[start:start + n], hq).transpose(0, 1).unsqueeze(0)
                              for t in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)[0]
                            .transpose(0, 1))
                start += n
        return torch.cat(outs)

    out["per_doc_cudnn"] = per_doc

    def grouped(q, k, v):
        # items of one length stacked into one batch (encoders: no causal mask, no padding)
        by_len: dict[int, list[int]] = {}
        starts = [0, *torch.tensor(docs).cumsum(0).tolist()[:-1]]
        for i, n in enumerate(docs):
            by_len.setdefault(n, []).append(i)
        result = torch.empty_like(q)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            for n, items in by_len.items():
                idx = torch.cat([torch.arange(starts[i], starts[i] + n) for i in items]).to(
                    q.device
                )
                qb, kb, vb = (_expand(t, hq).index_select(0, idx).view(len(items), n, hq, -1)
                              .transpose(1, 2) for t in (q, k, v))
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
                result = result.index_copy(
                    0, idx, o.transpose(1, 2).reshape(len(items) * n, hq, -1)
                )
        return result

    if not causal:
        out["sdpa_grouped"] = grouped

    class _Ragged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            cu = _cu(docs, q.device)
            ctx.n_rep = hq // k.shape[1]
            k, v = _expand(k, hq).contiguous(), _expand(v, hq).contiguous()
            # a benchmark candidate: cuDNN's ragged attention has no public entry point
            res = torch.ops.aten._cudnn_attention_forward(  # noqa: SLF001
                q, k, v, None, cu, cu, max(docs), max(docs), True, 0.0, causal, False)
            o, lse, seed, offset = res[0], res[1], res[6], res[7]
            ctx.save_for_backward(q, k, v, o, lse, seed, offset, cu)
            return o

        @staticmethod
        def backward(ctx, g):
            q, k, v, o, lse, seed, offset, cu = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(  # noqa: SLF001
                g.contiguous(), q, k, v, o, lse, seed, offset, torch.empty(0, device=q.device),
                cu, cu, max(docs), max(docs), 0.0, causal)
            return dq, _fold_kv_grad(dk, ctx.n_rep), _fold_kv_grad(dv, ctx.n_rep)

    def ragged(q, k, v):
        return _Ragged.apply(q, k, v)

    out["cudnn_ragged"] = ragged

    def flex(q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask

        doc_id = torch.repeat_interleave(torch.arange(len(docs), device=q.device),
                                         torch.tensor(docs, device=q.device))

        def mask_mod(b, h, qi, ki):
            same = doc_id[qi] == doc_id[ki]
            return same & (qi >= ki) if causal else same

        total = sum(docs)
        block = create_block_mask(mask_mod, None, None, total, total, device=q.device)
        fn = _compiled_flex()
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return fn(qb, kb, vb, block_mask=block, enable_gqa=k.shape[1] != hq)[0].transpose(0, 1)

    out["flex_doc"] = flex
    return out


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


# ----------------------------------------------------------------- timing
def cuda_unless_smoke(script: str, smoke: bool) -> bool:
    """Whether a benchmark runs on the GPU: not with ``--smoke`` (the CPU check of the
    script); without it, a machine with no GPU ends ``script`` with one line (exit 1)."""
    if smoke:
        return False
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (use --smoke for a CPU check)")
    return True


def time_passes(step: Callable[..., None], iters: int, warmup: int, cuda: bool,
                prepare: Callable[[], tuple] = tuple) -> tuple[float, float]:
    """Median (device ms, host ms) of ``step(*prepare())``: the host's from the call to its
    return (before waiting for the device), the device's from events around it (the host's
    on CPU). ``prepare`` runs before each pass, untimed."""
    device_ms, host_ms = [], []
    for i in range(warmup + iters):
        args = prepare()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step(*args)
        issued = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
            torch.cuda.synchronize()
        if i >= warmup:
            host_ms.append(issued)
            device_ms.append(start.elapsed_time(end) if cuda else issued)
    return statistics.median(device_ms), statistics.median(host_ms)


def time_fwd_bwd(fn: Attn, q, k, v, iters: int, warmup: int) -> tuple[float, float]:
    """Median milliseconds of forward + backward: on the device, and on the host to issue them
    (:func:`time_passes`; fresh leaves of ``q``, ``k``, ``v`` each pass)."""
    grad = torch.randn_like(q)
    return time_passes(lambda qq, kk, vv: fn(qq, kk, vv).backward(grad), iters, warmup,
                       q.is_cuda,
                       prepare=lambda: tuple(t.detach().requires_grad_() for t in (q, k, v)))


def _grads(fn: Attn, q, k, v, real: int, grad: torch.Tensor) -> list[torch.Tensor]:
    """float32 gradients of q, k, v for the upstream gradient ``grad`` on the real rows."""
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    fn(qq, kk, vv)[:real].float().backward(grad)
    return [t.grad.float() for t in (qq, kk, vv)]


def run_case(case: dict, device: str, dtype, iters: int, warmup: int) -> list[dict]:
    # each case compiles FlexAttention afresh: eight cases' shapes and grad modes otherwise hit
    # dynamo's recompile limit, after which flex_attention runs unfused
    torch.compiler.reset()
    g = torch.Generator(device=device).manual_seed(0)
    total = sum(case["docs"])
    q = torch.randn(total, case["hq"], case["d"], device=device, dtype=dtype, generator=g)
    k = torch.randn(total, case["hkv"], case["d"], device=device, dtype=dtype, generator=g)
    v = torch.randn(total, case["hkv"], case["d"], device=device, dtype=dtype, generator=g)
    # padding rows of a single-document row are not compared (nothing reads them)
    real = case["docs"][0] if case["causal"] and len(case["docs"]) == 2 else total
    ref = reference(q, k, v, case["docs"], case["causal"])[:real]
    grad = torch.randn(real, case["hq"], case["d"], device=device, generator=g)
    ref_grads = _grads(lambda a, b, c: reference(a, b, c, case["docs"], case["causal"]),
                       q, k, v, real, grad)
    flops = attention_flops(case["docs"], case["hq"], case["d"], case["causal"])
    rows = []
    for name, fn in make_candidates(case).items():
        row = {"case": case["name"], "kernel": name}
        try:
            with torch.no_grad():
                out = fn(q, k, v)[:real].float()
            row["rel_err"] = float((out - ref).norm() / ref.norm())
            got = _grads(fn, q, k, v, real, grad)
            row["grad_err"] = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref_grads))
            row["ms"], row["host_ms"] = time_fwd_bwd(fn, q, k, v, iters, warmup)
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as e:  # noqa: BLE001  (a kernel that cannot run this case is reported)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    args = p.parse_args(argv)
    device = "cuda" if cuda_unless_smoke("bench_attention", args.smoke) else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    cases = [c for c in layouts(args.smoke) if args.only in c["name"]]
    if not cases:
        sys.exit(f"bench_attention: no case name contains {args.only!r}")
    for case in cases:
        rows.extend(run_case(case, device, dtype, args.iters, args.warmup))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| case | kernel | ms (fwd+bwd) | host ms | TFLOP/s | rel. error out / grad |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['kernel']} | - | - | - | {r['error']} |")
        else:
            print(f"| {r['case']} | {r['kernel']} | {r['ms']:.2f} | {r['host_ms']:.2f} | "
                  f"{r['tflops']:.0f} | {r['rel_err']:.1e} / {r['grad_err']:.1e} |")
    return rows


if __name__ == "__main__":
    main()
