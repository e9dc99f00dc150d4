"""Qwen2-VL style vision encoder: rows per item match the processor, packed attention keeps
items apart, the patch layout and the outputs match Hugging Face's Qwen2-VL."""

import numpy as np
import pytest
import torch

from tests.encoders.hf_utils import (
    check_init_covers_everything, load_with_adapter, randomize_, rel_err, write_hf_checkpoint,
)
from torchtitan_omni.encoders.blocks import apply_rotary, packed_meta
from torchtitan_omni.encoders.vision import (
    VisionArgs, VisionEncoder, VisionRotary2D, merge_window_positions, patchify,
)
from torchtitan_omni.modules.init import init_context

LLM_DIM = 24


def tiny_args(**kw) -> VisionArgs:
    base = dict(dim=32, depth=2, n_heads=2, mlp_ratio=2.0, patch_size=4, merge_size=2,
                temporal_patch_size=2, image_min_pixels=8 * 8, image_max_pixels=32 * 32,
                video_min_pixels=8 * 8, video_max_pixels=16 * 16, video_max_frames=6)
    base.update(kw)
    return VisionArgs(**base)


def build(args=None, dtype=torch.float64) -> VisionEncoder:
    torch.manual_seed(0)
    enc = VisionEncoder(args or tiny_args(), LLM_DIM)
    with init_context(enc, seed=0):
        enc.init_weights()
    randomize_(enc, seed=1)
    return enc.to(dtype)


def items_media(enc, frames_list, dtype=torch.float64):
    a = enc.args
    patches, grids = [], []
    for frames in frames_list:
        p, g = patchify(frames, a.patch_size, a.merge_size, a.temporal_patch_size)
        patches.append(p)
        grids.append(g)
    return {
        "patches": torch.cat(patches).to(dtype),
        "grid_thw": torch.tensor(grids, dtype=torch.long),
    }


def test_rows_match_processor_for_images_and_videos():
    enc = build()
    g = torch.Generator().manual_seed(0)
    for modality, items in (
        ("image", [(30, 50, 1), (17, 100, 1), (64, 64, 1), (5, 5, 1)]),
        ("video", [(40, 60, 1), (20, 20, 3), (33, 17, 4), (16, 16, 5)]),
    ):
        proc = enc.processing(modality)
        frames_list, expected = [], []
        for height, width, n_frames in items:
            h, w = proc.resized_hw(height, width)
            frames_list.append(torch.randn(n_frames, 3, h, w, generator=g))
            expected.append(proc.num_tokens(h, w, n_frames))
        out = enc(items_media(enc, frames_list), modality)
        assert out.shape == (sum(expected), LLM_DIM), (modality, out.shape, expected)


def test_packed_equals_per_item_and_items_stay_apart():
    enc = build()
    g = torch.Generator().manual_seed(1)
    frames = [torch.randn(1, 3, 16, 24, generator=g), torch.randn(3, 3, 8, 8, generator=g),
              torch.randn(1, 3, 32, 8, generator=g)]
    packed = enc(items_media(enc, frames), "video")
    single = torch.cat([enc(items_media(enc, [f]), "video") for f in frames])
    assert torch.allclose(packed, single, rtol=0, atol=1e-12)

    changed = list(frames)
    changed[1] = torch.randn(3, 3, 8, 8, generator=g)
    out = enc(items_media(enc, changed), "video")
    n0 = 1 * 4 * 6 // 4
    n1 = 2 * 2 * 2 // 4
    assert torch.equal(out[:n0], packed[:n0]) and torch.equal(out[n0 + n1:], packed[n0 + n1:])
    assert not torch.allclose(out[n0:n0 + n1], packed[n0:n0 + n1])


@pytest.mark.parametrize("span", ["frame", "item"])
def test_attention_span_of_a_video(span):
    enc = build(tiny_args(attention_span=span))
    g = torch.Generator().manual_seed(2)
    video = torch.randn(4, 3, 8, 8, generator=g)  # two temporal patches of 2x2 patches
    out = enc(items_media(enc, [video]), "video")
    later = video.clone()
    later[2:] = torch.randn(2, 3, 8, 8, generator=g)
    out2 = enc(items_media(enc, [later]), "video")
    first_window_same = torch.equal(out[0], out2[0])
    assert first_window_same == (span == "frame")


def test_patch_layout_matches_hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        do_convert_rgb=False,
    )
    img = np.random.default_rng(0).random((16, 24, 3)).astype(np.float32)
    ref = hf(images=[img], return_tensors="pt")
    ours, grid = patchify(torch.from_numpy(img).permute(2, 0, 1)[None], 4, 2, 2)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert torch.equal(ours, ref["pixel_values"].float())


