"""Base class of every omni model spec's arguments (one instance per flavor)."""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from dataclasses import dataclass

import torch.nn as nn

from torchtitan.config import JobConfig
from torchtitan.protocols.model import BaseModelArgs


def tokenizer_vocab_size(hf_assets_path: str) -> int | None:
    """Vocabulary size (regular + added tokens) of ``tokenizer.json`` in ``hf_assets_path``."""
    path = os.path.join(hf_assets_path, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tok = json.load(f)
    ids = set(tok.get("model", {}).get("vocab", {}).values())
    ids.update(t["id"] for t in tok.get("added_tokens", []))
    return max(ids) + 1 if ids else None


@dataclass
class OmniModelArgs(BaseModelArgs):
    """Arguments of an omni model: its foundation, encoders and decoders.

    Subclasses hold the parts' argument dataclasses and implement :meth:`processing` (so the
    data pipeline can process media before the model exists) and
    :meth:`validate_parallelism`.
    """

    #: debug flavors size the vocabulary to the tokenizer in ``model.hf_assets_path``;
    #: real flavors keep their Hugging Face vocabulary (the tokenizer must fit in it)
    vocab_from_tokenizer: bool = False

    @property
    @abstractmethod
    def llm_args(self):
        """The foundation's argument dataclass (has ``vocab_size`` and ``max_seq_len``)."""

    @abstractmethod
    def processing(self) -> dict[str, object]:
        """Processor config per modality (``torchtitan_omni.protocols.processing``)."""

    @abstractmethod
    def validate_parallelism(self, ulysses_degree: int, expert_parallel_degree: int) -> str | None:
        """A one-line problem with these degrees for this model, or None."""

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        """Fit the sequence length and (debug flavors) the vocabulary to the job."""
        llm = self.llm_args
        llm.max_seq_len = max(llm.max_seq_len, job_config.training.seq_len)
        vocab = tokenizer_vocab_size(job_config.model.hf_assets_path)
        if vocab is None:
            return
        if self.vocab_from_tokenizer:
            llm.vocab_size = vocab
        elif vocab > llm.vocab_size:
            raise ValueError(
                f"the tokenizer in {job_config.model.hf_assets_path} has {vocab} tokens, more "
                f"than the model's vocabulary ({llm.vocab_size})"
            )

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token at ``seq_len`` (see ``flops``)."""
        from torchtitan_omni.flops import nparams_and_flops_per_token

        return nparams_and_flops_per_token(self, model, seq_len)
