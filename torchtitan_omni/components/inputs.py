"""A host batch as the omni model's forward arguments, shared by training and validation."""

from __future__ import annotations

import torch

from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta


def model_inputs(
    batch: dict[str, torch.Tensor], labels: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, AttentionMeta, torch.Tensor, dict[str, torch.Tensor]]:
    """``(tokens, meta, labels, media)`` on ``device`` for ``OmniModel.forward`` from a (local,
    possibly SP-sliced) host batch; the document layout is read on the host before the copy."""
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
    return tokens, meta, labels.to(device, non_blocking=True), moved
