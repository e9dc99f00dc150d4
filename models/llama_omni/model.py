"""``llama_omni``: the model (foundation + encoders + decoder) and its parallel plan."""

from __future__ import annotations

from torchtitan_omni.decoders.gen_image import GenImageDecoder
from torchtitan_omni.encoders.audio import AudioEncoder
from torchtitan_omni.encoders.vision import VisionEncoder
from torchtitan_omni.foundations.llama3 import Llama3
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols.plan import OmniParallelPlan

from ..common import LLM_ATTENTION, decoder_parts, encoder_part, frozen_fp32_modules, llm_part
from .args import LlamaOmniArgs


def parallel_plan(tied: bool = False) -> OmniParallelPlan:
    """The plan; ``tied``: the LLM's head is its embedding (one FSDP unit for both)."""
    return OmniParallelPlan(
        parts=(
            llm_part(tied),
            encoder_part("vision", VisionEncoder),
            encoder_part("audio", AudioEncoder),
            *decoder_parts("gen_image", GenImageDecoder),
        ),
        sequence_parallel_attention=(LLM_ATTENTION,),
        fp32_modules=frozen_fp32_modules("gen_image", GenImageDecoder),
    )


PLAN = parallel_plan()


class LlamaOmniModel(OmniModel):
    """Llama-3 with vision (images, video) and audio encoders and an image decoder."""

    def __init__(self, args: LlamaOmniArgs) -> None:
        super().__init__(Llama3(args.llm), args.build_encoders(), args.build_decoders(),
                         parallel_plan(args.llm.tie_word_embeddings))
