"""FLOP counting against a hand computation and against PyTorch's FlopCounterMode (which
counts the matmuls actually run in forward + backward; it does not count CPU attention, so
attention is checked against the formula with its causal pairs)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from torchtitan_omni.flops import FlopCounter, causal_pairs, nparams_and_flops_per_token
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.foundations.qwen3 import Qwen3, Qwen3Args
from torchtitan_omni.foundations.qwen3_moe import Qwen3Moe, Qwen3MoeArgs
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta

D, L, HEADS, KV, HD, V = 32, 2, 4, 2, 8, 50


def _llama() -> OmniModel:
    m = OmniModel(Llama3(Llama3Args(dim=D, n_layers=L, n_heads=HEADS, n_kv_heads=KV, vocab_size=V,
                                    ffn_hidden_dim=48, rope_scaling=None, max_seq_len=64)))
    m.init_weights()
    return m


def _qwen() -> OmniModel:
    m = OmniModel(
        Qwen3Moe(
            Qwen3MoeArgs(
                dim=D,
                n_layers=L,
                n_heads=HEADS,
                n_kv_heads=KV,
                head_dim=HD,
                vocab_size=V,
                num_experts=6,
                top_k=2,
                moe_hidden_dim=16,
                max_seq_len=64,
            )
        )
    )
    m.init_weights()
    return m


def _qwen3_dense() -> OmniModel:
    # head_dim 12: q/k/v widths differ from the model width, as in Qwen3
    m = OmniModel(Qwen3(Qwen3Args(dim=D, n_layers=L, n_heads=HEADS, n_kv_heads=KV, head_dim=12,
                                  vocab_size=V, ffn_hidden_dim=48, max_seq_len=64)))
    m.init_weights()
    return m


MODELS = {"llama": _llama, "qwen3_moe": _qwen, "qwen3": _qwen3_dense}


def _hand_params(kind: str, hd: int = HD) -> tuple[int, int, float]:
    """(linear weights one token passes through except the head, norm weights, head weights)."""
    attn = D * HEADS * hd + 2 * D * KV * hd + HEADS * hd * D
    if kind == "llama":
        linear, norms = L * (attn + 3 * D * 48), L * 2 * D + D
    elif kind == "qwen3":  # Llama's SwiGLU plus per-head q/k norms
        linear, norms = L * (attn + 3 * D * 48), L * (2 * D + 2 * hd) + D
    else:  # router + top-2 of 6 experts of width 16
        linear, norms = L * (attn + D * 6 + 2 * 3 * D * 16), L * (2 * D + 2 * HD) + D
    return linear, norms, D * V


def _batch():
    lengths = [5, 9, 2, 8]  # two rows of 12, documents never crossing rows
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 12), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(2, 12)
    labels = torch.randint(0, V, (2, 12), generator=g)
    labels[0, :3] = B.IGNORE_INDEX  # 21 text targets
    cu = torch.tensor([0, 5, 14, 16, 24], dtype=torch.int32)
    return tokens, positions, labels, cu


@pytest.mark.parametrize("kind", list(MODELS))
def test_batch_flops_match_hand_computation_and_measured_matmuls(kind):
    model = MODELS[kind]()
    tokens, positions, labels, cu = _batch()
    hd = 12 if kind == "qwen3" else HD
    linear, norms, head = _hand_params("moe" if kind == "qwen3_moe" else kind, hd)
    targets = int((labels != B.IGNORE_INDEX).sum())
    pairs = 5 * 6 / 2 + 9 * 10 / 2 + 2 * 3 / 2 + 8 * 9 / 2
    attention = 3 * 4 * L * HEADS * hd * pairs
    expected = 6 * (linear + norms) * 24 + 6 * head * targets + attention
    counter = FlopCounter(model)
    assert counter.batch(cu, 1, batch={}, labels=labels) == pytest.approx(expected, rel=1e-12)
    assert counter.batch(cu, 2, labels=labels) == pytest.approx(expected / 2, rel=1e-12)
    assert causal_pairs(cu[1:] - cu[:-1]) == pairs

    # What the matmuls really cost: every linear weight 6 FLOPs per token it sees (the MoE
    # experts only on their routed tokens), the head only on text targets.
    meta = AttentionMeta(cu, 9, positions)
    with FlopCounterMode(display=False) as fc:
        out = model(tokens, meta, labels)
        (out.losses["text"] + sum(out.aux_losses.values())).backward()
    counts = fc.get_flop_counts()["Global"]
    # (the experts' exact path off CUDA is one operator per projection: segment_mm)
    matmuls = ("mm", "addmm", "segment_mm", "segment_mm_weight_grad")
    measured = sum(v for op, v in counts.items() if op.__name__ in matmuls)
    assert measured == 6 * linear * 24 + 6 * head * targets


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3"])
def test_per_token_flops_follow_torchtitan_convention(kind):
    model = MODELS[kind]()
    hd = 12 if kind == "qwen3" else HD
    linear, norms, head = _hand_params("moe" if kind == "qwen3_moe" else kind, hd)
    nparams, per_token = nparams_and_flops_per_token(None, model, 64)
    assert nparams == sum(p.numel() for p in model.parameters())
    assert per_token == int(6 * (linear + norms + head) + 12 * L * HEADS * hd * 64)


def test_media_flops_count_encoders_and_decoders():
    """Encoders by the generic estimate (6 x params per encoder token + attention within each
    item), checked against the matmuls measured on a SigLIP-style encoder; decoders by their
    trainable non-lookup parameters per generated position."""
    siglip = pytest.importorskip("torchtitan_omni.encoders.siglip")
    gen = pytest.importorskip("torchtitan_omni.decoders.gen_image")
    enc = siglip.SiglipEncoder(siglip.SiglipArgs.debug(), D)
    dec = gen.GenImageDecoder(gen.GenImageArgs.debug(), D)
    model = OmniModel(
        Llama3(
            Llama3Args(
                dim=D,
                n_layers=1,
                n_heads=HEADS,
                n_kv_heads=KV,
                vocab_size=V,
                ffn_hidden_dim=48,
                rope_scaling=None,
                max_seq_len=64,
            )
        ),
        encoders={"vision": enc},
        decoders={"gen_image": dec},
    )
    model.init_weights()
    counter = FlopCounter(model)
    pixels = torch.randn(3, 3, 32, 32)
    index = torch.full((1, 40), -1)
    index[0, :7] = torch.arange(7)
    batch = {"image_pixels": pixels, B.embed_index_key(B.GEN_IMAGE): index}

    tokens_per_image = (32 // 8) ** 2
    enc_params = sum(p.numel() for p in enc.parameters())
    width = sum(b.attn.n_heads * b.attn.head_dim for b in enc.blocks)
    dec_params = (
        sum(p.numel() for p in dec.parameters() if p.requires_grad)
        - dec.aligner.embed.weight.numel()
    )
    expected = (6 * enc_params * 3 * tokens_per_image + 12 * width * 3 * tokens_per_image**2
                + 6 * dec_params * 7)
    assert counter.media(batch) == pytest.approx(expected, rel=1e-12)

    with FlopCounterMode(display=False) as fc:
        enc({"pixels": pixels}, "image").sum().backward()
    counts = fc.get_flop_counts()["Global"]
    measured = sum(
        v
        for op, v in counts.items()
        if op.__name__ in ("mm", "addmm", "convolution", "convolution_backward")
    )
    estimate = 6 * enc_params * 3 * tokens_per_image
    # The estimate also charges what runs no matmul (position embeddings, LayerNorms, biases)
    # and the patch convolution's input gradient (pixels need none): 9% at this tiny width,
    # well under 1% for SigLIP-L.
    assert measured <= estimate < 1.10 * measured


def _measured_and_estimated(encoder, media: dict, modality: str, key: str) -> tuple[int, float]:
    """FlopCounterMode's count of the encoder's forward + backward (its input requiring grad,
    so a stem's input gradient counts as everywhere else) and the FLOP counter's estimate."""
    from torchtitan_omni.flops import EncoderCost

    torch.manual_seed(0)
    for p in encoder.parameters():
        torch.nn.init.normal_(p, std=0.02)
    media[key].requires_grad_(True)
    with FlopCounterMode(display=False) as fc:
        encoder.lm_encode(media, modality).sum().backward()
    return fc.get_total_flops(), EncoderCost(encoder)(media, modality)


def test_vision_flops_count_the_merger_on_merged_rows_and_attention_per_frame():
    """Qwen2-VL's tower: the merger runs on one row per 2x2 window, and a video's patches
    attend within their temporal patch, not across the clip; the estimate matches what runs
    (within the norms and biases that FlopCounterMode does not count) for a video of two
    temporal patches and an image."""
    from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder, patchify

    args = VisionArgs.debug()
    encoder = VisionEncoder(args, D)
    sizes = (args.patch_size, args.merge_size, args.temporal_patch_size)
    video, video_grid = patchify(torch.randn(4, 3, 64, 64), *sizes)
    image, image_grid = patchify(torch.randn(1, 3, 32, 48), *sizes)
    assert video_grid[0] == 2  # two temporal patches
    media = {"patches": torch.cat([video, image]),
             "grid_thw": torch.tensor([video_grid, image_grid])}
    measured, estimated = _measured_and_estimated(encoder, media, "video", "patches")
    assert estimated == pytest.approx(measured, rel=0.02)


def test_audio_flops_count_the_stem_on_every_frame_and_the_projector_on_pooled_pairs():
    """Whisper's stem convolves every mel frame (twice the blocks' rows) and Qwen2-Audio's
    projector runs on pooled pairs (half of them): the estimate matches what runs on two
    unpadded clips."""
    from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder

    encoder = AudioEncoder(AudioArgs.debug(), D)
    media = {"features": torch.randn(2, 80, 512), "lengths": torch.tensor([512, 512])}
    measured, estimated = _measured_and_estimated(encoder, media, "audio", "features")
    assert estimated == pytest.approx(measured, rel=0.02)


def test_per_item_costs_are_each_items_measured_flops():
    """What balancing weighs items by (``EncoderCost.items``): each item's FLOPs encoded alone,
    matching FlopCounterMode per item (a video of two temporal patches attends within each, so
    it costs less than an image of as many patches), and summing to the pass's estimate."""
    from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder, patchify
    from torchtitan_omni.flops import EncoderCost

    args = VisionArgs.debug()
    encoder = VisionEncoder(args, D)
    sizes = (args.patch_size, args.merge_size, args.temporal_patch_size)
    video, video_grid = patchify(torch.randn(4, 3, 64, 64), *sizes)
    image, image_grid = patchify(torch.randn(1, 3, 64, 128), *sizes)
    assert video.shape[0] == image.shape[0] and video_grid[0] == 2
    media = {"patches": torch.cat([video, image]),
             "grid_thw": torch.tensor([video_grid, image_grid])}
    cost = EncoderCost(encoder)
    per_item = cost.items(media, "video")
    assert sum(per_item) == pytest.approx(cost(media, "video"), rel=1e-12)
    assert per_item[0] < per_item[1]
    for i, (patches, grid) in enumerate(((video, video_grid), (image, image_grid))):
        one = {"patches": patches.clone(), "grid_thw": torch.tensor([grid])}
        measured, _ = _measured_and_estimated(encoder, one, "video", "patches")
        assert per_item[i] == pytest.approx(measured, rel=0.02), i
