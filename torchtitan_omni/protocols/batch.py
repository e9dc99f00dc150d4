"""The batch contract between the data pipeline, the trainer and the omni model.

The dataloader yields ``(batch, labels)`` as TorchTitan expects. ``batch`` is a flat
``dict[str, Tensor]``:

Token-aligned tensors, shape ``[B, S]`` (sliced along S by sequence parallelism):

- ``input``: int64 token ids. Media positions hold the modality's placeholder token id.
- ``position_ids``: int64, restarting at 0 for every packed document (RoPE positions).
- ``<modality>_embed_index``: int64, for each position the row of that modality's embedding
  table (the encoder's ``lm_encode`` output, or a decoder's ``lm_embed`` output) placed
  there, ``-1`` elsewhere. Rows are numbered over the whole local batch.
- ``<decoder>_target_index``: int64, for each position the row of that decoder's targets that
  the hidden state at this position predicts, ``-1`` elsewhere.
- ``labels`` (passed separately, as in TorchTitan): int64 next-token text targets with
  ``IGNORE_INDEX`` (-100) on prompts, padding, media and document ends.

Sequence-level tensors (never sliced):

- ``cu_seqlens``: int32 ``[D + 1]`` boundaries of the documents over the flattened ``B * S``
  tokens; padding forms documents of its own, so attention never crosses a document.
- ``real_tokens``: int64 scalar, the number of non-padding tokens (throughput counts these).

Media tensors, named ``<modality>_<what>`` and defined by the modality's processor (for
instance ``image_patches`` and ``image_grid_thw``); they belong to the encoder or decoder that
declares the modality and are never sliced. Their integer tensors describe the items (grids,
lengths: :func:`is_item_sizes`) and stay on the host when the batch moves to the device, so
the encoders read them without waiting for the device (``torchtitan_omni.modules.host``);
an encoder must accept them on either side (generation moves everything).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

INPUT = "input"
POSITION_IDS = "position_ids"
CU_SEQLENS = "cu_seqlens"
REAL_TOKENS = "real_tokens"

# The built-in modalities. Every modality, these included, is described and registered in
# ``torchtitan_omni.protocols.modality``; read the registry, not this list.
IMAGE = "image"
VIDEO = "video"
AUDIO = "audio"
GEN_IMAGE = "gen_image"  # image generation: not prefixed "image_" so media keys stay apart
#: the built-ins in the frozen order of their special tokens (existing tokenizers' ids)
MODALITIES = (IMAGE, VIDEO, AUDIO, GEN_IMAGE)


def embed_index_key(modality: str) -> str:
    """Batch key of the per-position row index into ``modality``'s embedding table."""
    return f"{modality}_embed_index"


def target_index_key(decoder: str) -> str:
    """Batch key of the per-position row index into ``decoder``'s targets."""
    return f"{decoder}_target_index"


def is_token_aligned(key: str) -> bool:
    """Whether a batch tensor is laid out ``[B, S]`` along the token sequence."""
    return key in (INPUT, POSITION_IDS) or key.endswith(("_embed_index", "_target_index"))


def is_item_sizes(key: str, value: torch.Tensor) -> bool:
    """Whether a batch tensor is a media tensor of item sizes (an integer tensor that is not
    token-aligned, e.g. ``image_grid_thw``, ``audio_lengths``): kept on the host."""
    return (not value.is_floating_point() and not is_token_aligned(key)
            and key not in (CU_SEQLENS, REAL_TOKENS))


def media(batch: dict[str, torch.Tensor], modality: str) -> dict[str, torch.Tensor]:
    """The media tensors of one modality, with the ``<modality>_`` prefix removed."""
    prefix = modality + "_"
    out = {}
    for key, value in batch.items():
        if key.startswith(prefix) and not is_token_aligned(key):
            out[key[len(prefix):]] = value
    return out


def whole_rows(cu_seqlens: torch.Tensor, rows: int, real_tokens: torch.Tensor | None) -> bool:
    """Whether every one of ``rows`` equal rows holds a single document followed only by
    padding, read from a batch's (host) ``cu_seqlens`` and ``real_tokens``.

    Padding forms the last document of its row, so rows of at most two documents qualify when
    their first documents together hold every real token.
    """
    if real_tokens is None or rows < 1 or cu_seqlens.device.type != "cpu":
        return False
    bounds = cu_seqlens.tolist()
    if bounds[-1] % rows:
        return False
    row_len = bounds[-1] // rows
    per_row = [0] * rows
    firsts = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        r = start // row_len
        if end > (r + 1) * row_len:
            return False  # not this contract's layout
        if start == r * row_len:
            firsts += end - start
        per_row[r] += 1
    return max(per_row) <= 2 and firsts == int(real_tokens)
