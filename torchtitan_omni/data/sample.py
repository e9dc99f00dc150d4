"""Rows of a data file -> :class:`Sample`: chat turns or plain text, and media references.

Accepted row shapes (one JSONL line or Parquet row; docs/data.md has examples):

- ``{"messages": [{"role": "user", "content": "<image>What is this?"}, ...], "images": [...]}``
  (OpenAI style; ``content`` may also be a list of parts ``{"type": "text", "text": ...}`` /
  ``{"type": "image", "image": <ref>}``, a part without a value taking the next top-level item);
- ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}], "image": ...}``
  (ShareGPT / LLaVA);
- ``{"text": "..."}`` plain text (may hold placeholders: interleaved documents);
- ``{"caption": "...", "gen_image": <ref>}`` image generation, short for a user turn with the
  caption and an assistant turn ``<gen_image>``;
- ``{"question_audio": <ref>, "answer": "..."}`` a spoken question and its text answer
  (VoiceAssistant-400K): a user turn ``<audio>``, an assistant turn with the answer.

LLaVA-Video rows mark their video with ``<image>``: a sample with videos, no images and no
``<video>`` placeholder, whose ``<image>`` placeholders are as many as its videos, reads them
as ``<video>``.

Media live under each registered modality's row keys (``torchtitan_omni.protocols.modality``;
``images``/``image``, ``videos``/``video``, ``audios``/``audio``, ``gen_images``/``gen_image``
for the built-ins): a path relative to the dataset root, bytes, ``{"bytes":...,
"path":...}`` or a ``data:`` URL, or a list of these, one per placeholder in order.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from torchtitan_omni.data import special_tokens as st
from torchtitan_omni.data.bad_samples import (
    EMPTY_CONVERSATION, EMPTY_TEXT, INVALID_JSON, MALFORMED, PLACEHOLDER_MISMATCH,
    UNKNOWN_PLACEHOLDER, BadSample, Source,
)
from torchtitan_omni.data.jsonl import UnreadableLine
from torchtitan_omni.protocols.batch import AUDIO, GEN_IMAGE, IMAGE, VIDEO
from torchtitan_omni.protocols.modality import (
    get_modality, modalities, modality_names, registry_version,
)

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant",
    "gpt": "assistant", "model": "assistant", "bot": "assistant",
}


#: the row key of a spoken question (VoiceAssistant-400K), answered by the row's "answer"
QUESTION_AUDIO = "question_audio"


def media_keys() -> dict[str, tuple[str, ...]]:
    """Modality -> its row keys ("images"/"image", ...), every registered modality."""
    return {m.name: m.keys for m in modalities()}


@functools.lru_cache(maxsize=4)
def _placeholders(version: int) -> tuple[re.Pattern, dict[str, str]]:
    """The placeholder pattern and placeholder -> modality of one registry version."""
    of = {m.placeholder: m.name for m in modalities()}
    # longest first: a placeholder that is a prefix of another must not win
    pattern = re.compile("|".join(re.escape(p) for p in sorted(of, key=len, reverse=True)))
    return pattern, of


def _modality_of() -> dict[str, str]:
    return _placeholders(registry_version())[1]


# Tags that look like a media placeholder but are not one (e.g. <img>, <image_1>, <Audio>).
_LOOKALIKE = re.compile(
    r"<\s*/?\s*(?:gen[_ ]?)?(?:image|img|picture|video|vid|audio|speech|sound)[^<>\n]{0,24}>",
    re.IGNORECASE,
)


@dataclass
class Turn:
    """One chat turn: a role and its text, placeholders included."""

    role: str
    text: str


@dataclass
class Sample:
    """One parsed row: chat ``turns`` or plain ``text``, and media refs per modality."""

    source: Source
    turns: list[Turn] | None = None
    text: str | None = None
    media: dict[str, list[Any]] = field(default_factory=dict)

    def segments(self) -> list[tuple[str, str]]:
        """(role, text) pieces in order; plain text has role "text"."""
        if self.turns is None:
            return [("text", self.text or "")]
        return [(t.role, t.text) for t in self.turns]


def split_placeholders(text: str) -> list[str | tuple[str]]:
    """``text`` as plain strings and ``(modality,)`` markers, in order."""
    out: list[str | tuple[str]] = []
    pos = 0
    pattern, modality_of = _placeholders(registry_version())
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        out.append((modality_of[m.group(0)],))
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [v for v in value if v is not None]
    return [value]


def _row_media(row: dict, source: Source) -> dict[str, list[Any]]:
    media = {}
    for modality, keys in media_keys().items():
        present = [k for k in keys if row.get(k) is not None]
        if len(present) == 2 and _as_list(row[keys[0]]) and _as_list(row[keys[1]]):
            raise BadSample(MALFORMED, f"both {keys[0]!r} and {keys[1]!r} are set", source)
        media[modality] = _as_list(row[present[0]]) if present else []
    return media


def _content_text(content: Any, media: dict[str, list[Any]], inline: dict[str, list[Any]],
                  source: Source) -> str:
    """Message content (a string or a list of typed parts) as text with placeholders."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise BadSample(MALFORMED, f"message content of type {type(content).__name__}", source)
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            pieces.append(part.get("text") or "")
        elif kind in inline:
            pieces.append(st.placeholder(kind))
            value = next(
                (part[k] for k in (kind, "path", "url", "bytes") if part.get(k) is not None), None
            )
            inline[kind].append(value)
        else:
            raise BadSample(MALFORMED, f"unknown content part {part!r:.80}", source)
    return "".join(pieces)


