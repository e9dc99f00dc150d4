"""``components.inputs.model_inputs``: what moves to the device and what stays on the host."""

import torch

from torchtitan_omni.components.inputs import model_inputs
from torchtitan_omni.protocols import batch as B


def test_item_sizes_stay_on_the_host():
    """Token-aligned tensors and media data move to the device; the media's integer item sizes
    (grids, lengths) stay on the host, where the encoders read them without a device wait.
    The "meta" device stands in for a GPU: whatever moved reports it."""
    s = 8
    batch = {
        B.INPUT: torch.zeros(1, s, dtype=torch.long),
        B.POSITION_IDS: torch.arange(s).unsqueeze(0),
        B.CU_SEQLENS: torch.tensor([0, 5, s], dtype=torch.int32),
        B.REAL_TOKENS: torch.tensor(5),
        "image_patches": torch.randn(16, 12),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        B.embed_index_key("image"): torch.full((1, s), -1),
        "audio_features": torch.randn(1, 4, 6),
        "audio_lengths": torch.tensor([6]),
    }
    labels = torch.zeros(1, s, dtype=torch.long)
    meta_device = torch.device("meta")
    tokens, meta, labels_out, media = model_inputs(batch, labels, meta_device)
    assert tokens.is_meta and labels_out.is_meta and meta.cu_seqlens.is_meta
    assert meta.position_ids.is_meta and meta.max_seqlen == 5
    assert media["image_patches"].is_meta and media["audio_features"].is_meta
    assert media[B.embed_index_key("image")].is_meta
    assert media["image_grid_thw"].device.type == "cpu"
    assert media["audio_lengths"].device.type == "cpu"
    assert set(media) == {"image_patches", "image_grid_thw", B.embed_index_key("image"),
                          "audio_features", "audio_lengths"}
