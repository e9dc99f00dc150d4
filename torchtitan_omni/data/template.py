"""The token layout of samples (the chat template), shared with generation code.

A chat sample is ``bos``, then per turn ``<role marker> content <end_of_turn>``, then ``eos``;
a plain-text sample is ``bos text eos``. A media item in the content is
``<m_start> <m_pad> x n <m_end>``. Image generation: the assistant turn holds
``<gen_image_start> <gen_image_pad> x N <gen_image_end>``; for classifier-free guidance the
unconditional prompt replaces every token between ``bos`` and ``<gen_image_start>`` by the
pad token (:func:`generation_prompt` builds both prompts the way training saw them).
"""

from __future__ import annotations

from torchtitan_omni.protocols.batch import GEN_IMAGE


def generation_prompt(tokenizer, caption: str, unconditional: bool = False) -> list[int]:
    """Ids up to and including ``<gen_image_start>`` for generating an image of ``caption``.

    ``tokenizer`` is an ``OmniTokenizer``. The unconditional prompt has the same length with
    the caption (and its turn markers) replaced by pad tokens, as in training's caption drop.
    """
    sp = tokenizer.special
    start = sp.media_ids(GEN_IMAGE)[0]
    ids = [sp.bos, sp.role("user"), *tokenizer.encode_text(caption), sp.end_of_turn,
           sp.role("assistant")]
    if unconditional:
        ids = [sp.bos] + [sp.pad] * (len(ids) - 1)
    return ids + [start]


def drop_prompt(tokens: list[int], pad: int, stop: int) -> list[int]:
    """``tokens`` with everything between the first token and position ``stop`` padded."""
    return tokens[:1] + [pad] * (stop - 1) + tokens[stop:]
