"""The encoders and the generation decoder inside an ``OmniModel``: their rows land on the
placeholders, the losses train them (never the VQ), and the dummy path runs without media."""

import torch

from tests.decoders.test_vq import tiny_args as tiny_vq
from tests.encoders.test_audio import tiny_args as tiny_audio
from tests.encoders.test_vision import items_media, tiny_args as tiny_vision
from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.encoders.audio import AudioEncoder
from torchtitan_omni.encoders.vision import VisionEncoder
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols.modules import AttentionMeta

DIM, VOCAB, S = 32, 64, 48


def build() -> OmniModel:
    llm = Llama3(Llama3Args(dim=DIM, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                            ffn_hidden_dim=64, rope_scaling=None, max_seq_len=S))
    model = OmniModel(
        llm,
        encoders={
            "vision": VisionEncoder(tiny_vision(), DIM),
            "audio": AudioEncoder(tiny_audio(), DIM),
        },
        decoders={"gen_image": GenImageDecoder(GenImageArgs(vq=tiny_vq(image_size=8)), DIM)},
    )
    model.init_weights()
    return model


def index(positions, n=S):
    out = torch.full((1, n), -1, dtype=torch.long)
    out[0, positions] = torch.arange(len(positions))
    return out


def test_media_rows_land_on_placeholders_and_train_the_parts():
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, S), generator=g)
    labels = torch.full((1, S), -100)
    labels[0, :2] = tokens[0, 1:3]
    labels[0, 36:47] = tokens[0, 37:48]
    batch = {
        **{
            f"image_{k}": v
            for k, v in items_media(
                model.encoders["vision"], [torch.randn(1, 3, 16, 16, generator=g)], torch.float32
            ).items()
        },
        "image_embed_index": index(list(range(2, 6))),  # 4x4 patches -> 4 tokens
        "audio_features": torch.randn(1, 16, 7, generator=g),
        "audio_lengths": torch.tensor([7]),
        "audio_embed_index": index([8, 9]),  # ceil(7 / 4) = 2 tokens
        "gen_image_pixels": torch.rand(1, 3, 8, 8, generator=g) * 2 - 1,
        "gen_image_embed_index": index(list(range(20, 36))),  # 4x4 codes
        "gen_image_target_index": index(list(range(19, 35))),
    }
    h, targets = model.embed(tokens, batch)
    media = {"patches": batch["image_patches"], "grid_thw": batch["image_grid_thw"]}
    assert torch.allclose(h[0, 2:6], model.encoders["vision"](media, "image"))
    assert targets["gen_image"].shape == (16,)

    meta = AttentionMeta(cu_seqlens=torch.tensor([0, S], dtype=torch.int32), max_seqlen=S,
                         position_ids=torch.arange(S)[None])
    out = model(tokens, meta, labels, **batch)
    assert set(out.losses) == {"text", "gen_image"}
    sum(out.losses.values()).backward()
    for part in ("encoders.vision.blocks", "encoders.audio.blocks", "decoders.gen_image.aligner",
                 "decoders.gen_image.head", "encoders.vision.merger", "encoders.audio.projector"):
        grads = [p.grad for p in model.get_submodule(part).parameters()]
        assert all(gr is not None for gr in grads) and sum(gr.abs().sum() for gr in grads) > 0, part
    assert all(p.grad is None for p in model.decoders["gen_image"].vq.parameters())


def test_dummy_path_without_media():
    model = build()
    tokens = torch.randint(0, VOCAB, (1, S))
    labels = torch.roll(tokens, -1, 1)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, S], dtype=torch.int32), max_seqlen=S,
                         position_ids=torch.arange(S)[None])
    out = model(tokens, meta, labels)
    sum(out.losses.values()).backward()
    for part in ("encoders.vision", "encoders.audio", "decoders.gen_image.aligner"):
        grads = [p.grad for p in model.get_submodule(part).parameters()]
        assert all(gr is not None and gr.abs().sum() == 0 for gr in grads), part


