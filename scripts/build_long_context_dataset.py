"""Build long omni documents for long-context training and benchmarks.

Each row is one plain-text document of about ``--fill x --seq-len`` tokens (as the job's own
tokenizer and media processors count them) with ``<image>``/``<video>``/``<audio>``
placeholders between real paragraphs of the bundled text task. Packing then gives one
document per row, so attention really spans the whole sequence (packed short documents would
make long-context figures look better than they are). Every row is checked with the training
pipeline's own document encoder: it must fit in ``seq_len``. Three workloads:

- ``--workload realistic`` (default): media of the sizes real omni training feeds
  (``torchtitan_omni/data/default_dataset/realistic.py``): photos and digit grids of 448-1,024
  px, clips of 16-32 sampled frames at 224-448 px, 10-30 s of speech. Placeholders fill about
  ``--media-share`` of each row's tokens, split between ``--modalities`` by their weights
  (``image:2,video:1,audio:1``; equal by default). The media are made once into a cache
  (``--media-cache``) that builds for other configs and sequence lengths reuse, and processed
  once per processing config (counts cached there too).
- ``--workload toy``: the bundled dataset's own media (48 px images, 8 frames of 32
  px) with an image every ``--image-every`` text tokens and a clip every ``--video-every``:
  under 1% of the tokens with the real flavors' processing.
- ``--workload text``: the same paragraphs and document lengths with no media: the text
  baseline of the media rows (one document per row, so attention costs what it costs there;
  the bundled text packed into rows has short documents and much cheaper attention).

    python3 scripts/build_long_context_dataset.py --config train_configs/llama_omni_8B.toml \\
        --seq-len 8192 --out data/realistic/llama_omni_8B_8k
    CONFIG_FILE=train_configs/llama_omni_8B.toml ./run_train.sh --training.seq_len 8192 \\
        --training.dataset long_context --training.dataset_path data/realistic/llama_omni_8B_8k \\
        --data.modalities image,video,audio

Prints each row's make-up and a summary (items, patches or mel frames and LLM tokens per
modality, text tokens, media share), also written to ``manifest.json``. Rows refer to media
by relative path, so the output is small. Other ``--section.key value`` arguments override
the config.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import inspect
import itertools
import json
import multiprocessing
import os
import random
import sys
import time

from torchtitan_omni.config.manager import parse_job_config_or_exit
from torchtitan_omni.data.bad_samples import BadSample, Source
from torchtitan_omni.data.default_dataset import realistic
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.loader import dataset_root, model_processing
from torchtitan_omni.data.processors import Item, Processor, build_processors
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.errors import OmniInputError

IMAGE_TASKS = ("photos", "digits", "faces")
MEDIA = ("image", "video", "audio")
ROW_KEYS = {"image": "images", "video": "videos", "audio": "audios"}
#: how far past ``--media-share`` of the budget one more media item may take a row
SHARE_SLACK = 0.05
#: candidates looked at for the next paragraph or media item that fits
LOOKAHEAD = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the training TOML (tokenizer, model, data)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--out", required=True, help="output folder (train.jsonl, manifest.json)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--fill", type=float, default=0.95, help="document length / seq_len")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("realistic", "toy", "text"),
                   default="realistic")
    p.add_argument("--quiet", action="store_true", help="no per-row lines")
    toy = p.add_argument_group("toy workload")
    toy.add_argument("--image-every", type=int, default=1024,
                     help="text tokens between images (0: none)")
    toy.add_argument("--video-every", type=int, default=4096,
                     help="text tokens between videos (0: none)")
    real = p.add_argument_group("realistic workload")
    real.add_argument("--media-share", type=float, default=0.5,
                      help="target fraction of a row's tokens taken by media placeholders")
    real.add_argument("--modalities", default="image,video,audio",
                      help="media modalities, optionally weighted (image:2,video:1,audio:1): "
                           "how the media tokens are split")
    real.add_argument("--pool", default="64,24,24",
                      help="distinct images,videos,audio clips to draw from (cached)")
    real.add_argument("--media-cache", default="",
                      help="folder of the generated media (default: realistic_media beside "
                           "the bundled dataset)")
    real.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                      help="processes making and processing the media")
    # anything else is a job-config override, as for run_train.sh (e.g. --model.hf_assets_path)
    args, args.overrides = p.parse_known_args(argv)
    if not 0.0 <= args.media_share < 1.0:
        p.error(f"--media-share must be in [0, 1), got {args.media_share}")
    if not 0.0 < args.fill <= 1.0:
        p.error(f"--fill must be in (0, 1], got {args.fill}")
    return args


def parse_weights(spec: str) -> dict[str, float]:
    """``image:2,video:1,audio`` -> {modality: weight} (weight 1 when omitted)."""
    weights = {}
    for part in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = part.partition(":")
        if name not in MEDIA:
            raise OmniInputError(f"--modalities: unknown modality {name!r} "
                                 f"(known: {', '.join(MEDIA)})")
        try:
            weights[name] = float(value) if value else 1.0
        except ValueError:
            raise OmniInputError(f"--modalities: weight of {name} is not a number: "
                                 f"{value!r}") from None
        if weights[name] <= 0:
            raise OmniInputError(f"--modalities: weight of {name} must be > 0, got {value}")
    if not weights:
        raise OmniInputError("--modalities names no modality")
    return weights


def parse_pool(spec: str) -> dict[str, int]:
    """``64,24,24`` -> {image: 64, video: 24, audio: 24}."""
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        counts = []
    if len(counts) != len(MEDIA) or min(counts) < 1:
        raise OmniInputError(f"--pool must be 3 positive counts (images,videos,audio), "
                             f"got {spec!r}")
    return dict(zip(MEDIA, counts))


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _task_rows(root: str, task: str) -> list[dict]:
    path = os.path.join(root, f"train-{task}.jsonl")
    if not os.path.exists(path):
        raise OmniInputError(f"{path} not found: build the bundled dataset first "
                             "(scripts/build_default_dataset.py)")
    return _read_jsonl(path)


def _material(root: str, rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """Paragraphs, image paths and video paths (absolute) of the bundled train split."""
    texts = [r["text"] for r in _task_rows(root, "text") if r.get("text")]
    images = [os.path.join(root, p) for task in IMAGE_TASKS for r in _task_rows(root, task)
              for p in r.get("images") or []]
    videos = [os.path.join(root, p) for r in _task_rows(root, "video")
              for p in r.get("videos") or []]
    for items in (texts, images, videos):
        rng.shuffle(items)
    return texts, images, videos


# ----------------------------------------------------------------- media processing results
_WORKER_PROCESSORS: dict[str, Processor] = {}  # set before the worker processes fork


def _item_stats(modality: str, item: Item, processor: Processor) -> dict:
    """What one processed item feeds its encoder and the LLM."""
    out = {"tokens": item.num_tokens}
    grid = item.tensors.get("grid_thw")
    if grid is not None:
        out["patches"] = int(grid.prod())
        if modality == "video":
            out["frames"] = int(grid[0]) * processor.config.temporal_patch_size
    elif "lengths" in item.tensors:  # audio: mel frames
        cfg = processor.config
        out["mel_frames"] = int(item.tensors["lengths"])
        out["seconds"] = (out["mel_frames"] - 1) * cfg.hop_length / cfg.sample_rate
    else:  # fixed-size images: one patch per token
        out["patches"] = item.num_tokens
    return out


def _process(task: tuple[str, str]) -> list[dict]:
    modality, path = task
    proc = _WORKER_PROCESSORS[modality]
    items = proc(path, os.path.dirname(path), Source(path, 0))
    return [_item_stats(modality, it, proc) for it in items]


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core


def _processing_key(processors: dict[str, Processor]) -> str:
    """What a file's items depend on besides the file: each processor's config and code."""
    parts = []
    for m, p in sorted(processors.items()):
        module = inspect.getmodule(type(p))
        parts += [m, repr(p.config), inspect.getsource(module) if module else ""]
    return "\n".join(parts)


class MediaStats:
    """Each media file's items as the job's processors make them (tokens, patches, frames),
    computed once per file; with ``cache_dir``, kept on disk per processing config so builds
    for other sequence lengths (and configs of the same processing) reuse them."""

    def __init__(self, processors: dict[str, Processor], cache_dir: str | None = None) -> None:
        self.processors = processors
        self._items: dict[str, list[dict]] = {}  # by absolute path
        self.cache_dir = os.path.abspath(cache_dir) if cache_dir else None
        self.cache_file = None
        if cache_dir:
            cache_dir = self.cache_dir
            digest = hashlib.sha1(_processing_key(processors).encode()).hexdigest()[:12]
            self.cache_file = os.path.join(cache_dir, f"stats-{digest}.json")
            try:
                with open(self.cache_file) as f:
                    saved = json.load(f)
                self._items = {os.path.join(cache_dir, k): v for k, v in saved.items()}
            except (OSError, ValueError):
                pass

    def items(self, modality: str, path: str) -> list[dict]:
        """The items of one media file."""
        path = os.path.abspath(path)
        if path not in self._items:
            _WORKER_PROCESSORS.update(self.processors)
            self._items[path] = _process((modality, path))
        return self._items[path]

    def tokens(self, modality: str, path: str) -> int:
        """Row tokens of one placeholder: begin, the items' pads, end."""
        return 2 + sum(it["tokens"] for it in self.items(modality, path))

    def precompute(self, tasks: list[tuple[str, str]], jobs: int) -> int:
        """Process the (modality, path) files not seen yet, with ``jobs`` processes; returns
        how many there were."""
        todo = [(m, os.path.abspath(p)) for m, p in tasks]
        todo = [t for t in dict.fromkeys(todo) if t[1] not in self._items]
        _WORKER_PROCESSORS.update(self.processors)
        if jobs > 1 and len(todo) > 1:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(min(jobs, len(todo)), initializer=_init_worker) as pool:
                results = pool.map(_process, todo, chunksize=1)
        else:
            results = [_process(t) for t in todo]
        self._items.update({path: r for (_, path), r in zip(todo, results)})
        if todo and self.cache_file:
            mine = {os.path.relpath(p, self.cache_dir): v for p, v in self._items.items()
                    if p.startswith(self.cache_dir + os.sep)}
            tmp = f"{self.cache_file}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(mine, f)
            os.replace(tmp, self.cache_file)  # atomic: parallel builds may write it too
        return len(todo)

    def replay(self) -> dict[str, Processor]:
        """Processors that return each file's items as computed (token counts only): the
        document encoder's check then costs no second decode of every file."""
        return {m: _Replay(self, m) for m in self.processors}


