"""``qwen3_moe_omni`` arguments and flavors: Qwen3-MoE + Qwen2-VL-style vision (images,
video) + Whisper-style audio."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder
from torchtitan_omni.foundations.hf_config import QWEN3_MOE
from torchtitan_omni.foundations.qwen3_moe import Qwen3MoeArgs
from torchtitan_omni.model_args import HF_FLAVOR, OmniModelArgs
from torchtitan_omni.protocols.modules import OmniEncoder


@dataclass
class Qwen3MoeOmniArgs(OmniModelArgs):
    """Foundation and encoders of ``qwen3_moe_omni`` (defaults: the 30B-A3B flavor)."""

    hf_foundations = (QWEN3_MOE,)

    llm: Qwen3MoeArgs = field(default_factory=Qwen3MoeArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    audio: AudioArgs = field(default_factory=AudioArgs)

    @property
    def llm_args(self) -> Qwen3MoeArgs:
        return self.llm

    def build_encoders(self) -> dict[str, OmniEncoder]:
        dim = self.llm.dim
        return {"vision": VisionEncoder(self.vision, dim), "audio": AudioEncoder(self.audio, dim)}


FLAVORS = {
    "debugmodel": Qwen3MoeOmniArgs(
        llm=Qwen3MoeArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                         vocab_size=2048, num_experts=8, top_k=2, moe_hidden_dim=32,
                         max_seq_len=512),
        vision=VisionArgs.debug(), audio=AudioArgs.debug(), vocab_from_tokenizer=True,
    ),
    # Qwen3-30B-A3B (48 layers, 128 experts top-8), Qwen2-VL-7B's vision tower,
    # Whisper-large-v3's encoder.
    "30B-A3B": Qwen3MoeOmniArgs(),
    # Flavor hf: the LLM from weights.sources llm=<folder>/config.json (Qwen3MoeForCausalLM),
    # the parts of 30B-A3B (or of model.parts_flavor), encoders from their folders.
    HF_FLAVOR: Qwen3MoeOmniArgs(from_hf=True),
}
