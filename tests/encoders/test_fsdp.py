"""The encoders and the generation decoder under FSDP2 on 2 gloo ranks, sharded by their
declared units: gradients equal a single-process reference over both ranks' media; the frozen
VQ stays replicated (``ignored_params``) and runs on one rank only without a hang."""

import copy

import torch
import torch.nn as nn

from tests.harness import run_distributed


class _GenStep(nn.Module):
    """What ``OmniModel`` does with a decoder: targets (if any), embed, head loss."""

    def __init__(self, dec):
        super().__init__()
        self.dec = dec

    def forward(self, pixels, hidden):
        if pixels is not None:
            ids = self.dec.encode_targets({"pixels": pixels})
        else:
            ids = torch.zeros(hidden.shape[0], dtype=torch.long)
        emb = self.dec.lm_embed(ids)
        return self.dec.lm_head(hidden + emb, ids)


def _shard(model, units, ignored=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from torchtitan_omni.distributed.parallelize import matching_modules

    mesh = init_device_mesh("cpu", (2,))
    for _, module in matching_modules(model, "", units):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # gloo: plain sums, as the framework's plan does
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _worker(rank, world_size):
    from tests.decoders.test_vq import tiny_args as tiny_vq
    from tests.encoders.test_audio import tiny_args as tiny_audio
    from tests.encoders.test_vision import items_media, tiny_args as tiny_vision
    from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
    from torchtitan_omni.encoders.audio import AudioEncoder
    from torchtitan_omni.encoders.vision import VisionEncoder
    from torchtitan_omni.modules.init import init_context

    def media_of(r, enc):
        g = torch.Generator().manual_seed(10 + r)
        if isinstance(enc, VisionEncoder):
            frames = [
                torch.randn(1 + 2 * r, 3, 8, 16, generator=g),
                torch.randn(1, 3, 8, 8, generator=g),
            ]
            return items_media(enc, frames, torch.float32), "video"
        lengths = [5 + 3 * r, 9]
        return {"features": torch.randn(2, 16, max(lengths), generator=g),
                "lengths": torch.tensor(lengths)}, "audio"

    errors = {}
    for enc in (VisionEncoder(tiny_vision(), 24), AudioEncoder(tiny_audio(), 24)):
        with init_context(enc, seed=0):
            enc.init_weights()
        ref = copy.deepcopy(enc)
        for r in range(world_size):  # the reference sees both ranks' media
            ref(*media_of(r, ref)).pow(2).sum().backward()
        _shard(enc, enc.fsdp_units)
        enc(*media_of(rank, enc)).pow(2).sum().backward()
        got, want = _grads(enc), _grads(ref)
        assert set(got) == set(want)
        errors[type(enc).__name__] = max(float((got[n] - want[n]).abs().max()) for n in want)

    dec = GenImageDecoder(GenImageArgs(vq=tiny_vq(image_size=8)), 24)
    with init_context(dec, seed=0):
        dec.init_weights()
    step, ref = _GenStep(dec), _GenStep(copy.deepcopy(dec))
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(1, 3, 8, 8, generator=g) * 2 - 1
    hidden = [torch.randn(16, 24, generator=g), torch.randn(16, 24, generator=g)]
    for r in range(world_size):  # rank 0 has a target image, rank 1 none
        ref(pixels if r == 0 else None, hidden[r]).backward()
    _shard(step, tuple(f"dec.{u}" for u in dec.fsdp_units), ignored=set(dec.vq.parameters()))
    step(pixels if rank == 0 else None, hidden[rank]).backward()
    got, want = _grads(step), _grads(ref)
    assert set(got) == set(want) and not any(n.startswith("dec.vq.") for n in got)
    errors["GenImageDecoder"] = max(float((got[n] - want[n]).abs().max()) for n in want)
    return errors


def test_sharded_gradients_equal_single_process():
    for errors in run_distributed(_worker, 2):
        assert all(e < 1e-5 for e in errors.values()), errors