class _Replay(Processor):
    """A processor answering from :class:`MediaStats` (items without tensors)."""

    def __init__(self, stats: MediaStats, modality: str) -> None:
        super().__init__(stats.processors[modality].config)
        self.stats, self.modality = stats, modality

    def __call__(self, ref, root, source=None) -> list[Item]:
        path = ref if os.path.isabs(ref) else os.path.join(root, ref)
        return [Item({}, it["tokens"]) for it in self.stats.items(self.modality, path)]

    def collate(self, items):
        raise NotImplementedError("replayed items carry no tensors")


# ----------------------------------------------------------------- filling documents
class Pool:
    """A cycle of candidates; :meth:`take` moves the first of the next few that passes a test
    to the back (deterministic, and every candidate keeps coming round)."""

    def __init__(self, items: list) -> None:
        self.items = collections.deque(items)

    def take(self, fits, lookahead: int = LOOKAHEAD):
        for k in range(min(lookahead, len(self.items))):
            if fits(self.items[k]):
                item = self.items[k]
                del self.items[k]
                self.items.append(item)
                return item
        return None


class DocumentBuilder:
    """Greedy filling of one document to a token budget with text and media placeholders."""

    def __init__(self, tokenizer, stats: MediaStats, out: str) -> None:
        self.tok = tokenizer
        self.stats = stats
        self.out = out
        self._text_tokens: dict[str, int] = {}

    def text_tokens(self, text: str) -> int:
        if text not in self._text_tokens:
            self._text_tokens[text] = len(self.tok.encode_texts([text])[0])
        return self._text_tokens[text]

    def _row(self, parts: list[str], chosen: dict[str, list[str]]) -> dict:
        row = {"text": "".join(parts)}
        for m, paths in chosen.items():
            row[ROW_KEYS[m]] = [os.path.relpath(p, self.out) for p in paths]
        return row

    def build(self, budget: int, texts, images, videos, image_every: int, video_every: int) -> dict:
        """Toy rows: paragraphs in order, an image every ``image_every`` text tokens and a clip
        every ``video_every``."""
        parts: list[str] = []
        chosen: dict[str, list[str]] = {"image": [], "video": []}
        used = 2  # bos, eos
        since = {"image": 0, "video": 0}
        for paragraph in texts:
            n = self.text_tokens(paragraph + "\n")
            if used + n > budget:
                break
            parts.append(paragraph + "\n")
            used += n
            for m in since:
                since[m] += n
            for modality, every, pool in (("video", video_every, videos),
                                          ("image", image_every, images)):
                if not every or since[modality] < every or modality not in self.stats.processors:
                    continue
                path = next(pool)
                t = self.stats.tokens(modality, path)
                if used + t > budget:
                    continue
                parts.append(f"<{modality}>\n")
                chosen[modality].append(path)
                used += t
                since[modality] = 0
        return self._row(parts, chosen)

    def build_realistic(self, budget: int, share: float, weights: dict[str, float],
                        texts: Pool, pools: dict[str, Pool]) -> dict:
        """Realistic rows: media placeholders while they hold less than ``share`` of the
        tokens so far, else text, until neither fits; the modality furthest below its
        weight's part of the media tokens goes next."""
        parts: list[str] = []
        chosen: dict[str, list[str]] = {m: [] for m in pools}
        per = dict.fromkeys(pools, 0)
        used, media = 2, 0  # bos, eos
        cap = (share + SHARE_SLACK) * budget if share > 0 else 0

        def add_media() -> bool:
            nonlocal used, media
            for m in sorted(pools, key=lambda m: per[m] / weights[m]):
                # + 1: the newline after the placeholder
                # the predicate runs inside take(), before the loop variables move on
                path = pools[m].take(lambda p: used + self.stats.tokens(m, p) + 1 <= budget  # noqa: B023
                                     and media + self.stats.tokens(m, p) <= cap)  # noqa: B023
                if path is not None:
                    t = self.stats.tokens(m, path)
                    parts.append(f"<{m}>\n")
                    chosen[m].append(path)
                    used, media, per[m] = used + t + 1, media + t, per[m] + t
                    return True
            return False

        def add_text() -> bool:
            nonlocal used
            paragraph = texts.take(lambda p: used + self.text_tokens(p + "\n") <= budget)
            if paragraph is None:
                return False
            parts.append(paragraph + "\n")
            used += self.text_tokens(paragraph + "\n")
            return True

        while True:
            first, second = (add_media, add_text) if media < share * used else (add_text, add_media)
            if not (first() or second()):
                return self._row(parts, chosen)


