"""``janus`` arguments and flavors: DeepSeek-LLM (Llama-shaped) + SigLIP understanding encoder
with Janus' aligner + VQ image generation (Janus-style decoupled visual encoding)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_omni.decoders.gen_image import GenImageArgs, GenImageDecoder
from torchtitan_omni.encoders.siglip import SiglipArgs, SiglipEncoder
from torchtitan_omni.foundations.hf_config import LLAMA
from torchtitan_omni.foundations.llama3 import Llama3Args
from torchtitan_omni.model_args import HF_FLAVOR, OmniModelArgs
from torchtitan_omni.protocols.modules import OmniDecoder, OmniEncoder


def deepseek_llm_1_3b() -> Llama3Args:
    """Janus-1.3B's language model: DeepSeek-LLM 1.3B (multi-head attention, no RoPE scaling)."""
    return Llama3Args(
        dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=102400, ffn_hidden_dim=5632,
        norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_seq_len=16384,
    )


@dataclass
class JanusArgs(OmniModelArgs):
    """Foundation, understanding encoder and generation decoder of ``janus`` (defaults: 1.3B)."""

    hf_foundations = (LLAMA,)

    llm: Llama3Args = field(default_factory=deepseek_llm_1_3b)
    vision: SiglipArgs = field(default_factory=SiglipArgs.janus)
    gen_image: GenImageArgs = field(default_factory=GenImageArgs)

    @property
    def llm_args(self) -> Llama3Args:
        return self.llm

    def build_encoders(self) -> dict[str, OmniEncoder]:
        return {"vision": SiglipEncoder(self.vision, self.llm.dim)}

    def build_decoders(self) -> dict[str, OmniDecoder]:
        return {"gen_image": GenImageDecoder(self.gen_image, self.llm.dim)}


FLAVORS = {
    "debugmodel": JanusArgs(
        llm=Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=2048,
                       ffn_hidden_dim=128, norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                       max_seq_len=512),
        vision=SiglipArgs.debug(), gen_image=GenImageArgs.debug(), vocab_from_tokenizer=True,
    ),
    # Janus-1.3B: SigLIP-L/16 @ 384 (576 tokens), VQ-16 with 16384 codes (576 image tokens).
    "1.3B": JanusArgs(),
    # Flavor hf: the LLM from weights.sources llm=<folder>/config.json (LlamaForCausalLM), the
    # parts of 1.3B (or of model.parts_flavor), the vision tower from its own folder's config.
    HF_FLAVOR: JanusArgs(from_hf=True),
}
