"""A host batch as the omni model's forward arguments, shared by training and validation."""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtitan_omni.modules.host import to_device
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta


class ModelInputs(NamedTuple):
    """``OmniModel.forward``'s arguments for one micro-batch, on the device: ``tokens``,
    ``meta``, ``labels``, ``media`` (its keyword arguments) and ``labelled``, the flat indices
    of the labelled positions (``labels != IGNORE_INDEX``), found on the host so that the
    text loss picks them without waiting for the device."""

    tokens: torch.Tensor
    meta: AttentionMeta
    labels: torch.Tensor
    media: dict[str, torch.Tensor]
    labelled: torch.Tensor


def model_inputs(
    batch: dict[str, torch.Tensor], labels: torch.Tensor, device: torch.device
) -> ModelInputs:
    """:class:`ModelInputs` on ``device`` from a (local, possibly SP-sliced) host batch; the
    document layout and the labelled positions are read on the host before the copy."""
    cu = batch[B.CU_SEQLENS]
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    whole_rows = B.whole_rows(cu, labels.shape[0], batch.get(B.REAL_TOKENS))
    # item sizes stay on the host: the encoders read them there (B.is_item_sizes)
    moved = {k: v if B.is_item_sizes(k, v) else v.to(device, non_blocking=True)
             for k, v in batch.items() if isinstance(v, torch.Tensor)}
    meta = AttentionMeta(
        cu_seqlens=moved.pop(B.CU_SEQLENS), max_seqlen=max_seqlen,
        position_ids=moved.pop(B.POSITION_IDS), whole_rows=whole_rows,
    )
    moved.pop(B.REAL_TOKENS, None)
    tokens = moved.pop(B.INPUT)
    labelled = torch.nonzero(labels.flatten() != B.IGNORE_INDEX).flatten()
    return ModelInputs(tokens, meta, labels.to(device, non_blocking=True), moved,
                       to_device(labelled, device))