# ----------------------------------------------------------------- checking and counting
def encode_row(check: DocumentEncoder, row: dict, path: str, i: int, seq_len: int):
    """The row's one document, as the training pipeline encodes it (must fit ``seq_len``)."""
    try:
        docs = check.encode(parse_row(row, Source(path, i)), random.Random(0))
    except BadSample as e:
        raise OmniInputError(f"row {i} does not encode: {e}") from None
    if len(docs) != 1 or len(docs[0]) > seq_len:
        raise OmniInputError(f"row {i} does not fit in seq_len {seq_len}: "
                             f"{[len(d) for d in docs]} tokens")
    return docs[0]


def row_stats(row: dict, doc, stats: MediaStats, out: str) -> dict:
    """One encoded row's make-up: tokens per modality (placeholders with their begin and end
    tokens), items, what they feed the encoders, and the media share."""
    mods = {}
    for m, key in ROW_KEYS.items():
        paths = [os.path.join(out, p) for p in row.get(key) or []]
        if not paths:
            continue
        items = [stats.items(m, p) for p in paths]
        entry = {"items": len(paths), "tokens": len(doc.pad_positions.get(m, ())) + 2 * len(paths),
                 "item_tokens": [2 + sum(it["tokens"] for it in its) for its in items]}
        if m in ("image", "video"):
            entry["patches"] = sum(it.get("patches", 0) for its in items for it in its)
        if m == "video":
            entry["frames"] = [sum(it["frames"] for it in its) for its in items]
        if m == "audio":
            entry["mel_frames"] = sum(it["mel_frames"] for its in items for it in its)
            entry["seconds"] = [round(sum(it["seconds"] for it in its), 2) for its in items]
        mods[m] = entry
    media = sum(e["tokens"] for e in mods.values())
    return {"tokens": len(doc), "text_tokens": len(doc) - media, "media_tokens": media,
            "media_share": media / len(doc), "modalities": mods}


