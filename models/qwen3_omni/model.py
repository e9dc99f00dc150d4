"""``qwen3_omni``: the model (Qwen3 dense + encoders) and its parallel plan."""

from __future__ import annotations

from torchtitan_omni.encoders.audio import AudioEncoder
from torchtitan_omni.encoders.vision import VisionEncoder
from torchtitan_omni.foundations.qwen3 import Qwen3
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols.plan import OmniParallelPlan

from ..common import LLM_ATTENTION, encoder_part, llm_part
from .args import Qwen3OmniArgs


def parallel_plan(tied: bool = False) -> OmniParallelPlan:
    """The plan; ``tied``: the LLM's head is its embedding (one FSDP unit for both)."""
    return OmniParallelPlan(
        parts=(
            llm_part(tied),
            encoder_part("vision", VisionEncoder),
            encoder_part("audio", AudioEncoder),
        ),
        sequence_parallel_attention=(LLM_ATTENTION,),
    )


PLAN = parallel_plan()


class Qwen3OmniModel(OmniModel):
    """Qwen3 dense with vision (images, video) and audio encoders."""

    def __init__(self, args: Qwen3OmniArgs) -> None:
        super().__init__(Qwen3(args.llm), args.build_encoders(), args.build_decoders(),
                         parallel_plan(args.llm.tie_word_embeddings))
