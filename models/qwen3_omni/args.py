"""``qwen3_omni`` arguments and flavors: Qwen3 dense + Qwen2-VL-style vision (images, video) +
Whisper-style audio."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder
from torchtitan_omni.foundations.hf_config import QWEN3
from torchtitan_omni.foundations.qwen3 import Qwen3Args
from torchtitan_omni.model_args import HF_FLAVOR, OmniModelArgs
from torchtitan_omni.protocols.modules import OmniEncoder


@dataclass
class Qwen3OmniArgs(OmniModelArgs):
    """Foundation and encoders of ``qwen3_omni`` (defaults: the 8B flavor)."""

    hf_foundations = (QWEN3,)

    llm: Qwen3Args = field(default_factory=Qwen3Args)
    vision: VisionArgs = field(default_factory=VisionArgs)
    audio: AudioArgs = field(default_factory=AudioArgs)

    @property
    def llm_args(self) -> Qwen3Args:
        return self.llm

    def build_encoders(self) -> dict[str, OmniEncoder]:
        dim = self.llm.dim
        return {"vision": VisionEncoder(self.vision, dim), "audio": AudioEncoder(self.audio, dim)}


def debug_llm() -> Qwen3Args:
    """A 2-layer Qwen3 for CPU runs (the vocabulary comes from the tokenizer); q is wider
    than the model (4 heads of 24 on width 64), as in Qwen3-32B."""
    return Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=2048,
                     ffn_hidden_dim=128, max_seq_len=512)


FLAVORS = {
    "debugmodel": Qwen3OmniArgs(
        llm=debug_llm(), vision=VisionArgs.debug(), audio=AudioArgs.debug(),
        vocab_from_tokenizer=True,
    ),
    # Qwen3-8B (36 layers, 4096, 32/8 heads of 128, FFN 12288, untied head), Qwen2-VL-7B's
    # vision tower, Whisper-large-v3's encoder.
    "8B": Qwen3OmniArgs(),
    # Flavor hf: the LLM from weights.sources llm=<folder>/config.json (Qwen3ForCausalLM), the
    # parts of 8B (or of model.parts_flavor), encoders from their folders.
    HF_FLAVOR: Qwen3OmniArgs(from_hf=True),
}