def _span(values: list) -> dict:
    if not values:
        return {}
    return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}


def summarize(per_row: list[dict]) -> dict:
    """Totals over the rows: per modality items, patches or mel frames, LLM tokens."""
    total = sum(r["tokens"] for r in per_row)
    mods = {}
    for m in MEDIA:
        entries = [r["modalities"][m] for r in per_row if m in r["modalities"]]
        if not entries:
            continue
        s = {"items": sum(e["items"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
             "item_tokens": _span([t for e in entries for t in e["item_tokens"]])}
        s["share"] = s["tokens"] / total
        for key in ("patches", "mel_frames"):
            if key in entries[0]:
                s[key] = sum(e[key] for e in entries)
        for key in ("frames", "seconds"):
            if key in entries[0]:
                s[key] = _span([v for e in entries for v in e[key]])
        mods[m] = s
    media = sum(r["media_tokens"] for r in per_row)
    return {"tokens": total, "text_tokens": total - media, "media_tokens": media,
            "media_share": media / total,
            "row_media_share": _span([r["media_share"] for r in per_row]), "modalities": mods}


def describe_row(i: int, r: dict) -> str:
    """One line per row."""
    pieces = []
    for m, e in r["modalities"].items():
        extra = ""
        if m == "video":
            extra = f", {'/'.join(str(f) for f in e['frames'])} frames"
        elif m == "audio":
            extra = f", {'/'.join(f'{s:.1f}' for s in e['seconds'])} s"
        pieces.append(f"{m} {e['items']} ({e['tokens']:,} tok{extra})")
    return (f"row {i}: {r['tokens']:,} tokens, media {100 * r['media_share']:.1f}%: "
            + ", ".join(pieces + [f"text {r['text_tokens']:,}"]))


def describe_summary(s: dict, rows: int) -> str:
    """The summary table printed after the rows."""
    lines = [f"{'':6} {'items':>6} {'per row':>8} {'patches':>10} {'LLM tokens':>11} "
             f"{'tok/item':>12} {'share':>6}  notes"]
    for m, e in s["modalities"].items():
        enc = e.get("patches", e.get("mel_frames", 0))
        it = e["item_tokens"]
        note = ""
        if "frames" in e:
            note = f"{e['frames']['min']}-{e['frames']['max']} frames"
        if "seconds" in e:
            note = f"{e['seconds']['min']:.1f}-{e['seconds']['max']:.1f} s, patches = mel frames"
        span = f"{it['min']:,}-{it['max']:,}"
        lines.append(f"{m:6} {e['items']:6,} {e['items'] / rows:8.1f} {enc:10,} {e['tokens']:11,} "
                     f"{span:>12} {100 * e['share']:5.1f}%  {note}".rstrip())
    lines.append(f"{'text':6} {'':6} {'':8} {'':10} {s['text_tokens']:11,} {'':12} "
                 f"{100 * s['text_tokens'] / s['tokens']:5.1f}%")
    rs = s["row_media_share"]
    lines.append(f"media share {100 * s['media_share']:.1f}% (rows {100 * rs['min']:.1f}-"
                 f"{100 * rs['max']:.1f}%)")
    return "\n".join(lines)


# ----------------------------------------------------------------- main
def _realistic_pools(args, weights: dict[str, float], root: str, rng: random.Random,
                     stats_dir: str) -> tuple[dict[str, list[str]], str]:
    """Media pools (absolute paths) per modality from the cache, made if missing."""
    counts = parse_pool(args.pool)
    speech = os.path.join(root, "media", "speech", "train")
    cache = realistic.MediaCache(stats_dir, args.seed, speech)
    start = time.monotonic()
    try:
        entries = cache.ensure({m: counts[m] for m in weights}, jobs=args.jobs)
    except FileNotFoundError as e:
        raise OmniInputError(str(e)) from None
    print(f"media cache {cache.root}: " + ", ".join(f"{len(v)} {m}" for m, v in entries.items())
          + f" ({cache.made} made in {time.monotonic() - start:.1f} s)")
    pools = {}
    for m, items in entries.items():
        paths = [os.path.join(cache.root, e["path"]) for e in items]
        rng.shuffle(paths)
        pools[m] = paths
    return pools, cache.root


def main(argv: list[str] | None = None) -> dict:
    """Build the dataset; returns its manifest."""
    start = time.monotonic()
    args = parse_args(argv)
    # one process here: the parallel degrees of the training job do not matter to the data
    cfg = parse_job_config_or_exit(["--job.config_file", args.config,
                                    "--training.seq_len", str(args.seq_len),
                                    "--parallelism.expert_parallel_degree", "1",
                                    "--parallelism.ulysses_degree", "1", *args.overrides])
    try:
        root = dataset_root(cfg)
    except FileNotFoundError as e:  # no bundled dataset, and not allowed to build it
        raise OmniInputError(str(e)) from None
    tokenizer = build_omni_tokenizer(cfg)
    processors = build_processors(model_processing(cfg))
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(args.seed)
    texts, images, videos = _material(root, rng)
    budget = int(args.fill * args.seq_len)
    rows = []
    if args.workload == "realistic":
        cache_root = args.media_cache or os.path.join(os.path.dirname(os.path.abspath(root)),
                                                      "realistic_media")
        weights = parse_weights(args.modalities)
        missing = [m for m in weights if m not in processors]
        if missing:
            raise OmniInputError(f"{args.config} does not process {', '.join(missing)} "
                                 f"(model or data.modalities); drop it from --modalities")
        pools, media_dir = _realistic_pools(args, weights, root, rng, cache_root)
        stats = MediaStats(processors, media_dir)
        t0 = time.monotonic()
        done = stats.precompute([(m, p) for m, ps in pools.items() for p in ps], args.jobs)
        print(f"processed {done} media files for this config in {time.monotonic() - t0:.1f} s "
              f"({sum(map(len, pools.values())) - done} cached)")
        builder = DocumentBuilder(tokenizer, stats, args.out)
        text_pool, media_pools = Pool(texts), {m: Pool(ps) for m, ps in pools.items()}
        for _ in range(args.rows):
            rows.append(builder.build_realistic(budget, args.media_share, weights, text_pool,
                                                media_pools))
    else:
        stats = MediaStats(processors)
        builder = DocumentBuilder(tokenizer, stats, args.out)
        cycles = [itertools.cycle(x) for x in (texts, images, videos)]
        every = (args.image_every, args.video_every) if args.workload == "toy" else (0, 0)
        for _ in range(args.rows):
            rows.append(builder.build(budget, *cycles, *every))

    check = DocumentEncoder(tokenizer, stats.replay(), args.seq_len, args.out,
                            split_long_text=False)
    path = os.path.join(args.out, "train.jsonl")
    per_row = []
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            doc = encode_row(check, row, path, i, args.seq_len)
            per_row.append(row_stats(row, doc, stats, args.out))
            if not args.quiet:
                print(describe_row(i, per_row[-1]))
            f.write(json.dumps(row) + "\n")
    summary = summarize(per_row)
    lengths = [r["tokens"] for r in per_row]
    manifest = {
        "workload": args.workload, "seq_len": args.seq_len, "rows": args.rows,
        "config": args.config, "seed": args.seed, "fill": args.fill,
        "arguments": list(sys.argv[1:] if argv is None else argv),
        "tokens_per_row": _span(lengths),
        **{f"{ROW_KEYS[m]}_per_row": sum(len(r.get(ROW_KEYS[m]) or []) for r in rows) / args.rows
           for m in MEDIA},
        **summary, "per_row": per_row,
        "build_seconds": round(time.monotonic() - start, 1),
    }
    if args.workload == "realistic":
        manifest.update(media_share_target=args.media_share, modality_weights=weights,
                        media_cache=media_dir)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(describe_summary(summary, args.rows))
    print(f"{path}: {args.rows} {args.workload} rows, {manifest['tokens_per_row']['mean']:,.0f} "
          f"tokens/row (max {max(lengths):,} <= {args.seq_len:,}), built in "
          f"{manifest['build_seconds']} s")
    return manifest


if __name__ == "__main__":
    try:
        main()
    except OmniInputError as e:
        print(f"torchtitan-omni: error: {e}", file=sys.stderr)
        sys.exit(2)
