"""Encoders under Ulysses sequence parallel.

The SP ranks of a data-parallel group hold the same batch (each keeps a slice of the token
sequence), hence the same media. Two ways keep the encoders correct:

- ``"replicate"`` (default, nothing installed): every SP rank encodes all media and keeps the
  rows its slice's placeholders ask for. Gradients of rows outside the slice are zero, and
  FSDP sums encoder gradients over the SP ranks. Costs SP x the encoder compute.
- ``"split"`` (:func:`install_split_encoders`: the :class:`SplitMediaEncoder` mixin): SP rank r
  encodes a contiguous share of the media items (balanced by patch/row count), and the
  embeddings are gathered on every SP rank (:func:`torchtitan_omni.distributed.comm
  .gather_rows`, whose backward sums each item's row gradients over the SP ranks). Each rank
  encodes ~1/SP of the media. Needs encoders that treat items independently (true of the
  vision, SigLIP and Whisper-style encoders: per-item attention); a rank without items encodes
  the encoder's dummy item times zero so that FSDP's collectives still match.

Items are cut by the item contract of ``torchtitan_omni.protocols.media_items``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_omni.distributed.comm import ProcessGroup, gather_rows
from torchtitan_omni.modules.wrapping import extend_class
from torchtitan_omni.protocols.media_items import item_rows, slice_items


def split_bounds(costs: list[int], parts: int) -> list[int]:
    """``parts + 1`` item boundaries splitting ``costs`` into contiguous, balanced shares."""
    total = sum(costs)
    bounds, acc, item = [0], 0, 0
    for p in range(1, parts):
        target = total * p / parts
        while item < len(costs) and acc + costs[item] / 2 <= target:
            acc += costs[item]
            item += 1
        bounds.append(item)
    bounds.append(len(costs))
    return bounds


class SplitMediaEncoder(nn.Module):
    """Mixin: the encoder encodes its share of the media items over ``_omni_sp_group`` and
    gathers every rank's embeddings (see the module docstring)."""

    _omni_sp_group: ProcessGroup

    def forward(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        group = self._omni_sp_group
        rank, degree = dist.get_rank(group), group.size()
        bounds = split_bounds(item_rows(media), degree)
        start, end = bounds[rank], bounds[rank + 1]
        if end > start:
            local = super().forward(slice_items(media, start, end), modality)
        else:
            device = next(iter(media.values())).device
            dummy = super().forward(self.dummy_media(modality, device), modality)
            local = dummy[:0]  # no rows, but every parameter is in the graph (zero gradients)
        sizes = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
        gathered = [torch.empty_like(sizes) for _ in range(degree)]
        dist.all_gather(gathered, sizes, group=group)
        return gather_rows(local, [int(s) for s in torch.cat(gathered).tolist()], group)


def install_split_encoders(encoders: Mapping[str, nn.Module], group: ProcessGroup) -> list[str]:
    """Make each encoder split its media items over ``group``; returns their names."""
    for encoder in encoders.values():
        extend_class(encoder, SplitMediaEncoder, _omni_sp_group=group)
    return list(encoders)
