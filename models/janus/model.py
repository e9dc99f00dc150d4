"""``janus``: the model (foundation + SigLIP encoder + VQ decoder) and its parallel plan."""

from __future__ import annotations

from torchtitan_omni.decoders.gen_image import GenImageDecoder
from torchtitan_omni.encoders.siglip import SiglipEncoder
from torchtitan_omni.foundations.llama3 import Llama3
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols.plan import OmniParallelPlan

from ..common import LLM_ATTENTION, decoder_parts, encoder_part, frozen_fp32_modules, llm_part
from .args import JanusArgs


def parallel_plan(tied: bool = False) -> OmniParallelPlan:
    """The plan; ``tied``: the LLM's head is its embedding (one FSDP unit for both)."""
    return OmniParallelPlan(
        parts=(
            llm_part(tied),
            encoder_part("vision", SiglipEncoder),
            *decoder_parts("gen_image", GenImageDecoder),
        ),
        sequence_parallel_attention=(LLM_ATTENTION,),
        fp32_modules=frozen_fp32_modules("gen_image", GenImageDecoder),
    )


PLAN = parallel_plan()


class JanusModel(OmniModel):
    """Janus: a Llama-shaped LLM that understands images (SigLIP) and generates them (VQ)."""

    def __init__(self, args: JanusArgs) -> None:
        super().__init__(Llama3(args.llm), args.build_encoders(), args.build_decoders(),
                         parallel_plan(args.llm.tie_word_embeddings))