def test_absent_modalities_skip_their_parts_with_the_same_losses():
    """What the trainer does when no rank carries a modality: the parts are not run (no
    gradient at all) and the losses equal those of the dummy path."""
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, VOCAB, (1, S))
    labels = torch.roll(tokens, -1, 1)
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, S], dtype=torch.int32), max_seqlen=S,
                         position_ids=torch.arange(S)[None])
    assert model.media_present({}).tolist() == [0] * len(model.modalities)
    dummy = model(tokens, meta, labels)
    skipped = model(tokens, meta, labels, absent=frozenset(model.modalities))
    assert set(skipped.losses) == set(dummy.losses)
    for name in dummy.losses:
        assert torch.allclose(
            torch.as_tensor(skipped.losses[name]), torch.as_tensor(dummy.losses[name])
        ), name
    sum(skipped.losses.values()).backward()
    for part in ("encoders.vision", "encoders.audio", "decoders.gen_image"):
        assert all(p.grad is None for p in model.get_submodule(part).parameters()), part
    assert all(p.grad is not None for p in model.llm.parameters())


def test_images_and_video_share_one_vision_pass_with_the_same_rows():
    """The vision encoder merges a batch's image and video items into one pass: the rows that
    land on each placeholder equal those of separate passes; a batch with none of them runs
    one dummy pass."""
    torch.manual_seed(0)
    model = build().double()
    vision = model.encoders["vision"]
    g = torch.Generator().manual_seed(3)
    image = items_media(vision, [torch.randn(1, 3, 16, 16, generator=g),
                                 torch.randn(1, 3, 8, 16, generator=g)])
    video = items_media(vision, [torch.randn(4, 3, 8, 8, generator=g)])
    n_img, n_vid = vision.output_rows(image, "image"), vision.output_rows(video, "video")
    assert (n_img, n_vid) == (4 + 2, 2)
    tokens = torch.randint(0, VOCAB, (1, S), generator=g)
    batch = {
        **{f"image_{k}": v for k, v in image.items()},
        "image_embed_index": index(list(range(3, 3 + n_img))),
        **{f"video_{k}": v for k, v in video.items()},
        "video_embed_index": index(list(range(20, 20 + n_vid))),
    }
    calls = []
    hook = vision.register_forward_hook(lambda mod, args, out: calls.append(args[1]))
    h, _ = model.embed(tokens, batch)
    assert calls == ["image"]  # one pass for both modalities
    assert torch.allclose(h[0, 3:3 + n_img], vision(image, "image"), atol=1e-12)
    assert torch.allclose(h[0, 20:20 + n_vid], vision(video, "video"), atol=1e-12)
    calls.clear()
    model.embed(tokens, {})
    assert calls == ["image"]  # a batch without media: one dummy pass
    hook.remove()


def test_scatter_rows_matches_a_gather_reference_in_float64():
    """Rows copied to their positions (gradient: a gather of those positions) equal the dense
    formulation ``where(index >= 0, rows[index], h)``, outputs and both gradients, also when
    some rows belong to another sequence shard (not placed here) and in several rows."""
    from torchtitan_omni.omni_model import _scatter_rows

    gen = torch.Generator().manual_seed(0)
    b, s, d, n_rows = 2, 23, 5, 9
    for placed in (0, 4, 9):
        flat = torch.full((b * s,), -1, dtype=torch.long)
        positions = torch.randperm(b * s, generator=gen)[:placed]
        flat[positions] = torch.randperm(n_rows, generator=gen)[:placed]
        idx = flat.view(b, s)
        h = torch.randn(b, s, d, dtype=torch.float64, generator=gen, requires_grad=True)
        rows = torch.randn(n_rows, d, dtype=torch.float64, generator=gen, requires_grad=True)
        grad = torch.randn(b, s, d, dtype=torch.float64, generator=gen)

        out = _scatter_rows(h, idx, rows)
        want = torch.where((idx >= 0).unsqueeze(-1), rows[idx.clamp(min=0)], h)
        got_grads = torch.autograd.grad(out, (h, rows), grad)
        want_grads = torch.autograd.grad(want, (h, rows), grad)
        assert torch.equal(out, want)
        for got, ref in zip(got_grads, want_grads):
            assert torch.equal(got, ref)
        # rows not placed here get no gradient; placed rows get their position's gradient
        unplaced = sorted(set(range(n_rows)) - set(flat[positions].tolist()))
        assert torch.count_nonzero(got_grads[1][unplaced]) == 0