def test_data_pipeline_uses_the_same_patch_layout():
    image = pytest.importorskip("torchtitan_omni.data.processors.image")
    frames = torch.randn(4, 3, 16, 24, generator=torch.Generator().manual_seed(5))
    theirs, grid = image.patchify(frames, 4, 2, 2)
    ours, our_grid = patchify(frames, 4, 2, 2)
    assert grid.tolist() == list(our_grid) and torch.equal(theirs, ours)


def test_matches_hf_qwen2_vl_vision_tower(tmp_path):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    args = tiny_args()
    cfg = Qwen2VLVisionConfig(depth=args.depth, embed_dim=args.dim, hidden_size=LLM_DIM,
                              num_heads=args.n_heads, mlp_ratio=2, patch_size=4,
                              spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    hf = randomize_(Qwen2VisionTransformerPretrainedModel(cfg), seed=3).eval()
    path = tmp_path / "model.safetensors"
    write_hf_checkpoint(hf, path, prefix="visual.")

    enc = VisionEncoder(args, LLM_DIM)
    missing, unused = load_with_adapter(enc, enc.hf_adapter(), path)
    assert missing == set() and unused == set()

    g = torch.Generator().manual_seed(4)
    media = items_media(
        enc,
        [
            torch.randn(1, 3, 16, 24, generator=g),
            torch.randn(4, 3, 8, 16, generator=g),
            torch.randn(1, 3, 8, 8, generator=g),
        ],
        dtype=torch.float32,
    )
    with torch.no_grad():
        ref = hf(media["patches"], grid_thw=media["grid_thw"]).pooler_output
        ours = enc(media, "image")
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-5


def test_dummy_media_init_and_errors():
    enc = build(dtype=torch.float32)
    out = enc(enc.dummy_media("video", torch.device("cpu")), "video")
    assert out.shape == (1, LLM_DIM)
    check_init_covers_everything(VisionEncoder(tiny_args(), LLM_DIM))

    media = enc.dummy_media("image", torch.device("cpu"))
    with pytest.raises(
        ValueError, match="image_grid_thw describes 4 patches but image_patches has 3"
    ):
        enc({"patches": media["patches"][:3], "grid_thw": media["grid_thw"]}, "image")
    with pytest.raises(ValueError, match="row 0 .* multiples of the merge size"):
        enc({"patches": media["patches"][:3], "grid_thw": torch.tensor([[1, 1, 3]])}, "image")
    with pytest.raises(KeyError, match="video_grid_thw is missing"):
        enc({"patches": media["patches"]}, "video")
    with pytest.raises(ValueError, match="serves"):
        enc.processing("audio")


def _reference_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Qwen2-VL's 2-D rotary in float64: rows rotate the first half of the frequencies,
    columns the second, "rotate half" pairing."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d // 2, 2, dtype=torch.float64) / (d // 2))
    freqs = (positions.double().unsqueeze(-1) * inv).flatten(-2)
    angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def test_rotary_tables_match_the_float64_rotation():
    rope = VisionRotary2D(head_dim=16, theta=10000.0)
    g = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 64, (2, 40, 2), generator=g)
    x = torch.randn(2, 40, 3, 16, generator=g, dtype=torch.float64)
    cos, sin = rope.tables(positions)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (2, 40, 1, 16)
    ref = _reference_rotation(x, positions, 10000.0)
    # float32 tables: angles up to ~64 rad carry ~4e-6 of rounding
    torch.testing.assert_close(apply_rotary(x, (cos, sin)), ref, rtol=0, atol=2e-5)
    assert torch.equal(rope(x, positions), apply_rotary(x, (cos, sin)))
    # float32 and bf16 inputs: the same float32 maths as before the tables were shared (bit for
    # bit), cast back to the input's dtype
    inv = rope.inverse_frequencies(torch.device("cpu"))
    freqs = (positions.float().unsqueeze(-1) * inv).flatten(-2)
    angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        xf = xd.float()
        old = (xf * angles.cos() + torch.cat([-xf[..., 8:], xf[..., :8]], -1) * angles.sin())
        out = apply_rotary(xd, (cos, sin))
        assert out.dtype == dtype and torch.equal(out, old.to(dtype)), dtype


def test_blocks_share_the_encoders_rotary_tables():
    """q and k rotated together from the encoder's tables equal each projection rotated alone
    from the positions (the path Ulysses' overlapped runner takes)."""
    enc = build()
    attn = enc.blocks[0].attn
    g = torch.Generator().manual_seed(7)
    grid = [[2, 4, 6]]
    positions = merge_window_positions(grid, 2, torch.device("cpu"))
    x = torch.randn(positions.shape[0], enc.args.dim, generator=g, dtype=torch.float64)
    shared = packed_meta([24, 24], x.device, positions, enc.rope.tables(positions))
    own = packed_meta([24, 24], x.device, positions)
    q, k, v = attn.project_qkv(x, shared)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), attn.project_qkv(x, own)))
    for which, ref in zip("qkv", (q, k, v)):
        torch.testing.assert_close(attn.project(x, which, own), ref, rtol=0, atol=1e-12)
