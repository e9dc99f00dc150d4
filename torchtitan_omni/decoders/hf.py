"""Hugging Face naming of the generation decoder: Janus / Janus-Pro in transformers format.

- ``NativeVQAdapter``: the tokenizer's own names, as ``scripts/train_vq.py`` writes them.
- ``JanusVQAdapter``: our ``VQTokenizer`` <-> ``model.vqmodel.*`` (``JanusVQVAE``, the port of
  LlamaGen's VQ-16). A real run loads Janus' pretrained VQ through it instead of training one.
- ``JanusGenAdapter``: the whole ``GenImageDecoder``: the VQ under ``vq.*``, the aligner from
  ``model.generation_embeddings`` + ``model.generation_aligner``, the head from
  ``model.generation_head``.

Names on our side are relative to the part; the VQ's are the tokenizer's own tensor names
(its ``hf_adapter`` enumerates them from a meta-device instance) renamed, so the table follows
the module exactly. The modules build their adapters; this module imports neither.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from torchtitan_omni.encoders.hf import JANUS_LLM_KEYS, add_mlp_projector, aligner_names, one
from torchtitan_omni.protocols.hf import HFAdapter, HFSource

if TYPE_CHECKING:  # annotations only: the decoder modules import this one
    from torchtitan_omni.decoders.gen_image import GenImageArgs
    from torchtitan_omni.decoders.vq import VQArgs

#: the format tag of the VQ folders ``scripts/train_vq.py`` writes (``decoders.vq.save_vq``)
FORMAT = "torchtitan_omni.vq"

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
    names: Sequence[str], ours_prefix: str, hf_prefix: str, rename: bool = True
) -> dict[str, HFSource]:
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
    """The tokenizer's own tensor names (the folders written by ``scripts/train_vq.py``);
    ``names``: the tokenizer's tensor names."""

    def __init__(self, args: VQArgs, names: Sequence[str]) -> None:
        self.args, self.names = args, list(names)

    def sources(self) -> dict[str, HFSource]:
        return _vq_sources(self.names, "", "", rename=False)

    def hf_config(self) -> dict:
        return {"format": FORMAT, **asdict(self.args)}


class JanusVQAdapter(HFAdapter):
    """Our ``VQTokenizer`` <-> ``model.vqmodel.*`` of a Janus checkpoint; ``names``: the
    tokenizer's tensor names."""

    def __init__(self, args: VQArgs, names: Sequence[str], prefix: str = "model.vqmodel.") -> None:
        if not args.l2_norm or args.norm_groups != 32:
            raise ValueError("Janus' VQ uses l2-normalized codes and 32 GroupNorm groups")
        self.args, self.names, self.prefix = args, list(names), prefix

    def sources(self) -> dict[str, HFSource]:
        return _vq_sources(self.names, "", self.prefix)

    def ignored_hf_keys(self) -> tuple[str, ...]:
        p = self.prefix.removesuffix("vqmodel.")  # the rest of a Janus checkpoint
        return JANUS_LLM_KEYS + (f"{p}vision_model.*", f"{p}aligner.*", f"{p}generation_*")

    def hf_config(self) -> dict:
        return {"model_type": "janus_vqgan", **_vq_config(self.args)}


class JanusGenAdapter(HFAdapter):
    """Our ``GenImageDecoder`` <-> Janus' VQ, generation embedding, aligner and head;
    ``vq_names``: the VQ tokenizer's tensor names."""

    def __init__(self, args: GenImageArgs, llm_dim: int, vq_names: Sequence[str],
                 prefix: str = "model.") -> None:
        if args.head_depth != 2:
            raise ValueError("Janus' generation head is two linears: set head_depth = 2")
        self.args, self.llm_dim, self.prefix = args, llm_dim, prefix
        self.vq_names = list(vq_names)

    def sources(self) -> dict[str, HFSource]:
        p = self.prefix
        out = _vq_sources(self.vq_names, "vq.", f"{p}vqmodel.")
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
