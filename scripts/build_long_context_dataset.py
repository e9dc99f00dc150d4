"""Build long omni documents for long-context training and benchmarks.

Each row is one plain-text document of about ``--fill x --seq-len`` tokens (as the job's own
tokenizer and media processors count them): real paragraphs of the bundled text task with an
image from the bundled photo, digit and face tasks every ``--image-every`` text tokens and a
video clip every ``--video-every``. Packing then gives one document per row, so attention
really spans the whole sequence (packed short documents would make long-context figures
look better than they are). Every row is checked with the training pipeline's own document
encoder: it must fit in ``seq_len``.

    python3 scripts/build_long_context_dataset.py --config train_configs/llama_omni_8B.toml \\
        --seq-len 32768 --out data/long_context_32k
    CONFIG_FILE=train_configs/llama_omni_8B.toml ./run_train.sh --training.seq_len 32768 \\
        --training.dataset long_context --training.dataset_path data/long_context_32k

The media files stay where the bundled dataset keeps them (rows refer to them by relative
path), so the output is small. Other ``--section.key value`` arguments override the config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys

from torchtitan_omni.config.manager import parse_job_config_or_exit
from torchtitan_omni.data.bad_samples import BadSample, Source
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.loader import dataset_root, model_processing
from torchtitan_omni.data.processors import build_processors
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.errors import OmniInputError

IMAGE_TASKS = ("photos", "digits", "faces")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the training TOML (tokenizer, model, data)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--out", required=True, help="output folder (train.jsonl, manifest.json)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--fill", type=float, default=0.95, help="document length / seq_len")
    p.add_argument("--image-every", type=int, default=1024, help="text tokens between images (0: none)")
    p.add_argument("--video-every", type=int, default=4096, help="text tokens between videos (0: none)")
    p.add_argument("--seed", type=int, default=0)
    # anything else is a job-config override, as for run_train.sh (e.g. --model.hf_assets_path)
    args, args.overrides = p.parse_known_args(argv)
    return args


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _material(root: str, rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """Paragraphs, image paths and video paths (relative to ``root``) of the bundled train split."""
    def rows(task: str) -> list[dict]:
        path = os.path.join(root, f"train-{task}.jsonl")
        if not os.path.exists(path):
            raise OmniInputError(f"{path} not found: build the bundled dataset first "
                                 "(scripts/build_default_dataset.py)")
        return _read_jsonl(path)

    texts = [r["text"] for r in rows("text") if r.get("text")]
    images = [p for task in IMAGE_TASKS for r in rows(task) for p in r.get("images") or []]
    videos = [p for r in rows("video") for p in r.get("videos") or []]
    for items in (texts, images, videos):
        rng.shuffle(items)
    return texts, images, videos


class DocumentBuilder:
    """Greedy filling of one document to a token budget with text and media placeholders."""

    def __init__(self, tokenizer, processors, root: str, out: str) -> None:
        self.tok = tokenizer
        self.processors = processors
        self.root = root
        self.out = out
        self._media_tokens: dict[tuple[str, str], int] = {}

    def media_tokens(self, modality: str, ref: str) -> int:
        """Tokens of one placeholder: begin, the items' pads, end."""
        key = (modality, ref)
        if key not in self._media_tokens:
            items = self.processors[modality](ref, self.root, Source(ref, 0))
            self._media_tokens[key] = 2 + sum(it.num_tokens for it in items)
        return self._media_tokens[key]

    def build(self, budget: int, texts, images, videos, image_every: int, video_every: int) -> dict:
        parts: list[str] = []
        row_images: list[str] = []
        row_videos: list[str] = []
        used = 2  # bos, eos
        since_image = since_video = 0
        for paragraph in texts:
            n = len(self.tok.encode_texts([paragraph + "\n"])[0])
            if used + n > budget:
                break
            parts.append(paragraph + "\n")
            used += n
            since_image += n
            since_video += n
            for modality, every, pool, chosen, since in (
                ("video", video_every, videos, row_videos, since_video),
                ("image", image_every, images, row_images, since_image),
            ):
                if not every or since < every or modality not in self.processors:
                    continue
                ref = next(pool)
                m = self.media_tokens(modality, ref)
                if used + m > budget:
                    continue
                parts.append(f"<{modality}>\n")
                chosen.append(os.path.relpath(os.path.join(self.root, ref), self.out))
                used += m
                if modality == "video":
                    since_video = 0
                else:
                    since_image = 0
        return {"text": "".join(parts), "images": row_images, "videos": row_videos}


def main(argv: list[str] | None = None) -> dict:
    """Build the dataset; returns its manifest."""
    args = parse_args(argv)
    # one process here: the parallel degrees of the training job do not matter to the data
    cfg = parse_job_config_or_exit(["--job.config_file", args.config,
                                    "--training.seq_len", str(args.seq_len),
                                    "--parallelism.expert_parallel_degree", "1",
                                    "--parallelism.ulysses_degree", "1", *args.overrides])
    root = dataset_root(cfg)
    tokenizer = build_omni_tokenizer(cfg)
    processors = build_processors(model_processing(cfg))
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    texts, images, videos = _material(root, rng)
    builder = DocumentBuilder(tokenizer, processors, root, args.out)
    check = DocumentEncoder(tokenizer, processors, args.seq_len, args.out, split_long_text=False)
    budget = int(args.fill * args.seq_len)
    text_cycle, image_cycle, video_cycle = (itertools.cycle(x) for x in (texts, images, videos))

    lengths, media_counts = [], [0, 0]
    path = os.path.join(args.out, "train.jsonl")
    with open(path, "w") as f:
        for i in range(args.rows):
            row = builder.build(budget, text_cycle, image_cycle, video_cycle,
                                args.image_every, args.video_every)
            try:
                docs = check.encode(parse_row(row, Source(path, i)), random.Random(0))
            except BadSample as e:
                raise OmniInputError(f"row {i} does not encode: {e}") from None
            if len(docs) != 1 or len(docs[0]) > args.seq_len:
                raise OmniInputError(f"row {i} does not fit in seq_len {args.seq_len}: "
                                     f"{[len(d) for d in docs]} tokens")
            lengths.append(len(docs[0]))
            media_counts[0] += len(row["images"])
            media_counts[1] += len(row["videos"])
            f.write(json.dumps(row) + "\n")
    manifest = {
        "seq_len": args.seq_len, "rows": args.rows, "config": args.config,
        "tokens_per_row": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
        "images_per_row": media_counts[0] / args.rows, "videos_per_row": media_counts[1] / args.rows,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{path}: {args.rows} rows, {manifest['tokens_per_row']['mean']:.0f} tokens/row "
          f"(max {max(lengths)} <= {args.seq_len}), {manifest['images_per_row']:.1f} images and "
          f"{manifest['videos_per_row']:.1f} videos/row")
    return manifest


if __name__ == "__main__":
    try:
        main()
    except OmniInputError as e:
        print(f"torchtitan-omni: error: {e}", file=sys.stderr)
        sys.exit(2)
