"""``llama_omni`` arguments and flavors: Llama-3 + Qwen2-VL-style vision (images, video) +
Whisper-style audio + Janus-style image generation."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.encoders.audio import AudioArgs, AudioEncoder
from torchtitan_omni.encoders.vision import VisionArgs, VisionEncoder
from torchtitan_omni.foundations.hf_config import LLAMA
from torchtitan_omni.foundations.llama3 import Llama3Args
from torchtitan_omni.model_args import HF_FLAVOR, OmniModelArgs
from torchtitan_omni.protocols.modules import OmniDecoder, OmniEncoder


@dataclass
class LlamaOmniArgs(OmniModelArgs):
    """Foundation, encoders and decoder of ``llama_omni`` (defaults: the 8B flavor)."""

    hf_foundations = (LLAMA,)

    llm: Llama3Args = field(default_factory=Llama3Args)
    vision: VisionArgs = field(default_factory=VisionArgs)
    audio: AudioArgs = field(default_factory=AudioArgs)
    gen_image: GenImageArgs = field(default_factory=GenImageArgs)

    @property
    def llm_args(self) -> Llama3Args:
        return self.llm

    def build_encoders(self) -> dict[str, OmniEncoder]:
        dim = self.llm.dim
        return {"vision": VisionEncoder(self.vision, dim), "audio": AudioEncoder(self.audio, dim)}

    def build_decoders(self) -> dict[str, OmniDecoder]:
        return {"gen_image": GenImageDecoder(self.gen_image, self.llm.dim)}


def debug_llm() -> Llama3Args:
    """A 2-layer Llama for CPU runs (the vocabulary comes from the tokenizer)."""
    return Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048,
                      ffn_hidden_dim=128, rope_theta=10000.0, rope_scaling=None, max_seq_len=512)


FLAVORS = {
    "debugmodel": LlamaOmniArgs(
        llm=debug_llm(), vision=VisionArgs.debug(), audio=AudioArgs.debug(),
        gen_image=GenImageArgs.debug(), vocab_from_tokenizer=True,
    ),
    # Llama-3.1-8B (same weights shape as Llama-3-8B; RoPE with the 3.1 long-context scaling),
    # Qwen2-VL-7B's vision tower, Whisper-large-v3's encoder, Janus-Pro's VQ-16 generation.
    "8B": LlamaOmniArgs(),
    # Flavor hf: the LLM from weights.sources llm=<folder>/config.json (LlamaForCausalLM: Llama
    # 2, 3, 3.1, 3.2), the parts of 8B (or of model.parts_flavor), encoders from their folders.
    HF_FLAVOR: LlamaOmniArgs(from_hf=True),
}
