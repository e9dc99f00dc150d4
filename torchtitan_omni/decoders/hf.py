"""Hugging Face naming of the generation decoder: Janus / Janus-Pro in transformers format.

- ``NativeVQAdapter``: the tokenizer's own names, as ``scripts/train_vq.py`` writes them.
- ``JanusVQAdapter``: our ``VQTokenizer`` <-> ``model.vqmodel.*`` (``JanusVQVAE``, the port of
  LlamaGen's VQ-16). A real run loads Janus' pretrained VQ through it instead of training one.
- ``JanusGenAdapter``: the whole ``GenImageDecoder``: the VQ under ``vq.*``, the aligner from
  ``model.generation_embeddings`` + ``model.generation_aligner``, the head from
  ``model.generation_head``.

Names on our side are relative to the part; the VQ's are enumerated from a meta-device
instance and renamed, so the table follows the module exactly.
"""

from __future__ import annotations

import re

import torch

from torchtitan_omni.decoders.gen_image import GenImageArgs
from torchtitan_omni.decoders.vq import FORMAT, VQArgs, VQTokenizer
from torchtitan_omni.encoders.hf import JANUS_LLM_KEYS, add_mlp_projector, aligner_names, one
from torchtitan_omni.protocols.hf import HFAdapter, HFSource

# Our VQ names -> JanusVQVAE names (applied in order to names relative to the tokenizer).
_VQ_RULES = (
    (r"^encoder\.quant_conv\.", "quant_conv."),
    (r"^decoder\.post_quant_conv\.", "post_quant_conv."),
    (r"^quantizer\.codebook\.weight$", "quantize.embedding.weight"),
    (r"^encoder\.levels\.(\d+)\.resample\.", r"encoder.down.\1.downsample."),
    (r"^decoder\.levels\.(\d+)\.resample\.", r"decoder.up.\1.upsample."),
    (r"^encoder\.levels\.", "encoder.down."),
    (r"^decoder\.levels\.", "decoder.up."),
    (r"\.blocks\.(\d+)\.", r".block.\1."),
    (r"\.attns\.(\d+)\.", r".attn.\1."),
    (r"\.shortcut\.", ".nin_shortcut."),
    (r"\.mid\.res1\.", ".mid.block_1."),
    (r"\.mid\.res2\.", ".mid.block_2."),
    (r"\.mid\.attn\.", ".mid.attn_1."),
    (r"\.proj\.", ".proj_out."),
)


def janus_vq_name(ours: str) -> str:
    """The ``JanusVQVAE`` name (without prefix) of one of our VQ tensor names."""
    for pattern, repl in _VQ_RULES:
        ours = re.sub(pattern, repl, ours)
    return ours


def _vq_sources(
    args: VQArgs, ours_prefix: str, hf_prefix: str, rename: bool = True
) -> dict[str, HFSource]:
    with torch.device("meta"):
        names = list(VQTokenizer(args).state_dict())
    return {
        f"{ours_prefix}{n}": one(hf_prefix + (janus_vq_name(n) if rename else n)) for n in names
    }


def _vq_config(args: VQArgs) -> dict:
    return {
        "embed_dim": args.codebook_dim, "num_embeddings": args.codebook_size,
        "latent_channels": args.z_channels, "in_channels": args.in_channels,
        "out_channels": args.in_channels, "base_channels": args.base_channels,
        "channel_multiplier": list(args.channel_mult), "num_res_blocks": args.num_res_blocks,
        "num_patches": args.grid,
    }


class NativeVQAdapter(HFAdapter):
    """The tokenizer's own tensor names (the folders written by ``scripts/train_vq.py``)."""

    def __init__(self, args: VQArgs) -> None:
        self.args = args

    def sources(self) -> dict[str, HFSource]:
        return _vq_sources(self.args, "", "", rename=False)

    def hf_config(self) -> dict:
        from dataclasses import asdict

        return {"format": FORMAT, **asdict(self.args)}


class JanusVQAdapter(HFAdapter):
    """Our ``VQTokenizer`` <-> ``model.vqmodel.*`` of a Janus checkpoint."""

    def __init__(self, args: VQArgs, prefix: str = "model.vqmodel.") -> None:
        if not args.l2_norm or args.norm_groups != 32:
            raise ValueError("Janus' VQ uses l2-normalized codes and 32 GroupNorm groups")
        self.args, self.prefix = args, prefix

    def sources(self) -> dict[str, HFSource]:
        return _vq_sources(self.args, "", self.prefix)

    def ignored_hf_keys(self) -> tuple[str, ...]:
        p = self.prefix.removesuffix("vqmodel.")  # the rest of a Janus checkpoint
        return JANUS_LLM_KEYS + (f"{p}vision_model.*", f"{p}aligner.*", f"{p}generation_*")

    def hf_config(self) -> dict:
        return {"model_type": "janus_vqgan", **_vq_config(self.args)}


class JanusGenAdapter(HFAdapter):
    """Our ``GenImageDecoder`` <-> Janus' VQ, generation embedding, aligner and head."""

    def __init__(self, args: GenImageArgs, llm_dim: int, prefix: str = "model.") -> None:
        if args.head_depth != 2:
            raise ValueError("Janus' generation head is two linears: set head_depth = 2")
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix

    def sources(self) -> dict[str, HFSource]:
        p = self.prefix
        out = _vq_sources(self.args.vq, "vq.", f"{p}vqmodel.")
        out["aligner.embed.weight"] = one(f"{p}generation_embeddings.weight")
        add_mlp_projector(
            out, "aligner.mlp", aligner_names(f"{p}generation_aligner.", self.args.aligner_depth)
        )
        add_mlp_projector(
            out, "head", [f"{p}generation_head.proj_out", f"{p}generation_head.vision_head"]
        )
        return out

    def ignored_hf_keys(self) -> tuple[str, ...]:
        p = self.prefix  # the understanding side and the LLM belong to other parts
        return JANUS_LLM_KEYS + (f"{p}vision_model.*", f"{p}aligner.*")

    def hf_config(self) -> dict:
        return {
            "model_type": "janus_vqgan", **_vq_config(self.args.vq),
            "projection_dim": self.llm_dim, "image_token_embed_dim": self.llm_dim,
            "num_hidden_layers": self.args.aligner_depth,
        }
