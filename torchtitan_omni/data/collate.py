"""Rows of documents -> the batch of ``torchtitan_omni.protocols.batch``.

Media items are concatenated in the order of their placeholders over the flattened ``B * S``
tokens (row 0 left to right, then row 1, ...), so encoder output rows line up with
``<modality>_embed_index``. A generated modality (registered with role "target") also gets
``<modality>_target_index``: the position before each pad predicts that pad's row.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtitan_omni.data.document import Document
from torchtitan_omni.data.processors import Item, Processor
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modality import get_modality

IGNORE = B.IGNORE_INDEX


def collate(
    rows: list[list[Document]], row_len: int, pad_id: int, processors: dict[str, Processor]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The ``(batch, labels)`` of rows of documents padded to ``row_len``."""
    n = len(rows)
    tokens = np.full((n, row_len), pad_id, dtype=np.int64)
    positions = np.zeros((n, row_len), dtype=np.int64)
    labels = np.full((n, row_len), IGNORE, dtype=np.int64)
    modalities = sorted({m for docs in rows for d in docs for m in d.media})
    embed = {m: np.full((n, row_len), -1, dtype=np.int64) for m in modalities}
    target = {m: np.full((n, row_len), -1, dtype=np.int64)
              for m in modalities if get_modality(m).is_target}
    items: dict[str, list[Item]] = {m: [] for m in modalities}
    rows_used = dict.fromkeys(modalities, 0)
    bounds = [0]
    real = 0
    for r, docs in enumerate(rows):
        offset = 0
        for doc in docs:
            length = len(doc)
            if offset + length > row_len:
                raise ValueError(
                    f"documents of {offset + length} tokens do not fit a row of {row_len}"
                )
            window = slice(offset, offset + length)
            tokens[r, window] = doc.tokens
            positions[r, window] = np.arange(length)
            labels[r, window] = doc.labels()
            for m, pads in doc.pad_positions.items():
                rows_of = rows_used[m] + np.arange(len(pads))
                embed[m][r, offset + pads] = rows_of
                if m in target:  # teacher forcing: the position before a pad predicts it
                    target[m][r, offset + pads - 1] = rows_of
            for m, its in doc.media.items():
                items[m].extend(its)
                rows_used[m] += sum(it.num_tokens for it in its)
            offset += length
            real += length
            bounds.append(r * row_len + offset)
        if offset < row_len:  # padding is a document of its own
            positions[r, offset:] = np.arange(row_len - offset)
            bounds.append((r + 1) * row_len)
    batch = {
        B.INPUT: torch.from_numpy(tokens),
        B.POSITION_IDS: torch.from_numpy(positions),
        B.CU_SEQLENS: torch.tensor(bounds, dtype=torch.int32),
        B.REAL_TOKENS: torch.tensor(real, dtype=torch.int64),
    }
    for m in modalities:
        batch[B.embed_index_key(m)] = torch.from_numpy(embed[m])
        for key, value in processors[m].collate(items[m]).items():
            batch[f"{m}_{key}"] = value
    for m, index in target.items():
        batch[B.target_index_key(m)] = torch.from_numpy(index)
    return batch, torch.from_numpy(labels)
