"""How a part's tensors map onto a Hugging Face safetensors checkpoint.

An adapter declares, for each of our tensors (names relative to the part, e.g.
``layers.0.attention.wq.weight``), which HF tensors it is made of. The declaration is
structural (one key, or keys stacked along a dimension, optionally transposed) so that the
sharded loader (``torchtitan_omni.checkpoint``) can read only the slice a rank owns, and the
exporter can split full tensors back into HF tensors, from the same table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class HFSource:
    """Where one of our tensors comes from in a Hugging Face checkpoint."""

    #: one HF key, or several stacked along ``stack_dim`` (e.g. per-expert weights)
    keys: tuple[str, ...]
    #: our tensor is ``torch.stack([hf[k] for k in keys], dim=stack_dim)``; None: one key
    stack_dim: int | None = None
    #: each HF tensor (2-D) is the transpose of its slice of ours
    transpose: bool = False
    #: dim-0 size of the HF tensor when it has fewer rows than ours (a vocabulary grown by
    #: added tokens); None: the same as ours
    hf_rows: int | None = None
    #: ``[start, stop)``: our rows that loading sets to the mean of the HF rows ``[0, start)``
    #: (embeddings of added tokens); the exporter writes every row as it is
    mean_rows: tuple[int, int] | None = None


class HFAdapter(ABC):
    """Maps one part of an omni model (the LLM, an encoder, a decoder) to HF tensor names."""

    @abstractmethod
    def sources(self) -> dict[str, HFSource]:
        """Our tensor name (relative to the part) -> its HF source, for every loadable tensor."""

    def ignored_hf_keys(self) -> tuple[str, ...]:
        """``fnmatch`` patterns of HF keys that are knowingly not loaded (e.g. rotary tables)."""
        return ()

    def init_only(self) -> tuple[str, ...]:
        """``fnmatch`` patterns of our tensors the checkpoint knowingly lacks (e.g. a projector
        to a new LLM width): they have no source and keep their initialization."""
        return ()

    @abstractmethod
    def hf_config(self) -> dict:
        """The ``config.json`` written next to an exported checkpoint."""
