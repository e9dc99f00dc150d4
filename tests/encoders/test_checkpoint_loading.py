"""The project's loader (``weights.sources``) with these adapters: one whole Janus checkpoint
folder loads into the vision part and the generation part separately (each adapter ignores the
other parts' tensors), a Qwen2-VL tower loads into a model of another LLM width, and a VQ
folder written by the recipe loads into ``decoders.gen_image.vq``."""

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from tests.decoders.test_vq import tiny_args as tiny_vq
from tests.encoders.hf_utils import randomize_
from tests.encoders.test_siglip import tiny_args as tiny_siglip
from tests.encoders.test_vision import tiny_args as tiny_vision
from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.decoders.vq import VQTokenizer, save_vq
from torchtitan_omni.encoders.siglip import SiglipEncoder
from torchtitan_omni.encoders.vision import VisionEncoder
from torchtitan_omni.modules.init import init_context

hf_loader = pytest.importorskip("torchtitan_omni.checkpoint.hf_loader")
LLM = 32


class Parts(nn.Module):
    """The encoders / decoders layout of an omni model, without the LLM."""

    def __init__(self, encoders, decoders):
        super().__init__()
        self.encoders = nn.ModuleDict(encoders)
        self.decoders = nn.ModuleDict(decoders)


def _janus_folder(folder):
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import (
        JanusVisionAlignerMLP, JanusVisionModel, JanusVQVAE, JanusVQVAEAlignerMLP, JanusVQVAEHead,
    )

    vcfg = JanusVisionConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        mlp_ratio=2.0,
        projection_dim=LLM,
        depth=2,
    )
    qcfg = JanusVQVAEConfig(embed_dim=4, num_embeddings=64, latent_channels=32, base_channels=32,
                            channel_multiplier=[1, 2], num_res_blocks=1, num_patches=4,
                            projection_dim=LLM, image_token_embed_dim=LLM, num_hidden_layers=2)
    torch.manual_seed(0)
    parts = {
        "vision_model": JanusVisionModel(vcfg),
        "aligner": JanusVisionAlignerMLP(vcfg),
        "vqmodel": JanusVQVAE(qcfg),
        "generation_embeddings": nn.Embedding(64, 4),
        "generation_aligner": JanusVQVAEAlignerMLP(qcfg),
        "generation_head": JanusVQVAEHead(qcfg),
    }
    tensors = {f"model.{p}.{k}": v.contiguous() for p, m in parts.items()
               for k, v in randomize_(m, seed=1).state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.randn(10, LLM)  # the LLM's
    tensors["lm_head.weight"] = torch.randn(10, LLM)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_janus_checkpoint_loads_part_by_part(tmp_path):
    tensors = _janus_folder(tmp_path / "janus")
    vq = tiny_vq(base_channels=32, z_channels=32, norm_groups=32, image_size=8)
    model = Parts(
        {"vision": SiglipEncoder(tiny_siglip(gelu_approximate="none", hf_format="janus"), LLM)},
        {"gen_image": GenImageDecoder(GenImageArgs(vq=vq), LLM)},
    )
    for part in ("encoders.vision", "decoders.gen_image"):
        report = hf_loader.load_part_from_hf(model, part, str(tmp_path / "janus"))
        assert report.tensors == len(model.get_submodule(part).state_dict())
    assert torch.equal(model.encoders["vision"].pos_embed,
                       tensors["model.vision_model.embeddings.position_embedding.weight"])
    assert torch.equal(model.decoders["gen_image"].head.layers[1].weight,
                       tensors["model.generation_head.vision_head.weight"])


def test_qwen2_vl_tower_into_another_llm_width(tmp_path):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=48, num_heads=2, mlp_ratio=2,
                              patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    hf = randomize_(Qwen2VisionTransformerPretrainedModel(cfg), seed=2)
    (tmp_path / "qwen2vl").mkdir()
    save_file({f"visual.{k}": v.contiguous() for k, v in hf.state_dict().items()},
              str(tmp_path / "qwen2vl" / "model.safetensors"))

    enc = VisionEncoder(tiny_vision(hf_llm_dim=48), LLM)  # our LLM is 32 wide, the checkpoint's 48
    with init_context(enc, seed=0):
        enc.init_weights()
    before = enc.merger.mlp.layers[1].weight.clone()
    model = Parts({"vision": enc}, {})
    hf_loader.load_part_from_hf(model, "encoders.vision", str(tmp_path / "qwen2vl"))
    assert torch.equal(enc.blocks[1].attn.qkv.weight, hf.blocks[1].attn.qkv.weight)
    assert torch.equal(enc.merger.mlp.layers[0].weight, hf.merger.mlp[0].weight)
    assert torch.equal(enc.merger.mlp.layers[1].weight, before)  # new width: keeps its init

    with pytest.raises(Exception, match="shape mismatch"):  # without hf_llm_dim: a clear error
        hf_loader.load_part_from_hf(Parts({"vision": VisionEncoder(tiny_vision(), LLM)}, {}),
                                    "encoders.vision", str(tmp_path / "qwen2vl"))


def test_recipe_folder_loads_into_the_decoders_vq(tmp_path):
    trained = VQTokenizer(tiny_vq())
    with init_context(trained, seed=5):
        trained.init_weights()
    save_vq(trained, str(tmp_path / "vq"))
    model = Parts({}, {"gen_image": GenImageDecoder(GenImageArgs(vq=tiny_vq()), LLM)})
    hf_loader.load_part_from_hf(model, "decoders.gen_image.vq", str(tmp_path / "vq"))
    for name, value in trained.state_dict().items():
        assert torch.equal(model.decoders["gen_image"].vq.state_dict()[name], value), name
