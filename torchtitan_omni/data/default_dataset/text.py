"""Real English text for language modelling: the Python reference's topic texts, which ship with
every CPython (``pydoc_data.topics``), cut into paragraphs."""

from __future__ import annotations

import re
from pydoc_data.topics import topics


def paragraphs(max_chars: int = 700, min_chars: int = 80) -> list[str]:
    """Paragraphs of the pydoc topics, merged or cut to at most ``max_chars`` characters."""
    out = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(block.split())
            if len(text) < min_chars or set(text) <= set("*=-^~ "):
                continue
            while len(text) > max_chars:
                cut = text.rfind(". ", 0, max_chars)
                cut = cut + 1 if cut > max_chars // 3 else max_chars
                out.append(text[:cut].strip())
                text = text[cut:].strip()
            if len(text) >= min_chars:
                out.append(text)
    return out
