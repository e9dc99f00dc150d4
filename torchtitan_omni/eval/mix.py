"""The input modality mix of each packed document, for per-mix validation losses.

A document's mix is the set of modalities placed in it (an encoder's or decoder's
``<modality>_embed_index`` is set somewhere inside it): none is ``text_only``, one is e.g.
``image``, several are joined, e.g. ``image+audio``. Mixes are numbered by a bitmask over the
model's modalities, so every rank numbers them alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchtitan_omni.protocols import batch as B

TEXT_ONLY = "text_only"
#: how a modality is named in a mix (image generation reads better as "generation")
DISPLAY = {B.GEN_IMAGE: "generation"}


def mix_name(bits: int, modalities: Sequence[str]) -> str:
    """The name of mix ``bits`` (bit ``i`` is ``modalities[i]``)."""
    names = [DISPLAY.get(m, m) for i, m in enumerate(modalities) if bits >> i & 1]
    return "+".join(names) or TEXT_ONLY


def document_mix(batch: dict[str, torch.Tensor], labels: torch.Tensor,
                 modalities: Sequence[str]) -> torch.Tensor:
    """``[B, S]`` int64 like ``labels``: the mix bitmask of the document of each position.

    ``batch`` is a whole (not sequence-sliced) host batch: its ``cu_seqlens`` cover the
    flattened ``B * S`` positions."""
    rows, seq = labels.shape
    cu = batch[B.CU_SEQLENS].long()
    lengths = cu[1:] - cu[:-1]
    if int(lengths.sum()) != rows * seq:
        raise ValueError(f"cu_seqlens cover {int(lengths.sum())} positions, the batch has "
                         f"{rows} x {seq}")
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    bits = torch.zeros(len(lengths), dtype=torch.long)
    for i, modality in enumerate(modalities):
        index = batch.get(B.embed_index_key(modality))
        if index is None:
            continue
        placed = (index.reshape(-1) >= 0).long()
        in_doc = torch.zeros_like(bits).scatter_reduce_(0, doc, placed, "amax")
        bits |= in_doc << i
    return bits[doc].view(rows, seq)
