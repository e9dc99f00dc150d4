"""Image-generation decoder: targets per image match the processor, the loss trains the
aligner and head but never the VQ, and parity with Janus' generation modules."""

import pytest
import torch

from tests.decoders.test_vq import tiny_args as tiny_vq
from tests.encoders.hf_utils import (
    check_init_covers_everything,
    load_with_adapter,
    randomize_,
    rel_err,
)
from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.modules.init import init_context

LLM_DIM = 32


def build(args=None) -> GenImageDecoder:
    dec = GenImageDecoder(args or GenImageArgs(vq=tiny_vq()), LLM_DIM)
    with init_context(dec, seed=0):
        dec.init_weights()
    return dec


def test_targets_generation_and_frozen_vq():
    dec = build()
    proc = dec.processing()
    pixels = torch.rand(2, 3, 16, 16) * 2 - 1
    ids = dec.encode_targets({"pixels": pixels})
    assert ids.shape == (2 * proc.num_tokens(),) and ids.dtype == torch.long
    images = dec.lm_generate(ids.view(2, -1))
    assert images.shape == (2, 3, 16, 16) and images.abs().max() <= 1.0

    hidden = torch.randn(ids.numel(), LLM_DIM, requires_grad=True)
    loss = dec.lm_head(hidden, ids) + dec.lm_embed(ids).pow(2).sum()
    loss.backward()
    for part in (dec.aligner, dec.head):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())
    assert all(not p.requires_grad and p.grad is None for p in dec.vq.parameters())
    assert hidden.grad.abs().sum() > 0

    dec.train()
    assert dec.training and not dec.vq.training
    names = {n.split(".")[0] for n, _ in dec.named_parameters()}
    assert names == {"vq", "aligner", "head"}  # no parameters of the decoder's own


def test_init_and_errors():
    check_init_covers_everything(GenImageDecoder(GenImageArgs(vq=tiny_vq()), LLM_DIM))
    dec = build()
    with pytest.raises(ValueError, match=r"gen_image_pixels must be \[n, 3, 16, 16\]"):
        dec.encode_targets({"pixels": torch.zeros(1, 3, 8, 8)})
    with pytest.raises(KeyError, match="gen_image_pixels is missing"):
        dec.encode_targets({"images": torch.zeros(1, 3, 16, 16)})


def test_matches_hf_janus_generation_modules(tmp_path):
    from safetensors.torch import save_file
    from transformers.models.janus.configuration_janus import JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import (
        JanusVQVAE,
        JanusVQVAEAlignerMLP,
        JanusVQVAEHead,
    )

    vq = tiny_vq(base_channels=32, z_channels=32, norm_groups=32, image_size=8)
    cfg = JanusVQVAEConfig(
        embed_dim=4,
        num_embeddings=64,
        latent_channels=32,
        base_channels=32,
        channel_multiplier=[1, 2],
        num_res_blocks=1,
        num_patches=4,
        projection_dim=LLM_DIM,
        image_token_embed_dim=LLM_DIM,
        num_hidden_layers=2,
    )
    torch.manual_seed(0)
    parts = {
        "vqmodel": randomize_(JanusVQVAE(cfg), seed=1),
        "generation_embeddings": randomize_(torch.nn.Embedding(64, 4), seed=2),
        "generation_aligner": randomize_(JanusVQVAEAlignerMLP(cfg), seed=3),
        "generation_head": randomize_(JanusVQVAEHead(cfg), seed=4),
    }
    tensors = {
        f"model.{p}.{k}": v.contiguous()
        for p, m in parts.items()
        for k, v in m.state_dict().items()
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))

    dec = GenImageDecoder(GenImageArgs(vq=vq), LLM_DIM)
    missing, unused = load_with_adapter(dec, dec.hf_adapter(), path)
    assert missing == set() and unused == set()

    ids = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(6, LLM_DIM, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref_embed = parts["generation_aligner"](parts["generation_embeddings"](ids))
        assert rel_err(dec.lm_embed(ids), ref_embed) < 1e-5
        assert rel_err(dec.logits(hidden), parts["generation_head"](hidden)) < 1e-5
        codes = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(7))
        assert rel_err(dec.vq.decode(codes), parts["vqmodel"].decode(codes)) < 1e-5
