"""Names of the omni special tokens, shared by the data pipeline and generation code.

Every modality has a begin, a placeholder ("pad") and an end token; text has bos/eos/pad, and
chats have one marker per role plus an end-of-turn marker. The bundled tokenizer contains these
strings; a real Llama-3 tokenizer maps them onto its own and its reserved special tokens
(:data:`LLAMA3_NATIVE`, then ``<|reserved_special_token_K|>`` in :data:`ORDER`), see
``torchtitan_omni.data.tokenizer``.
"""

from __future__ import annotations

from torchtitan_omni.protocols.batch import AUDIO, GEN_IMAGE, IMAGE, MODALITIES, VIDEO

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"

SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END_OF_TURN = "<|end_of_turn|>"

ROLE_MARKERS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


def media_start(modality: str) -> str:
    """Token opening one item of ``modality``, e.g. ``<|image_start|>``."""
    return f"<|{modality}_start|>"


def media_pad(modality: str) -> str:
    """Placeholder token repeated once per embedding row of an item of ``modality``."""
    return f"<|{modality}_pad|>"


def media_end(modality: str) -> str:
    """Token closing one item of ``modality``."""
    return f"<|{modality}_end|>"


MEDIA_TOKENS = tuple(
    fn(m) for m in MODALITIES for fn in (media_start, media_pad, media_end)
)

#: every omni special token, in the order they are assigned to reserved tokens
ORDER: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END_OF_TURN) + MEDIA_TOKENS

#: Llama-3 tokens that already mean what an omni token means (the rest take reserved tokens)
LLAMA3_NATIVE = {
    BOS: "<|begin_of_text|>",
    EOS: "<|end_of_text|>",
    END_OF_TURN: "<|eot_id|>",
    PAD: "<|finetune_right_pad_id|>",  # Llama-3.1+; Llama-3.0 takes a reserved token instead
}

#: placeholders written in sample text, one per understanding or generated item
PLACEHOLDERS = {IMAGE: "<image>", VIDEO: "<video>", AUDIO: "<audio>", GEN_IMAGE: "<gen_image>"}

__all__ = [
    "BOS", "EOS", "PAD", "SYSTEM", "USER", "ASSISTANT", "END_OF_TURN", "ROLE_MARKERS",
    "media_start", "media_pad", "media_end", "MEDIA_TOKENS", "ORDER", "LLAMA3_NATIVE",
    "PLACEHOLDERS", "IMAGE", "VIDEO", "AUDIO", "GEN_IMAGE",
]
