"""The order the encoders run in (``omni.encoder_order``): by increasing work of the step's
media, the same losses and gradients as the model's order, a wrong order refused."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import common as C
from torchtitan_omni.flops import FlopCounter
from torchtitan_omni.protocols import batch as B


def test_lightest_encoder_first_ties_in_the_models_order():
    model = C.build_model(C.ModelSpec())
    assert tuple(model.encoders) == ("vision", "audio")
    assert model.encoder_order({"image": 5e9, "audio": 1e9}) == ("audio", "vision")
    assert model.encoder_order({"image": 1e9, "audio": 5e9}) == ("vision", "audio")
    assert model.encoder_order({"image": 0.0, "audio": 0.0}) == ("vision", "audio")


def test_an_order_that_misses_an_encoder_is_refused():
    model = C.build_model(C.ModelSpec())
    with pytest.raises(ValueError, match=r"\['audio'\] does not name each of the model's "
                                         r"encoders \['vision', 'audio'\] once"):
        model.encoder_passes(order=("audio",))


def _step(model, batch, labels, order):
    """Losses, gradients and the encoders' call order of one forward + backward."""
    calls = []
    hooks = [enc.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
             for name, enc in model.encoders.items()]
    model.zero_grad()
    meta, media = C._meta(batch)
    out = model(batch[B.INPUT], meta, labels, encoder_order=order, **media)
    sum(out.losses.values()).backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in out.losses.items()}, grads, calls


def test_encoders_in_another_order_give_the_same_losses_and_gradients():
    model = C.reference_model(C.ModelSpec())
    batch, labels = C.make_batch(5)
    losses, grads, calls = _step(model, batch, labels, ())
    assert calls == ["vision", "audio"]
    swapped_losses, swapped_grads, swapped_calls = _step(model, batch, labels, ("audio", "vision"))
    assert swapped_calls == ["audio", "vision"]
    assert swapped_losses == losses
    assert swapped_grads.keys() == grads.keys()
    assert any(n.startswith("encoders.audio") for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(swapped_grads[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_encoder_work_splits_the_media_flops_by_modality():
    model = C.reference_model(C.ModelSpec())
    counter = FlopCounter(model)
    batch, _ = C.make_batch(5)
    work = counter.encoder_work(batch)
    assert set(work) == {"image", "audio"} and all(w > 0 for w in work.values())
    assert sum(work.values()) == pytest.approx(counter.media(batch), rel=1e-12)
    no_audio, _ = C.make_batch(5, audio=False)
    assert counter.encoder_work(no_audio)["audio"] == 0.0
