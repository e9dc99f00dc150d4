"""Names of the omni special tokens, shared by the data pipeline and generation code.

Every modality has a begin, a placeholder ("pad") and an end token; text has bos/eos/pad, and
chats have one marker per role plus an end-of-turn marker. The bundled tokenizer contains these
strings; a real Llama-3 tokenizer maps them onto its own and its reserved special tokens
(:data:`LLAMA3_NATIVE`, then ``<|reserved_special_token_K|>`` in :data:`ORDER`), see
``torchtitan_omni.data.tokenizer``.

Media tokens and placeholders come from the modality registry
(``torchtitan_omni.protocols.modality``): the built-ins' tokens keep their frozen place in
:data:`ORDER`, and a registered modality's tokens follow them (:func:`omni_tokens`).
"""

from __future__ import annotations

import torchtitan_omni.data.processors  # noqa: F401  (registers the built-in modalities)
from torchtitan_omni.protocols.batch import AUDIO, GEN_IMAGE, IMAGE, MODALITIES, VIDEO
from torchtitan_omni.protocols.modality import get_modality, media_token, modalities

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
    return media_token(modality, "start")


def media_pad(modality: str) -> str:
    """Placeholder token repeated once per embedding row of an item of ``modality``."""
    return media_token(modality, "pad")


def media_end(modality: str) -> str:
    """Token closing one item of ``modality``."""
    return media_token(modality, "end")


#: the built-in modalities' media tokens (frozen: the bundled tokenizer was trained on them)
MEDIA_TOKENS = tuple(
    fn(m) for m in MODALITIES for fn in (media_start, media_pad, media_end)
)

#: the built-in omni special tokens, in the order they are assigned to reserved tokens
ORDER: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END_OF_TURN) + MEDIA_TOKENS


def media_tokens() -> tuple[str, ...]:
    """The media tokens of every registered modality."""
    return tuple(t for m in modalities() for t in m.tokens)


def omni_tokens() -> tuple[str, ...]:
    """Every omni special token: :data:`ORDER`, then the tokens of registered modalities that
    are not built in (registration order), so existing ids never move."""
    return ORDER + tuple(t for t in media_tokens() if t not in ORDER)


def placeholders() -> dict[str, str]:
    """Modality -> the placeholder written in sample text (``"<image>"``), every registered
    modality."""
    return {m.name: m.placeholder for m in modalities()}


def placeholder(modality: str) -> str:
    """The placeholder of one registered modality."""
    return get_modality(modality).placeholder

#: Llama-3 tokens that already mean what an omni token means (the rest take reserved tokens)
LLAMA3_NATIVE = {
    BOS: "<|begin_of_text|>",
    EOS: "<|end_of_text|>",
    END_OF_TURN: "<|eot_id|>",
    PAD: "<|finetune_right_pad_id|>",  # Llama-3.1+; Llama-3.0 takes a reserved token instead
}

__all__ = [
    "BOS", "EOS", "PAD", "SYSTEM", "USER", "ASSISTANT", "END_OF_TURN", "ROLE_MARKERS",
    "media_start", "media_pad", "media_end", "MEDIA_TOKENS", "ORDER", "LLAMA3_NATIVE",
    "media_tokens", "omni_tokens", "placeholders", "placeholder", "IMAGE", "VIDEO", "AUDIO",
    "GEN_IMAGE",
]