def _turns(key: str, messages: Any, role_key: str, text_key: str, media, inline,
           source) -> list[Turn]:
    if not isinstance(messages, (list, tuple)):
        raise BadSample(
            MALFORMED, f"{key!r} is a {type(messages).__name__}, not a list of turns", source)
    if not messages:
        raise BadSample(EMPTY_CONVERSATION, f"{key!r} is an empty list: no turns", source)
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadSample(MALFORMED, f"turn {i} of {key!r} is not an object", source)
        role = ROLE_ALIASES.get(str(msg.get(role_key, "")).lower())
        if role is None:
            raise BadSample(
                MALFORMED, f"turn {i} of {key!r} has unknown role {msg.get(role_key)!r}", source)
        turns.append(Turn(role, _content_text(msg.get(text_key), media, inline, source)))
    if not any(t.text.strip() for t in turns):
        raise BadSample(
            EMPTY_CONVERSATION, f"all {len(turns)} turn(s) of {key!r} have empty content", source)
    return turns


def _merge_inline(media, inline, source) -> None:
    """Content parts either all carry their media, or all take the top-level lists."""
    for modality, values in inline.items():
        if not values:
            continue
        given = [v for v in values if v is not None]
        if given and len(given) != len(values):
            raise BadSample(MALFORMED, f"some {modality} parts carry media and some do not", source)
        if given:
            if media[modality]:
                raise BadSample(
                    MALFORMED,
                    f"{modality} given both in content parts and at the top level",
                    source,
                )
            media[modality] = given


def _audio_question(row: dict, media: dict[str, list[Any]], source: Source) -> list[Turn]:
    """The turns of a spoken question and its text answer. The row's ``question`` (the audio's
    transcript in VoiceAssistant-400K) is not shown: the model is to listen to the question."""
    if media[AUDIO]:
        raise BadSample(MALFORMED, f"both {QUESTION_AUDIO!r} and an audio list are set", source)
    answer = row.get("answer")
    if not isinstance(answer, str):
        raise BadSample(MALFORMED, f"{QUESTION_AUDIO!r} with an 'answer' of type "
                        f"{type(answer).__name__}, not a string", source)
    media[AUDIO] = _as_list(row[QUESTION_AUDIO])
    return [Turn("user", st.placeholder(AUDIO) * len(media[AUDIO])), Turn("assistant", answer)]


def _rewrite(text: str, old: str, new: str) -> str:
    """``text`` with each ``old`` placeholder written as ``new``'s (other text kept as is)."""
    return "".join(
        piece if isinstance(piece, str) else st.placeholder(new if piece[0] == old else piece[0])
        for piece in split_placeholders(text)
    )


