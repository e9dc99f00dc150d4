"""On a CUDA GPU in bf16 (the FlashAttention-2 varlen path of ``varlen_attention``): every
encoder matches a float64 CPU reference to bf16 accuracy, items stay apart, and the
generation decoder round-trips. Skipped without a GPU."""

import copy

import pytest
import torch

from tests.encoders.hf_utils import randomize_, rel_err
from torchtitan_omni.modules.init import init_context

pytestmark = pytest.mark.gpu
BF16_REL = 3e-2


def _pair(module):
    """(float64 CPU reference, bf16 CUDA copy) of an initialized, perturbed module."""
    with init_context(module, seed=0):
        module.init_weights()
    randomize_(module, seed=1)
    return copy.deepcopy(module).double(), module.to("cuda", torch.bfloat16)


def test_vision_encoder_bf16_packed():
    from tests.encoders.test_vision import items_media, tiny_args
    from torchtitan_omni.encoders.vision import VisionEncoder

    ref, gpu = _pair(VisionEncoder(tiny_args(dim=64, n_heads=2), 32))
    g = torch.Generator().manual_seed(0)
    frames = [torch.randn(1, 3, 16, 24, generator=g), torch.randn(4, 3, 8, 16, generator=g),
              torch.randn(1, 3, 32, 32, generator=g)]
    media = items_media(ref, frames)
    want = ref(media, "video")
    got = gpu({k: v.cuda() for k, v in media.items()}, "video")
    assert got.dtype == torch.bfloat16 and rel_err(got.double().cpu(), want) < BF16_REL

    frames[0] = torch.randn(1, 3, 16, 24, generator=g)
    media2 = {k: v.cuda() for k, v in items_media(ref, frames).items()}
    got2 = gpu(media2, "video")
    assert torch.equal(got2[6:], got[6:])  # only the first item's 6 rows may change
    assert not torch.equal(got2[:6], got[:6])


def test_siglip_and_audio_bf16():
    from tests.encoders.test_audio import N_MELS, tiny_args as audio_args
    from tests.encoders.test_siglip import tiny_args as siglip_args
    from torchtitan_omni.encoders.audio import AudioEncoder
    from torchtitan_omni.encoders.siglip import SiglipEncoder

    ref, gpu = _pair(SiglipEncoder(siglip_args(dim=64), 32))
    pixels = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    got = gpu({"pixels": pixels.cuda()}, "image")
    assert rel_err(got.double().cpu(), ref({"pixels": pixels}, "image")) < BF16_REL

    ref, gpu = _pair(AudioEncoder(audio_args(dim=64), 32))
    lengths = torch.tensor([5, 33, 12])
    feats = torch.randn(3, N_MELS, 33, dtype=torch.float64)
    got = gpu({"features": feats.cuda(), "lengths": lengths.cuda()}, "audio")
    want = ref({"features": feats, "lengths": lengths}, "audio")
    assert rel_err(got.double().cpu(), want) < BF16_REL


def test_gen_decoder_on_gpu():
    from tests.decoders.test_vq import tiny_args
    from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder

    dec = GenImageDecoder(GenImageArgs(vq=tiny_args()), 32)
    with init_context(dec, seed=0):
        dec.init_weights()
    dec = dec.cuda()
    pixels = torch.rand(2, 3, 16, 16, device="cuda") * 2 - 1
    ids = dec.encode_targets({"pixels": pixels})
    assert ids.shape == (2 * 64,)
    loss = dec.lm_head(torch.randn(ids.numel(), 32, device="cuda"), ids)
    loss.backward()
    assert dec.head.layers[0].weight.grad is not None
    assert dec.lm_generate(ids.view(2, -1)).shape == (2, 3, 16, 16)


def test_encoders_queue_their_work_without_host_waits():
    """With item sizes on the host (as the trainer passes them), the vision and audio encoders'
    forward and backward never make the host wait for the GPU (a wait would empty the queue
    before their launch-bound blocks): ``set_sync_debug_mode("error")`` raises at any
    synchronizing op."""
    from tests.encoders.test_audio import N_MELS, tiny_args as audio_args
    from tests.encoders.test_vision import items_media, tiny_args
    from torchtitan_omni.encoders.audio import AudioEncoder
    from torchtitan_omni.encoders.vision import VisionEncoder

    _, vision = _pair(VisionEncoder(tiny_args(dim=64, n_heads=2), 32))
    _, audio = _pair(AudioEncoder(audio_args(dim=64), 32))
    g = torch.Generator().manual_seed(0)
    frames = [torch.randn(1, 3, 16, 24, generator=g), torch.randn(4, 3, 8, 16, generator=g)]
    pix = items_media(vision, frames, torch.bfloat16)
    pix["patches"] = pix["patches"].cuda()
    sound = {"features": torch.randn(3, N_MELS, 33, device="cuda", dtype=torch.bfloat16),
             "lengths": torch.tensor([5, 33, 12])}

    def step():
        loss = vision(pix, "video").float().sum() + audio(sound, "audio").float().sum()
        loss.backward()

    step()  # first calls: lazy set-up (cuBLAS handles, allocator) may synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
