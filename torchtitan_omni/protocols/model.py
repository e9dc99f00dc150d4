"""Base class of every omni model spec's arguments (one instance per flavor)."""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from dataclasses import dataclass

import torch
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

    Subclasses hold the parts' argument dataclasses, expose the foundation's as ``llm_args``
    and build their encoders and decoders (:meth:`build_encoders`, :meth:`build_decoders`);
    the processing configs and the parallelism checks follow from those.
    """

    #: debug flavors size the vocabulary to the tokenizer in ``model.hf_assets_path``;
    #: real flavors keep their Hugging Face vocabulary (the tokenizer must fit in it)
    vocab_from_tokenizer: bool = False

    @property
    @abstractmethod
    def llm_args(self):
        """The foundation's argument dataclass (``vocab_size``, ``max_seq_len``, ``n_heads``,
        ``n_kv_heads``; ``num_experts`` for MoE foundations)."""

    def build_encoders(self) -> dict[str, nn.Module]:
        """The encoders by name (``OmniEncoder``), at the LLM's width."""
        return {}

    def build_decoders(self) -> dict[str, nn.Module]:
        """The decoders by modality (``OmniDecoder``), at the LLM's width."""
        return {}

    def processing(self) -> dict[str, object]:
        """Processor config per modality (``torchtitan_omni.protocols.processing``), read off
        the encoders and decoders built on the meta device (no memory), so the data pipeline
        can process media before the model exists."""
        with torch.device("meta"):
            parts = {**self.build_encoders(), **self.build_decoders()}
        out: dict[str, object] = {}
        for part in parts.values():
            modalities = getattr(part, "modalities", None)
            if modalities is not None:
                for modality in modalities:
                    out[modality] = part.processing(modality)
            else:
                out[part.modality] = part.processing()
        return out

    def validate_parallelism(self, ulysses_degree: int, expert_parallel_degree: int) -> str | None:
        """A one-line problem with these degrees for this model's LLM, or None."""
        from torchtitan_omni.distributed.checks import expert_problem, ulysses_problem

        llm = self.llm_args
        problem = ulysses_problem(llm.n_heads, llm.n_kv_heads, ulysses_degree, "the LLM")
        if problem:
            return problem
        num_experts = getattr(llm, "num_experts", None)
        if expert_parallel_degree > 1 and not num_experts:
            return (f"parallelism.expert_parallel_degree ({expert_parallel_degree}) > 1 but "
                    "this model's LLM has no experts")
        return expert_problem(num_experts or 0, expert_parallel_degree, "each MoE layer of the LLM")

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        """Fit the sequence length (training and validation) and (debug flavors) the
        vocabulary to the job."""
        llm = self.llm_args
        llm.max_seq_len = max(llm.max_seq_len, job_config.training.seq_len)
        validation = getattr(job_config, "validation", None)
        if validation is not None and validation.enable:
            # held-out documents may be as long as validation.seq_len: RoPE must cover them
            llm.max_seq_len = max(llm.max_seq_len, validation.seq_len)
        problem = apply_llm_layers(llm, getattr(getattr(job_config, "omni", None), "llm_layers", 0))
        if problem:
            raise ValueError(problem)
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


def flavor_layers(llm) -> int:
    """The foundation's block count as its flavor declares it (before ``omni.llm_layers``)."""
    return getattr(llm, "_flavor_n_layers", llm.n_layers)


def llm_layers_problem(keep: int, llm) -> str | None:
    """A one-line problem with ``omni.llm_layers = keep`` for this foundation, or None."""
    full = flavor_layers(llm)
    if keep < 0 or keep > full:
        return f"omni.llm_layers ({keep}) must be between 1 and the flavor's {full} layers (0 keeps all)"
    return None


def apply_llm_layers(llm, keep: int) -> str | None:
    """Cut the foundation to its first ``keep`` blocks (0: the flavor's count). The flavor's
    count is remembered because TorchTitan updates the registered (shared) args in place."""
    problem = llm_layers_problem(keep, llm)
    if problem:
        return problem
    full = flavor_layers(llm)
    llm._flavor_n_layers = full
    llm.n_layers = keep or full
    return None
