"""Held-out task metrics of a trained model on a dataset split (``scripts/eval_metrics.py``).

Each row of the split is parsed as in training and scored by its kind:

- a conversation with images, video or audio: the turns before its last assistant turn are the
  prompt; the answer is decoded greedily (``Generator.answer``, KV cache) and compared with the
  reference (:func:`~torchtitan_omni.eval.metrics.answer_accuracy`; audio rows also get the
  transcription :func:`~torchtitan_omni.eval.metrics.token_accuracy`);
- plain text: teacher-forced text loss (the model's own forward), pooled into a perplexity;
- image generation: the image decoder's teacher-forced argmax code at every code position
  against the VQ codes of the reference image (code accuracy);

and :func:`sample_grid` draws images for fixed captions into one PNG.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
import torch

from torchtitan_omni.components.inputs import model_inputs
from torchtitan_omni.data.bad_samples import BadSample
from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.sample import Sample, parse_row
from torchtitan_omni.data.source import RowSource, find_files
from torchtitan_omni.eval import metrics as M
from torchtitan_omni.modules.host import hold_on_host
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modality import modalities

#: captions of the sample grid, in the bundled dataset's wording (one digit per colour)
FIXED_CAPTIONS = tuple(f"Draw a {c} {d}." for d, c in enumerate(
    ("red", "green", "blue", "yellow", "white", "orange", "purple", "cyan")))


@dataclass
class HeldOut:
    """One parsed row of the split and the file (task) it came from."""

    task: str
    sample: Sample


def kind_of(sample: Sample) -> str:
    """``text``, ``generation``, ``chat`` (no media), or the understanding modalities of a
    conversation joined by ``+`` (``image``, ``video``, ``audio``, ``image+audio``...)."""
    if sample.media.get(B.GEN_IMAGE):
        return "generation"
    # understanding modalities, in registration order (the order a mixed row is named by)
    found = [m.name for m in modalities() if not m.is_target and sample.media.get(m.name)]
    if found:
        return "+".join(found)
    return "text" if sample.turns is None else "chat"


def read_split(root: str, split: str, limit: int = 0, fmt: str = "auto") -> list[HeldOut]:
    """The parseable rows of ``split`` under ``root`` in file order, the first ``limit`` of
    each file (0: all)."""
    out = []
    for file in find_files(root, split):
        source = RowSource([file], fmt, shuffle=False)
        # a class folder (ImageNet layout) belongs to its split's one task, not a task per class
        task = Path(file).parent.name if os.path.isdir(file) else Path(file).name.split(".")[0]
        for i in range(len(source) if not limit else min(limit, len(source))):
            row, src = source.row(i)
            try:
                out.append(HeldOut(task, parse_row(row, src)))
            except BadSample:
                continue  # the loader would skip it too
    return out


def split_by_modalities(items: Sequence[HeldOut], enabled) -> tuple[list[HeldOut], dict]:
    """The items whose media the model can read (every modality in ``enabled``), and the count
    of the others per task file (e.g. a vision-only model's ``test-speech`` rows)."""
    kept: list[HeldOut] = []
    skipped: defaultdict[str, int] = defaultdict(int)
    for item in items:
        if all(m in enabled for m, refs in item.sample.media.items() if refs):
            kept.append(item)
        else:
            skipped[item.task] += 1
    return kept, dict(skipped)


def prompt_and_reference(sample: Sample) -> tuple[Sample, str] | None:
    """The sample cut before its last assistant turn, and that turn's text (None when the
    conversation does not end with an assistant turn)."""
    if not sample.turns or sample.turns[-1].role != "assistant":
        return None
    prompt = Sample(sample.source, turns=sample.turns[:-1], media=sample.media)
    return prompt, sample.turns[-1].text


@dataclass
class TaskReport:
    """Metric values and each answered row (task, kind, reference, prediction)."""

    metrics: dict[str, float] = field(default_factory=dict)
    answers: list[dict] = field(default_factory=list)


class TaskEvaluator:
    """Scores held-out rows with a :class:`~torchtitan_omni.generate.Generator`'s model."""

    def __init__(self, generator, root: str, seq_len: int, max_new_tokens: int = 48) -> None:
        self.gen = generator
        self.root = root
        self.max_new_tokens = max_new_tokens
        # no caption drop: the held-out prompt is scored as written
        self.encoder = DocumentEncoder(generator.tok, generator.processors, seq_len, root,
                                       gen_cfg_drop_prob=0.0)

    def _batches(self, sample: Sample) -> Iterator[tuple]:
        """Forward inputs of each document of the sample, one per row."""
        for doc in self.encoder.encode(sample, random.Random(0)):
            batch, labels = collate([[doc]], len(doc), self.gen.tok.special.pad,
                                    self.gen.processors)
            yield model_inputs(batch, labels, self.gen.device)

    @torch.no_grad()
    def answers(self, items: Sequence[HeldOut]) -> TaskReport:
        """Greedy answers of the conversations with media, and their accuracies."""
        report = TaskReport()
        grouped: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        for item in items:
            kind = kind_of(item.sample)
            cut = prompt_and_reference(item.sample) if kind not in ("text", "generation") else None
            if cut is None:
                continue
            prompt, reference = cut
            ids = self.gen.answer(self.gen.sample_batch(prompt, self.root), self.max_new_tokens,
                                  temperature=0.0)
            prediction = self.gen.tok.decode(ids).strip()
            report.answers.append({"task": item.task, "kind": kind, "reference": reference,
                                   "prediction": prediction})
            # per kind (image_answer_accuracy, ...) and per data file (answer_accuracy/<file>)
            for key in (f"{kind}_answer_accuracy", f"answer_accuracy/{item.task}"):
                grouped[key][0].append(prediction)
                grouped[key][1].append(reference)
        for key, (preds, refs) in grouped.items():
            report.metrics[key] = M.answer_accuracy(preds, refs)
        if f"{B.AUDIO}_answer_accuracy" in grouped:
            report.metrics["speech_token_accuracy"] = M.token_accuracy(
                *grouped[f"{B.AUDIO}_answer_accuracy"])
        return report

    @torch.no_grad()
    def text_perplexity(self, items: Sequence[HeldOut]) -> float | None:
        """Perplexity of the plain-text rows (teacher forced; None without any)."""
        model = self.gen.model
        nll, count = 0.0, 0
        for item in items:
            if kind_of(item.sample) != "text":
                continue
            for tokens, meta, labels, media, labelled in self._batches(item.sample):
                out = model(tokens, meta, labels, labelled=labelled, **hold_on_host(media))
                nll += float(out.losses["text"])
                count += int((labels != B.IGNORE_INDEX).sum())
        return M.perplexity(nll, count) if count else None

    @torch.no_grad()
    def code_logits(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """The image decoder's teacher-forced logits at every code position of a generation
        sample, and the reference image's codes there (``[n, codebook]``, ``[n]``)."""
        model = self.gen.model
        decoder = model.decoder(B.GEN_IMAGE)
        logits, codes = [], []
        for tokens, meta, _, media, _ in self._batches(sample):
            h, targets = model.embed(tokens, media)
            hidden = model.llm(h, meta)
            index = media[B.target_index_key(B.GEN_IMAGE)]
            at = index >= 0
            logits.append(decoder.logits(hidden[at]))
            codes.append(targets[B.GEN_IMAGE].reshape(-1)[index[at]])
        return torch.cat(logits), torch.cat(codes)

    def code_accuracy(self, items: Sequence[HeldOut]) -> float | None:
        """Teacher-forced argmax accuracy of the image decoder's codes on the generation rows
        (None without any, or without an image decoder)."""
        if B.GEN_IMAGE not in self.gen.model.decoders:
            return None
        predicted, wanted = [], []
        for item in items:
            if kind_of(item.sample) == "generation":
                logits, codes = self.code_logits(item.sample)
                predicted.append(logits.argmax(-1))
                wanted.append(codes)
        if not predicted:
            return None
        return M.code_accuracy(torch.cat(predicted), torch.cat(wanted))


def sample_grid(generator, path: str, captions: Sequence[str] = FIXED_CAPTIONS,
                cfg_scale: float = 5.0, temperature: float = 1.0, top_k: int = 0,
                seed: int = 0, columns: int = 4) -> str:
    """One image per caption (seeded sampling with guidance) written as a PNG grid."""
    rng = torch.Generator(device=generator.device).manual_seed(seed)
    images = torch.cat([generator.images(c, num_images=1, cfg_scale=cfg_scale,
                                         temperature=temperature, top_k=top_k, generator=rng)
                        for c in captions])
    Image.fromarray(M.image_grid(images, columns)).save(path)
    return path