def _video_as_image_placeholders(sample: Sample) -> None:
    """LLaVA-Video's convention: ``<image>`` placeholders standing for the row's videos."""
    videos = len(sample.media.get(VIDEO, []))
    if not videos or sample.media.get(IMAGE):
        return
    counts = {IMAGE: 0, VIDEO: 0}
    for _, text in sample.segments():
        for piece in split_placeholders(text):
            if isinstance(piece, tuple) and piece[0] in counts:
                counts[piece[0]] += 1
    if counts[VIDEO] or counts[IMAGE] != videos:
        return  # not that convention: the placeholder check says what does not match
    if sample.turns is None:
        sample.text = _rewrite(sample.text or "", IMAGE, VIDEO)
    for turn in sample.turns or []:
        turn.text = _rewrite(turn.text, IMAGE, VIDEO)


def _check_placeholders(sample: Sample) -> None:
    counts = dict.fromkeys(modality_names(), 0)
    known = _modality_of()
    for role, text in sample.segments():
        for token in st.media_tokens():
            if token in text:
                raise BadSample(
                    UNKNOWN_PLACEHOLDER, f"text contains the special token {token}", sample.source
                )
        for m in _LOOKALIKE.finditer(text):
            if m.group(0) not in known:
                raise BadSample(
                    UNKNOWN_PLACEHOLDER,
                    f"unknown placeholder {m.group(0)!r} (known: "
                    f"{', '.join(known)})",
                    sample.source,
                )
        for piece in split_placeholders(text):
            if isinstance(piece, tuple):
                counts[piece[0]] += 1
                # a generated item is the model's answer: never in a prompt
                if get_modality(piece[0]).is_target and role in ("user", "system"):
                    raise BadSample(
                        MALFORMED, f"{st.placeholder(piece[0])} in a {role} turn", sample.source
                    )
    for modality, n in counts.items():
        have = len(sample.media.get(modality, []))
        if n != have:
            raise BadSample(
                PLACEHOLDER_MISMATCH,
                f"{n} {st.placeholder(modality)} placeholder(s) but {have} {modality} item(s)",
                sample.source,
            )


def parse_row(row: dict, source: Source) -> Sample:
    """Parse one row (see the module docstring); raises :class:`BadSample` if malformed."""
    if isinstance(row, UnreadableLine):
        raise BadSample(INVALID_JSON, row.describe(), source)
    if not isinstance(row, dict):
        raise BadSample(MALFORMED, f"the row is a JSON {type(row).__name__}, not an object", source)
    media = _row_media(row, source)
    inline: dict[str, list[Any]] = {m: [] for m in modality_names()}
    if row.get("messages") is not None:
        sample = Sample(source, turns=_turns("messages", row["messages"], "role", "content",
                                             media, inline, source))
    elif row.get("conversations") is not None:
        sample = Sample(source, turns=_turns("conversations", row["conversations"], "from",
                                             "value", media, inline, source))
    elif row.get(QUESTION_AUDIO) is not None:
        sample = Sample(source, turns=_audio_question(row, media, source))
    elif row.get("caption") is not None and media[GEN_IMAGE]:
        sample = Sample(source, turns=[
            Turn("user", str(row["caption"])), Turn("assistant", st.placeholder(GEN_IMAGE))
        ])
    elif row.get("text") is not None:
        if not isinstance(row["text"], str):
            raise BadSample(
                MALFORMED, f"'text' is a {type(row['text']).__name__}, not a string", source)
        if not row["text"].strip():
            what = "an empty string" if not row["text"] else "only whitespace"
            raise BadSample(EMPTY_TEXT, f"'text' is {what}: nothing to train on", source)
        sample = Sample(source, text=row["text"])
    else:
        keys = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
        raise BadSample(
            MALFORMED,
            f"no 'messages', 'conversations', 'text', 'caption'+'gen_image' or "
            f"'question_audio'+'answer' (keys: {keys})",
            source,
        )
    _merge_inline(media, inline, source)
    sample.media = {m: v for m, v in media.items() if v}
    _video_as_image_placeholders(sample)
    _check_placeholders(sample)
    return sample
