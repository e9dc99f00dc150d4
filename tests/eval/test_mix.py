"""Document modality mixes: each position gets the mix of its own packed document."""

import pytest
import torch

from torchtitan_omni.eval.mix import document_mix, mix_name
from torchtitan_omni.protocols import batch as B

MODALITIES = ("image", "video", "audio", "gen_image")


def test_each_document_gets_its_own_mix():
    # Row 0: a text document [0, 3), an image+audio document [3, 7), padding [7, 8).
    # Row 1: a generation document [8, 13), a video document [13, 16).
    image = torch.full((2, 8), -1)
    image[0, 4] = 0
    audio = torch.full((2, 8), -1)
    audio[0, 5:7] = torch.tensor([0, 1])
    gen = torch.full((2, 8), -1)
    gen[1, 2:4] = torch.tensor([0, 1])
    video = torch.full((2, 8), -1)
    video[1, 6] = 0
    batch = {
        B.CU_SEQLENS: torch.tensor([0, 3, 7, 8, 13, 16], dtype=torch.int32),
        B.embed_index_key("image"): image, B.embed_index_key("audio"): audio,
        B.embed_index_key("gen_image"): gen, B.embed_index_key("video"): video,
    }
    mix = document_mix(batch, torch.zeros(2, 8, dtype=torch.long), MODALITIES)
    names = [[mix_name(int(b), MODALITIES) for b in row] for row in mix]
    assert names[0] == ["text_only"] * 3 + ["image+audio"] * 4 + ["text_only"]
    assert names[1] == ["generation"] * 5 + ["video"] * 3


def test_batch_without_media_is_text_only_and_bad_bounds_are_refused():
    batch = {B.CU_SEQLENS: torch.tensor([0, 4], dtype=torch.int32)}
    mix = document_mix(batch, torch.zeros(1, 4, dtype=torch.long), MODALITIES)
    assert mix.tolist() == [[0] * 4]
    with pytest.raises(ValueError, match="cu_seqlens cover 4 positions"):
        document_mix(batch, torch.zeros(1, 6, dtype=torch.long), MODALITIES)
