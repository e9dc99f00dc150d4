#!/usr/bin/env python
"""Throughput of the omni data loader on the bundled dataset (CPU), against a GPU step time.

    python scripts/bench_dataloader.py --gpu-step-ms 350 [--batches 50] [--workers 2]
        [--seq-len 2048] [--batch-size 4] [--model llama_omni --flavor debugmodel]
    # the realistic workload (scripts/build_long_context_dataset.py) with the 8B processing
    python scripts/bench_dataloader.py --data data/realistic/llama_omni_8B_8k --seq-len 8192 \
        --batch-size 1 --model llama_omni --flavor 8B --workers 2 --gpu-step-ms 960

Prints samples/s and tokens/s (real, non-padding tokens) of the loader and whether it keeps up
with one training step per ``--gpu-step-ms`` per data-parallel rank (each rank has its own
loader and workers). Processing configs come from ``--model/--flavor`` when that spec is
registered, else from ``--preset``: "debug" (small 28 px patches, what the CPU debug models
use) or "qwen2vl" (14 px patches, images up to 1,280 LLM tokens, Whisper audio, 384 px
generation targets).
"""

from __future__ import annotations

import argparse
import time

from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

PRESETS = {
    "debug": {
        "image": ImageProcessing(patch_size=14, min_pixels=28 * 28, max_pixels=56 * 56),
        "video": VideoProcessing(
            patch_size=14, min_pixels=28 * 28, max_pixels=56 * 56, fps=2.0, max_frames=8
        ),
        "audio": AudioProcessing(),
        "gen_image": GenImageProcessing(image_size=32, downsample=8),
    },
    "qwen2vl": {
        "image": ImageProcessing(),
        "video": VideoProcessing(),
        "audio": AudioProcessing(),
        "gen_image": GenImageProcessing(),
    },
}


def _processing(args):
    if args.model:
        from torchtitan.protocols.train_spec import get_train_spec

        import torchtitan_omni.models  # noqa: F401

        return get_train_spec(args.model).model_args[args.flavor].processing()
    return PRESETS[args.preset]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-step-ms", type=float, default=None,
                        help="measured GPU time of one training step (one micro-batch)")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--dataset-path", default="./data/omni_default")
    parser.add_argument("--data", default=None,
                        help="another dataset folder (e.g. a realistic workload) instead of the "
                             "bundled one")
    parser.add_argument("--tokenizer-dir", default="./assets/tokenizer")
    parser.add_argument("--model", default=None)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="debug")
    args = parser.parse_args(argv)

    import torch
    from torchtitan.config import ConfigManager

    import torchtitan_omni  # noqa: F401  (device choice before TorchTitan)
    from torchtitan_omni.data.default_dataset import ensure_default_dataset
    from torchtitan_omni.data.loader import build_omni_dataloader
    from torchtitan_omni.data.tokenizer import OmniTokenizer

    torch.set_num_threads(1)
    ensure_default_dataset(args.dataset_path, args.tokenizer_dir)
    dataset = (["--training.dataset", "custom", "--training.dataset_path", args.data,
                "--data.buffer_docs", "4"] if args.data else
               ["--training.dataset", "omni_default", "--training.dataset_path", args.dataset_path])
    cfg = ConfigManager().parse_args([
        "--job.custom_config_module", "torchtitan_omni.config.job_config", *dataset,
        "--model.hf_assets_path", args.tokenizer_dir, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch_size),
        "--training.dataloader.num_workers", str(args.workers),
    ])
    tokenizer = OmniTokenizer(args.tokenizer_dir)
    bos = tokenizer.special.bos
    loader = build_omni_dataloader(1, 0, tokenizer, cfg, processing=_processing(args))
    it = iter(loader)
    for _ in range(args.warmup):
        next(it)
    samples = tokens = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        batch, _ = next(it)
        samples += int((batch["input"] == bos).sum())  # every sample starts with bos
        tokens += int(batch["real_tokens"])
    elapsed = time.perf_counter() - start
    ms_per_batch = 1000 * elapsed / args.batches
    print(
        f"loader: {args.batches} batches of {args.batch_size} x {args.seq_len} in {elapsed:.2f} s "
        f"(workers={args.workers}, preset/model={args.model or args.preset}, "
        f"data={args.data or args.dataset_path})"
    )
    print(f"  {samples / elapsed:,.0f} samples/s  {tokens / elapsed:,.0f} tokens/s  "
          f"{ms_per_batch:.1f} ms/batch  skipped: {sum(loader.stats().values())}")
    if args.gpu_step_ms:
        ratio = args.gpu_step_ms / ms_per_batch
        verdict = "keeps up" if ratio >= 1 else "does NOT keep up"
        print(f"  GPU step {args.gpu_step_ms:.0f} ms: the loader {verdict} ({ratio:.2f}x the "
              f"needed rate)")
        if args.workers == 0 and ratio < 1:
            # workers scale at best linearly, and only with free cores
            need = int(-(-ms_per_batch // args.gpu_step_ms))
            print(f"  at least {need} loader workers per rank (training.dataloader.num_workers) "
                  "and as many free CPU cores would be needed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
