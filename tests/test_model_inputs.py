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
    tokens, meta, labels_out, media, labelled = model_inputs(batch, labels, meta_device)
    assert tokens.is_meta and labels_out.is_meta and meta.cu_seqlens.is_meta
    assert meta.position_ids.is_meta and meta.max_seqlen == 5
    assert media["image_patches"].is_meta and media["audio_features"].is_meta
    assert media[B.embed_index_key("image")].is_meta
    assert media["image_grid_thw"].device.type == "cpu"
    assert media["audio_lengths"].device.type == "cpu"
    assert set(media) == {"image_patches", "image_grid_thw", B.embed_index_key("image"),
                          "audio_features", "audio_lengths"}


def test_labelled_positions_found_on_the_host():
    """``labelled`` holds the flat indices of the labels' non-ignored entries, in order, and
    is on the target device (the text loss selects them without a host wait)."""
    labels = torch.full((2, 6), B.IGNORE_INDEX)
    labels[0, 1:4] = torch.tensor([7, 8, 9])
    labels[1, 5] = 3
    batch = {B.INPUT: torch.zeros(2, 6, dtype=torch.long),
             B.POSITION_IDS: torch.arange(6).repeat(2, 1),
             B.CU_SEQLENS: torch.tensor([0, 6, 12], dtype=torch.int32)}
    on_meta = model_inputs(batch, labels, torch.device("meta"))
    assert on_meta.labelled.is_meta
    on_cpu = model_inputs(batch, labels, torch.device("cpu"))
    assert on_cpu.labelled.tolist() == [1, 2, 3, 11]


def test_text_loss_from_host_positions_matches_the_mask():
    """The model's losses and gradients with the host's ``labelled`` indices equal those of
    its own boolean-mask selection (the same positions, the same order)."""
    from tests.distributed.common import ModelSpec, make_batch, reference_model

    batch, labels = make_batch(3, rows=2, seq=24)
    results = []
    for use_index in (False, True):
        model = reference_model(ModelSpec(), seed=0)
        tokens, meta, labels_in, media, labelled = model_inputs(batch, labels,
                                                                torch.device("cpu"))
        out = model(tokens, meta, labels_in, labelled=labelled if use_index else None, **media)
        out.losses["text"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.losses["text"].detach(), grads))
    (loss_mask, grads_mask), (loss_index, grads_index) = results
    assert int((labels != B.IGNORE_INDEX).sum()) > 0
    torch.testing.assert_close(loss_index, loss_mask, rtol=0, atol=0)
    assert grads_index.keys() == grads_mask.keys() and grads_mask
    for name in grads_mask:
        torch.testing.assert_close(grads_index[name], grads_mask[name], rtol=0, atol=0)


def test_item_sizes_held_on_the_host_through_the_fsdp_input_move():
    """FSDP2's root pre-forward copies every tensor argument to the device
    (``torch.distributed.utils._to_kwargs``, synchronously); item sizes wrapped by
    ``hold_on_host`` stay on the host through it, and the model's forward gets them back as
    tensors with the same losses."""
    from torch.distributed.utils import _to_kwargs

    from tests.distributed.common import ModelSpec, make_batch, reference_model
    from torchtitan_omni.modules.host import HostTensor, hold_on_host, release_host

    batch, labels = make_batch(5, rows=2, seq=24)
    tokens, meta, labels_in, media, labelled = model_inputs(batch, labels, torch.device("cpu"))
    sizes = [k for k, v in media.items() if B.is_item_sizes(k, v)]
    assert sizes, "the batch should carry media item sizes"
    _, (raw,) = _to_kwargs((), media, torch.device("meta"), False)
    assert all(raw[k].is_meta for k in sizes)  # what FSDP does to them unheld
    _, (held,) = _to_kwargs((), hold_on_host(media), torch.device("meta"), False)
    assert all(isinstance(held[k], HostTensor) for k in sizes)
    assert all(release_host(held)[k] is media[k] for k in sizes)
    model = reference_model(ModelSpec(), seed=0)
    plain = model(tokens, meta, labels_in, labelled=labelled, **media).losses
    kept = model(tokens, meta, labels_in, labelled=labelled, **hold_on_host(media)).losses
    assert plain.keys() == kept.keys()
    for name in plain:
        torch.testing.assert_close(kept[name], plain[name], rtol=0, atol=0)
