"""A :class:`Sample` -> packed-ready :class:`Document`: tokens, label flags, media items.

The layout is ``torchtitan_omni.data.template``'s. Each token carries a flag saying whether it
is a text *target* (the label of the position before it): assistant content and its end of
turn, and all plain text, are; prompts (unless ``mask_prompt_labels`` is off), role markers,
bos, media pads and end tokens never are. The start token of a generated item (a modality
registered with role "target", e.g. ``<gen_image_start>``) is a target (the text head learns
to start an image); its pads and end token are not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from torchtitan_omni.data.bad_samples import MODALITY_DISABLED, NO_TARGETS, TOO_LONG, BadSample
from torchtitan_omni.data.processors import Item, Processor
from torchtitan_omni.data.sample import Sample, split_placeholders
from torchtitan_omni.data.template import drop_prompt
from torchtitan_omni.protocols.modality import get_modality


@dataclass
class Document:
    """One packable unit: at most ``seq_len`` tokens and the media they refer to."""

    tokens: np.ndarray  # int64 [L]
    targets: np.ndarray  # bool [L]: token i is the label of position i - 1
    #: modality -> items, in placeholder order
    media: dict[str, list[Item]] = field(default_factory=dict)
    #: modality -> positions of its pad tokens, in order (one embedding row each)
    pad_positions: dict[str, np.ndarray] = field(default_factory=dict)
    #: positions of the start tokens of generated items (``<gen_image_start>``), one per item
    gen_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: (epoch, q, chunk, shard index, shard count) identifying the document for resumption
    key: tuple = ()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def labels(self) -> np.ndarray:
        """Next-token labels with ``-100`` where the next token is not a target."""
        out = np.full(len(self), -100, dtype=np.int64)
        nxt = self.tokens[1:]
        out[:-1] = np.where(self.targets[1:], nxt, -100)
        return out


class DocumentEncoder:
    """Tokenizes samples, runs the media processors and expands placeholders."""

    def __init__(
        self, tokenizer, processors: dict[str, Processor], seq_len: int, root: str,
        mask_prompt_labels: bool = True, gen_cfg_drop_prob: float = 0.0,
        split_long_text: bool = True,
    ) -> None:
        self.tok = tokenizer
        self.sp = tokenizer.special
        self.processors = processors
        self.seq_len = seq_len
        self.root = root
        self.mask_prompt = mask_prompt_labels
        self.cfg_drop = gen_cfg_drop_prob
        self.split_long_text = split_long_text

    def _items(self, sample: Sample) -> dict[str, list[list[Item]]]:
        """Processed items per modality and placeholder."""
        out = {}
        for modality, refs in sample.media.items():
            proc = self.processors.get(modality)
            if proc is None:
                raise BadSample(
                    MODALITY_DISABLED,
                    f"needs {modality}, which the model does not declare or data.modalities "
                    f"excludes (enabled: {', '.join(self.processors) or 'text only'})",
                    sample.source,
                )
            out[modality] = [proc(ref, self.root, sample.source) for ref in refs]
        return out

    def require_targets(self, sample: Sample, docs: list[Document]) -> None:
        """Raise :class:`BadSample` (``no_targets``) when ``docs`` train nothing but closing
        tokens: e.g. a conversation without an assistant answer, whose prompts are masked."""
        closers = [self.sp.eos, self.sp.end_of_turn]
        if any((d.targets & ~np.isin(d.tokens, closers)).any() for d in docs):
            return
        if sample.turns is None:
            why = "the text holds only media placeholders"
        elif self.mask_prompt:
            why = ("no assistant turn has content (system and user turns are prompts, not "
                   "trained: data.mask_prompt_labels)")
        else:
            why = "no turn has text content"
        raise BadSample(NO_TARGETS, f"nothing to train on: {why}", sample.source)

    def encode(self, sample: Sample, rng: random.Random) -> list[Document]:
        """The sample's document (or, for long plain text, its ``seq_len`` chunks)."""
        items = self._items(sample)
        pieces = []  # (role, piece) with piece a str or (modality,)
        for role, text in sample.segments():
            pieces.append((role, None))  # turn opening
            pieces.extend((role, p) for p in split_placeholders(text))
            pieces.append((role, "__end__"))
        texts = [p for _, p in pieces if isinstance(p, str) and p != "__end__"]
        encoded = iter(self.tok.encode_texts(texts))

        tokens, targets = [self.sp.bos], [False]
        media: dict[str, list[Item]] = {m: [] for m in items}
        pads: dict[str, list[int]] = {m: [] for m in items}
        next_item = dict.fromkeys(items, 0)
        gen_starts: list[int] = []
        first_understanding = None
        trained = False
        for role, piece in pieces:
            chat = role != "text"
            trained = (not chat) or role == "assistant" or not self.mask_prompt
            if piece is None:
                if chat:
                    tokens.append(self.sp.role(role))
                    targets.append(False)
            elif piece == "__end__":
                if chat:
                    tokens.append(self.sp.end_of_turn)
                    targets.append(trained)
            elif isinstance(piece, str):
                ids = next(encoded)
                tokens.extend(ids)
                targets.extend([trained] * len(ids))
            else:
                modality = piece[0]
                group = items[modality][next_item[modality]]
                next_item[modality] += 1
                start, pad, end = self.sp.media_ids(modality)
                n = sum(it.num_tokens for it in group)
                generated = get_modality(modality).is_target
                if generated:
                    gen_starts.append(len(tokens))
                elif first_understanding is None:
                    first_understanding = len(tokens)
                tokens.append(start)
                targets.append(trained and generated)
                pads[modality].extend(range(len(tokens), len(tokens) + n))
                tokens.extend([pad] * n)
                tokens.append(end)
                targets.extend([False] * (n + 1))
                media[modality].extend(group)
        tokens.append(self.sp.eos)
        targets.append(trained)

        if gen_starts and self.cfg_drop > 0 and rng.random() < self.cfg_drop:
            stop = gen_starts[0]
            if first_understanding is None or first_understanding > stop:
                tokens = drop_prompt(tokens, self.sp.pad, stop)

        doc = Document(
            np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=bool),
            {m: v for m, v in media.items() if v},
            {m: np.asarray(v, dtype=np.int64) for m, v in pads.items() if v},
            np.asarray(gen_starts, dtype=np.int64),
        )
        if len(doc) <= self.seq_len:
            return [doc]
        if sample.text is not None and not sample.media and self.split_long_text:
            return [
                Document(doc.tokens[i:i + self.seq_len], doc.targets[i:i + self.seq_len])
                for i in range(0, len(doc), self.seq_len)
            ]
        raise BadSample(
            TOO_LONG, f"{len(doc)} tokens after placeholder expansion, more than "
            f"training.seq_len={self.seq_len}", sample.source,
        )
