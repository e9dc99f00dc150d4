"""The omni tokenizer: TorchTitan's Hugging Face tokenizer plus the omni special tokens.

``build_omni_tokenizer(job_config)`` loads ``tokenizer.json`` from ``model.hf_assets_path``
(building the bundled default dataset and its tokenizer first when the job trains on
``omni_default`` and the files are missing). The special tokens of
``torchtitan_omni.data.special_tokens`` are resolved to ids:

- a tokenizer that contains them (the bundled one) uses them as they are;
- a Llama-3 tokenizer keeps its vocabulary: bos/eos/end-of-turn/pad map onto its native
  tokens (``special_tokens.LLAMA3_NATIVE``) and every other omni token onto the lowest free
  ``<|reserved_special_token_K|>``, in ``special_tokens.ORDER``;
- any other tokenizer lacking them is refused with the list of missing tokens (growing the
  vocabulary here would disagree with the model's embedding size, which is read from
  ``tokenizer.json``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from torchtitan_omni.data import special_tokens as st
from torchtitan_omni.protocols.batch import MODALITIES

_RESERVED = re.compile(r"^<\|reserved_special_token_(\d+)\|>$")


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the omni special tokens in one tokenizer, and the strings they map to."""

    bos: int
    eos: int
    pad: int
    end_of_turn: int
    roles: dict[str, int]
    #: modality -> (start, pad, end)
    media: dict[str, tuple[int, int, int]]
    #: omni token name -> the tokenizer's token string it maps to
    mapping: dict[str, str] = field(default_factory=dict)

    def role(self, role: str) -> int:
        """Id of the marker of a chat role ("system", "user", "assistant")."""
        return self.roles[role]

    def media_ids(self, modality: str) -> tuple[int, int, int]:
        """(start, pad, end) ids of ``modality``."""
        return self.media[modality]


def resolve_special_tokens(vocab: dict[str, int], where: str = "the tokenizer") -> SpecialTokenIds:
    """Map every omni special token onto a token of ``vocab`` (see the module docstring)."""
    reserved = sorted(
        (int(m.group(1)), tok) for tok in vocab if (m := _RESERVED.match(tok))
    )
    free = [tok for _, tok in reserved]
    used = set(st.ORDER) & set(vocab)
    mapping: dict[str, str] = {}
    missing = []
    for name in st.ORDER:
        if name in vocab:
            mapping[name] = name
            continue
        native = st.LLAMA3_NATIVE.get(name)
        if native is not None and native in vocab and native not in used:
            mapping[name] = native
            used.add(native)
            continue
        while free and free[0] in used:
            free.pop(0)
        if free:
            mapping[name] = free.pop(0)
            used.add(mapping[name])
        else:
            missing.append(name)
    if missing:
        raise ValueError(
            f"{where} lacks the omni special tokens {', '.join(missing)} and has no reserved "
            "special tokens to map them onto; add them to its tokenizer.json (added_tokens, "
            "special) or use the bundled tokenizer"
        )
    ids = {name: vocab[tok] for name, tok in mapping.items()}
    return SpecialTokenIds(
        bos=ids[st.BOS], eos=ids[st.EOS], pad=ids[st.PAD], end_of_turn=ids[st.END_OF_TURN],
        roles={role: ids[marker] for role, marker in st.ROLE_MARKERS.items()},
        media={
            m: (ids[st.media_start(m)], ids[st.media_pad(m)], ids[st.media_end(m)])
            for m in MODALITIES
        },
        mapping=mapping,
    )


class OmniTokenizer(HuggingFaceTokenizer):
    """A ``tokenizer.json`` tokenizer with the omni special tokens resolved (``special``)."""

    def __init__(self, tokenizer_path: str) -> None:
        super().__init__(tokenizer_path)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.special = resolve_special_tokens(vocab, os.path.join(tokenizer_path, "tokenizer.json"))
        self.bos_id, self.eos_id = self.special.bos, self.special.eos
        self.pad_id = self.special.pad
        self.bos_token = self.special.mapping[st.BOS]
        self.eos_token = self.special.mapping[st.EOS]

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text, without bos/eos or any template (the pipeline adds those)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode_text` of several texts (a plain loop: for a sample's few short pieces,
        ``encode_batch``'s thread pool costs ~50x more than it saves)."""
        return [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def build_omni_tokenizer(job_config) -> OmniTokenizer:
    """The job's tokenizer from ``model.hf_assets_path`` (TorchTitan's ``build_tokenizer_fn``).

    When ``training.dataset`` is ``omni_default``, ``data.build_if_missing`` is set and the
    folder has no ``tokenizer.json``, the bundled dataset and tokenizer are built first (once,
    under a file lock, whichever rank gets there first).
    """
    from torchtitan_omni.data.default_dataset import maybe_build_default

    path = job_config.model.hf_assets_path
    maybe_build_default(job_config)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(
            f"no tokenizer.json in model.hf_assets_path={path!r}; point it at a folder with a "
            "Hugging Face tokenizer.json, or train on training.dataset='omni_default' to build "
            "the bundled tokenizer there"
        )
    return OmniTokenizer(path)
