"""How a modality's media tensors divide into items (images, clips, speech clips): the item
contract that splitting, balancing and per-item costs rely on.

Items are recognised from the processing contract (``torchtitan_omni.protocols.processing``):
with a ``grid_thw`` tensor, an item owns ``t*h*w`` rows of every tensor whose first dimension
is the total patch count and one row of every tensor whose first dimension is the item count;
otherwise every tensor's first dimension is the item count.
"""

from __future__ import annotations

import torch


def item_rows(media: dict[str, torch.Tensor]) -> list[int]:
    """Rows (patches) each media item owns; one per item without ``grid_thw``."""
    grid = media.get("grid_thw")
    if grid is not None:
        return [int(x) for x in grid.prod(-1).tolist()]
    first = next(iter(media.values()))
    return [1] * first.shape[0]


def key_rows(media: dict[str, torch.Tensor], rows: list[int] | None = None) -> dict[str, list[int]]:
    """Leading rows of every tensor that each item owns: one of a per-item tensor, the item's
    patches of a per-patch tensor (see the module docstring). ``rows``: :func:`item_rows`."""
    rows = item_rows(media) if rows is None else rows
    n_items, n_rows = len(rows), sum(rows)
    out = {}
    for key, t in media.items():
        if t.dim() == 0:
            raise ValueError(f"media tensor {key!r} is a scalar; cannot split it between ranks")
        if t.shape[0] == n_items:
            out[key] = [1] * n_items
        elif t.shape[0] == n_rows:
            out[key] = list(rows)
        else:
            raise ValueError(
                f"media tensor {key!r} has {t.shape[0]} rows, neither the {n_items} items nor "
                f"their {n_rows} patches; cannot split it between ranks (use "
                "sequence_parallel = \"replicate\" for this encoder)"
            )
    return out


def slice_items(media: dict[str, torch.Tensor], start: int, end: int,
                rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Items ``[start, end)`` of a modality's media (see the module docstring). ``rows``:
    :func:`item_rows` when the caller has them (no second read of a device grid)."""
    out = {}
    for key, spans in key_rows(media, rows).items():
        out[key] = media[key][sum(spans[:start]):sum(spans[:end])]
    return out
