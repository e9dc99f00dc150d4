"""Held-out task metrics of a checkpoint on the test split of the job's dataset.

    python scripts/eval_metrics.py --job.config_file train_configs/convergence/llama_omni_debug.toml
    python scripts/eval_metrics.py --job.config_file CONFIG --split test --limit 20 \\
        --generate.checkpoint outputs/convergence/llama_omni_debug/checkpoint/step-200

Loads the newest complete checkpoint of the job (``generate.checkpoint`` picks another) into
one process, then scores every row of the split by its kind (``torchtitan_omni.eval.tasks``):
image / video / audio question answering by greedy decoding against the reference answer
(normalized match), speech transcription word accuracy, text perplexity, the image decoder's
teacher-forced code accuracy, and a PNG grid of images drawn for fixed captions. Writes
``metrics.json``, ``answers.jsonl`` and ``samples.png`` into ``--out`` (default
``<job.dump_folder>/eval``). ``--section.key value`` arguments configure the job as for training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout without installing

import torchtitan_omni  # noqa: E402,F401  (selects the device before TorchTitan loads)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest for the job config."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--split", default="test", help="split of the job's dataset (default test)")
    p.add_argument("--limit", type=int, default=0, help="rows per data file (0: all)")
    p.add_argument("--out", default="", help="output folder (default <dump_folder>/eval)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--no-grid", action="store_true", help="skip the image sample grid")
    return p.parse_known_args(argv)


def run(args: argparse.Namespace, cfg) -> dict:
    """Score the split and write the outputs; returns the metrics."""
    from torchtitan_omni.data.loader import dataset_root
    from torchtitan_omni.eval.tasks import (
        TaskEvaluator, read_split, sample_grid, split_by_modalities,
    )
    from torchtitan_omni.generate import Generator
    from torchtitan_omni.protocols import batch as B

    root = dataset_root(cfg)
    items = read_split(root, args.split, args.limit, cfg.data.format)
    gen = Generator.from_config(cfg)
    items, skipped = split_by_modalities(items, gen.processors)
    for task, n in sorted(skipped.items()):
        print(f"eval_metrics: skipped {n} row(s) of {task}: media the model does not read "
              f"(it reads {', '.join(gen.processors) or 'text only'})", flush=True)
    evaluator = TaskEvaluator(gen, root, cfg.training.seq_len, args.max_new_tokens)
    report = evaluator.answers(items)
    metrics = dict(sorted(report.metrics.items()))
    metrics.update({f"skipped_rows/{task}": n for task, n in sorted(skipped.items())})
    ppl = evaluator.text_perplexity(items)
    if ppl is not None:
        metrics["text_perplexity"] = ppl
    codes = evaluator.code_accuracy(items)
    if codes is not None:
        metrics["gen_image_code_accuracy"] = codes
    out = args.out or os.path.join(cfg.job.dump_folder, "eval")
    os.makedirs(out, exist_ok=True)
    if not args.no_grid and B.GEN_IMAGE in gen.model.decoders:
        g = cfg.generate
        metrics["samples_png"] = sample_grid(gen, os.path.join(out, "samples.png"),
                                             cfg_scale=g.cfg_scale, temperature=g.temperature,
                                             top_k=g.top_k, seed=g.seed)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    with open(os.path.join(out, "answers.jsonl"), "w") as f:
        for row in report.answers:
            f.write(json.dumps(row) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    from torchtitan.tools.logging import init_logger

    from torchtitan_omni.distributed.process_group import init_process_group
    from torchtitan_omni.config.manager import parse_job_config_or_exit
    from torchtitan_omni.errors import OmniInputError

    args, rest = parse(sys.argv[1:] if argv is None else argv)
    init_logger()
    cfg = parse_job_config_or_exit(rest)
    init_process_group()  # DCP reads through a (single-process) group
    try:
        metrics = run(args, cfg)
    except (OmniInputError, FileNotFoundError) as e:
        print(f"torchtitan-omni: error: {e}", file=sys.stderr)
        return 1
    for name, value in metrics.items():
        print(f"{name:40s} {value:.4f}" if isinstance(value, float) else f"{name:40s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
