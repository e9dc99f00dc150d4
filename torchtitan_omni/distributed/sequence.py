"""Splitting a packed batch between Ulysses sequence-parallel ranks.

Every SP rank of a data-parallel group loads the same batch; each keeps one contiguous slice
of the token-aligned tensors. Sequence-level tensors (``cu_seqlens``) and media stay whole:
attention runs over the full sequence after the all-to-all (``ulysses.py``), and the encoders
see all media of the batch (each SP rank encodes all of it, or a share of the items with the
embeddings gathered: ``encoder_sp.py``); the slice's ``<modality>_embed_index`` picks the rows
its placeholders ask for.
"""

from __future__ import annotations

import torch

from torchtitan_omni.protocols import batch as B


def shard_sequence(
    batch: dict[str, torch.Tensor], labels: torch.Tensor, rank: int, degree: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This SP rank's slice of the token-aligned tensors of ``batch`` and of ``labels``."""
    if degree == 1:
        return batch, labels
    seq_len = labels.shape[1]
    if seq_len % degree:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of the Ulysses degree {degree}; "
            "the data pipeline pads rows to a multiple of it"
        )
    chunk = seq_len // degree
    window = slice(rank * chunk, (rank + 1) * chunk)
    out = {}
    for key, value in batch.items():
        out[key] = value[:, window] if B.is_token_aligned(key) else value
    return out, labels[:, window]
