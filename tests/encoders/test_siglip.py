"""SigLIP encoder + Janus aligner: rows per image, images stay apart, and parity with Hugging
Face's SiglipVisionModel and Janus' vision tower + aligner."""

import pytest
import torch

from tests.encoders.hf_utils import (
    check_init_covers_everything, load_with_adapter, randomize_, rel_err, write_hf_checkpoint,
)
from torchtitan_omni.encoders.siglip import SiglipArgs, SiglipEncoder
from torchtitan_omni.modules.init import init_context

LLM_DIM = 40


def tiny_args(**kw) -> SiglipArgs:
    base = dict(image_size=32, patch_size=8, dim=32, n_layers=2, n_heads=4, mlp_dim=64)
    base.update(kw)
    return SiglipArgs(**base)


def test_rows_per_image_and_images_stay_apart():
    enc = SiglipEncoder(tiny_args(), LLM_DIM)
    with init_context(enc, seed=0):
        enc.init_weights()
    enc = randomize_(enc, seed=1).double()
    proc = enc.processing("image")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(3, 3, 32, 32, generator=g, dtype=torch.float64)
    out = enc({"pixels": pixels}, "image")
    assert out.shape == (3 * proc.num_tokens(32, 32), LLM_DIM) and proc.num_tokens(32, 32) == 16
    single = torch.cat([enc({"pixels": pixels[i:i + 1]}, "image") for i in range(3)])
    assert torch.allclose(out, single, rtol=0, atol=1e-12)
    pixels[1] = torch.randn(3, 32, 32, generator=g, dtype=torch.float64)
    out2 = enc({"pixels": pixels}, "image")
    assert torch.equal(out2[:16], out[:16]) and torch.equal(out2[32:], out[32:])


def test_matches_hf_siglip_vision_model(tmp_path):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    args = tiny_args(gelu_approximate="tanh", hf_format="siglip")
    cfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, image_size=32, patch_size=8)
    torch.manual_seed(0)
    hf = randomize_(SiglipVisionModel(cfg), seed=2).eval()
    path = tmp_path / "model.safetensors"
    write_hf_checkpoint(hf, path, prefix="vision_model.")  # as in a SiglipModel checkpoint

    enc = SiglipEncoder(args, LLM_DIM)
    adapter = enc.hf_adapter()
    missing, unused = load_with_adapter(enc, adapter, path)
    assert adapter.init_only() == ("aligner.*",)  # SigLIP has no aligner: it keeps its init
    assert missing == set() and unused == set()  # the pooling head is knowingly ignored

    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(pixel_values=pixels).last_hidden_state
        ours = enc.features(pixels)
    assert rel_err(ours, ref) < 1e-5


def test_matches_hf_janus_vision_and_aligner(tmp_path):
    from transformers.models.janus.configuration_janus import JanusVisionConfig
    from transformers.models.janus.modeling_janus import JanusVisionAlignerMLP, JanusVisionModel

    args = tiny_args(gelu_approximate="none", hf_format="janus")
    cfg = JanusVisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        mlp_ratio=2.0,
        projection_dim=LLM_DIM,
        depth=2,
    )
    torch.manual_seed(0)
    tower = randomize_(JanusVisionModel(cfg), seed=4).eval()
    aligner = randomize_(JanusVisionAlignerMLP(cfg), seed=5).eval()
    hf = {**{f"model.vision_model.{k}": v for k, v in tower.state_dict().items()},
          **{f"model.aligner.{k}": v for k, v in aligner.state_dict().items()}}
    path = tmp_path / "model.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf.items()}, str(path))

    enc = SiglipEncoder(args, LLM_DIM)
    missing, unused = load_with_adapter(enc, enc.hf_adapter(), path)
    assert missing == set() and unused == set()

    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = aligner(tower(pixel_values=pixels).last_hidden_state).flatten(0, 1)
        ours = enc({"pixels": pixels}, "image")
    assert rel_err(ours, ref) < 1e-5


def test_dummy_media_init_and_errors():
    enc = SiglipEncoder(tiny_args(), LLM_DIM)
    check_init_covers_everything(enc)
    assert enc(enc.dummy_media("image", torch.device("cpu")), "image").shape == (16, LLM_DIM)
    with pytest.raises(ValueError, match=r"image_pixels must be \[n, 3, 32, 32\]"):
        enc({"pixels": torch.zeros(1, 3, 16, 16)}, "image")
    with pytest.raises(KeyError, match="image_pixels is missing"):
        enc({"patches": torch.zeros(1, 3)}, "image")
