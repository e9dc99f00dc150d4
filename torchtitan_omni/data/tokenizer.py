"""The omni tokenizer: TorchTitan's Hugging Face tokenizer plus the omni special tokens.

``build_omni_tokenizer(job_config)`` loads ``tokenizer.json`` from ``model.hf_assets_path``
(building the bundled default dataset and its tokenizer first when the job trains on
``omni_default`` and the files are missing). The special tokens of
``torchtitan_omni.data.special_tokens`` are resolved to ids:

- a tokenizer that contains them (the bundled one) uses them as they are;
- a Llama-3 tokenizer keeps its vocabulary: bos/eos/end-of-turn/pad map onto its native
  tokens (``special_tokens.LLAMA3_NATIVE``) and every other omni token onto the lowest free
  ``<|reserved_special_token_K|>``, in ``special_tokens.omni_tokens()`` order (the built-ins'
  ``ORDER``, then the tokens of registered modalities);
- any other tokenizer gets the omni tokens it cannot map as new special tokens, with ids after
  its last one (``add_omni_tokens``); the model args see the same tokens
  (``tokenizer_layout``) and grow the embedding and head to hold them.

``tokenizer_folder(job_config)`` says where ``tokenizer.json`` is: ``model.hf_assets_path``, or
with ``model.flavor = "hf"`` the LLM's ``weights.sources`` folder unless ``hf_assets_path``
names another folder than the bundled tokenizer's (``./assets/tokenizer``) or TorchTitan's
default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from tokenizers import AddedToken, Tokenizer
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.tools.logging import logger

from torchtitan_omni.data import special_tokens as st
from torchtitan_omni.data.default_dataset import maybe_build_default
from torchtitan_omni.protocols.modality import modality_names
from torchtitan_omni.protocols.model import HF_FLAVOR

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


#: folders of ``model.hf_assets_path`` that name no tokenizer of the user's: the bundled
#: tokenizer's (every shipped TOML) and TorchTitan's default
DEFAULT_TOKENIZER_DIRS = ("assets/tokenizer", "tests/assets/tokenizer")


def _map_special_tokens(vocab: dict[str, int]) -> tuple[dict[str, str], list[str]]:
    """Omni token -> the token of ``vocab`` it maps onto, and the omni tokens left unmapped."""
    reserved = sorted(
        (int(m.group(1)), tok) for tok in vocab if (m := _RESERVED.match(tok))
    )
    free = [tok for _, tok in reserved]
    order = st.omni_tokens()
    used = set(order) & set(vocab)
    mapping: dict[str, str] = {}
    missing = []
    for name in order:
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
    return mapping, missing


def resolve_special_tokens(vocab: dict[str, int], where: str = "the tokenizer") -> SpecialTokenIds:
    """Map every omni special token onto a token of ``vocab`` (see the module docstring)."""
    mapping, missing = _map_special_tokens(vocab)
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
            for m in modality_names()
        },
        mapping=mapping,
    )


@dataclass(frozen=True)
class TokenizerLayout:
    """A tokenizer's ids: its own tokens ``[0, base_size)``, then the omni tokens it lacked."""

    base_size: int
    added: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Ids in use once the omni tokens are added."""
        return self.base_size + len(self.added)


def add_omni_tokens(tokenizer: Tokenizer) -> TokenizerLayout:
    """Add the omni special tokens ``tokenizer`` cannot map (no such token, no native or free
    reserved one) as special tokens with the next ids, in ``special_tokens.omni_tokens()``
    order."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    base = max(vocab.values()) + 1 if vocab else 0
    _, missing = _map_special_tokens(vocab)
    if missing:
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in missing])
        ids = [tokenizer.token_to_id(t) for t in missing]
        if ids != list(range(base, base + len(missing))):
            raise ValueError(f"adding the omni special tokens gave ids {ids}, expected "
                             f"{base}..{base + len(missing) - 1}")
    return TokenizerLayout(base, tuple(missing))


def tokenizer_layout(folder: str) -> TokenizerLayout | None:
    """The ids of the tokenizer in ``folder`` with the omni tokens added (None: no
    ``tokenizer.json`` there)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    return add_omni_tokens(Tokenizer.from_file(path))


def save_with_omni_tokens(folder: str, out: str) -> bool:
    """Write ``folder``'s tokenizer.json with the omni tokens it lacked into ``out`` (an export
    whose embedding has their rows); False when it lacked none (nothing written)."""
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    if not add_omni_tokens(tokenizer).added:
        return False
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    return True


def tokenizer_folder(job_config) -> str:
    """The folder of the job's ``tokenizer.json`` (see the module docstring)."""
    path = job_config.model.hf_assets_path
    if getattr(job_config.model, "flavor", None) != HF_FLAVOR:
        return path
    chosen = os.path.normpath(path) if path else None
    if chosen and chosen not in DEFAULT_TOKENIZER_DIRS:
        return path
    for entry in job_config.weights.sources:
        part, _, folder = entry.partition("=")
        if part.strip() == "llm":
            return os.path.expanduser(folder.strip())
    return path


class OmniTokenizer(HuggingFaceTokenizer):
    """A ``tokenizer.json`` tokenizer with the omni special tokens resolved (``special``),
    those it lacked added (``layout``)."""

    def __init__(self, tokenizer_path: str) -> None:
        super().__init__(tokenizer_path)
        self.layout = add_omni_tokens(self.tokenizer)
        if self.layout.added:
            logger.info(f"Tokenizer {tokenizer_path}: added {len(self.layout.added)} omni "
                        f"special tokens as ids {self.layout.base_size}..{self.layout.size - 1}")
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
    """The job's tokenizer from :func:`tokenizer_folder` (TorchTitan's ``build_tokenizer_fn``).

    When ``training.dataset`` is ``omni_default``, ``data.build_if_missing`` is set and the
    folder has no ``tokenizer.json``, the bundled dataset and tokenizer are built first (once,
    under a file lock, whichever rank gets there first).
    """
    path = tokenizer_folder(job_config)
    maybe_build_default(job_config)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        if path != job_config.model.hf_assets_path:
            raise FileNotFoundError(
                f"no tokenizer.json in {path!r} (the LLM's weights.sources folder, where "
                "model.flavor = 'hf' takes the tokenizer from); put it there or point "
                "model.hf_assets_path at a folder with one")
        raise FileNotFoundError(
            f"no tokenizer.json in model.hf_assets_path={path!r}; point it at a folder with a "
            "Hugging Face tokenizer.json, or train on training.dataset='omni_default' to build "
            "the bundled tokenizer there"
        )
    return OmniTokenizer(path)
