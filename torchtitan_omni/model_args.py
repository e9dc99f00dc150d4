"""``OmniModelArgs``: the base class of every omni model spec's arguments (one per flavor).

A spec's args hold its parts' argument dataclasses and build the encoders and decoders; the
processing configs and the parallel-degree checks follow from them. TorchTitan's trainer calls
:meth:`OmniModelArgs.update_from_config` to shape them for the job (Hugging Face flavor,
``model.parts_flavor``, sequence length, ``omni.llm_layers``, the tokenizer's vocabulary) and
:meth:`OmniModelArgs.get_nparams_and_flops` for MFU.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from torchtitan.config import JobConfig
from torchtitan.protocols.model import BaseModelArgs

from torchtitan_omni.data.tokenizer import tokenizer_folder, tokenizer_layout
from torchtitan_omni.distributed.checks import expert_problem, ulysses_problem
from torchtitan_omni.flops import nparams_and_flops_per_token
from torchtitan_omni.hf_flavor import apply_hf_flavor, apply_parts_flavor, log_once
from torchtitan_omni.protocols.model import HF_FLAVOR, apply_llm_layers
from torchtitan_omni.protocols.modules import OmniDecoder, OmniEncoder

__all__ = ["HF_FLAVOR", "OmniModelArgs", "fit_vocabulary"]


@dataclass
class OmniModelArgs(BaseModelArgs):
    """Arguments of an omni model: its foundation, encoders and decoders.

    Subclasses hold the parts' argument dataclasses, expose the foundation's as ``llm_args``
    and build their encoders and decoders (:meth:`build_encoders`, :meth:`build_decoders`);
    the processing configs and the parallelism checks follow from those.
    """

    #: debug flavors size the vocabulary to the tokenizer in ``model.hf_assets_path``;
    #: real flavors keep their Hugging Face vocabulary (the tokenizer must fit in it; omni
    #: tokens it lacks grow the vocabulary)
    vocab_from_tokenizer: bool = False
    #: the ``hf`` flavor: the foundation's args come from the ``config.json`` of the
    #: ``weights.sources`` entry for ``llm`` (``torchtitan_omni.hf_flavor``)
    from_hf: bool = False
    #: Hugging Face architectures the foundation can be built from (``HFArchitecture``s of
    #: ``torchtitan_omni.foundations.hf_config``); the spec decides
    hf_foundations: ClassVar[tuple] = ()

    @property
    @abstractmethod
    def llm_args(self):
        """The foundation's argument dataclass (``vocab_size``, ``max_seq_len``, ``n_heads``,
        ``n_kv_heads``; ``num_experts`` for MoE foundations)."""

    def build_encoders(self) -> dict[str, OmniEncoder]:
        """The encoders by name, at the LLM's width."""
        return {}

    def build_decoders(self) -> dict[str, OmniDecoder]:
        """The decoders by modality, at the LLM's width."""
        return {}

    def processing(self) -> dict[str, object]:
        """Processor config per modality (``torchtitan_omni.protocols.processing``), read off
        the encoders and decoders built on the meta device (no memory), so the data pipeline
        can process media before the model exists."""
        with torch.device("meta"):
            encoders, decoders = self.build_encoders(), self.build_decoders()
        out: dict[str, object] = {}
        for encoder in encoders.values():
            for modality in encoder.modalities:
                out[modality] = encoder.processing(modality)
        for decoder in decoders.values():
            out[decoder.modality] = decoder.processing()
        return out

    def validate_parallelism(self, ulysses_degree: int, expert_parallel_degree: int) -> str | None:
        """A one-line problem with these degrees for this model's LLM, or None."""
        llm = self.llm_args
        problem = ulysses_problem(llm.n_heads, llm.n_kv_heads, ulysses_degree, "the LLM")
        if problem:
            return problem
        num_experts = getattr(llm, "num_experts", None)
        if expert_parallel_degree > 1 and not num_experts:
            return (f"parallelism.expert_parallel_degree ({expert_parallel_degree}) > 1 but "
                    "this model's LLM has no experts")
        return expert_problem(num_experts or 0, expert_parallel_degree, "each MoE layer of the LLM")

    def part_fields(self) -> list[str]:
        """Names of the fields holding encoder and decoder args (all but the foundation's and
        the base class's), which ``model.parts_flavor`` copies."""
        own = {f.name for f in dataclasses.fields(OmniModelArgs)} | {"llm"}
        return [f.name for f in dataclasses.fields(self) if f.name not in own
                and getattr(self, f.name) is not self.llm_args]

    def keep_own_parts(self) -> None:
        """Remember the flavor's own encoder and decoder args before a job puts others in
        their place: TorchTitan's trainer updates the registered (shared) args in place, and a
        later job in the process gets them back (:meth:`restore_own_parts`)."""
        if getattr(self, "_own_parts", None) is None:
            self._own_parts: dict[str, object] | None = {
                f: copy.deepcopy(getattr(self, f)) for f in self.part_fields()}

    def own_parts(self) -> dict[str, object]:
        """The flavor's own encoder and decoder args by field (remembered, else current)."""
        own = getattr(self, "_own_parts", None)
        return own if own is not None else {f: getattr(self, f) for f in self.part_fields()}

    def restore_own_parts(self) -> None:
        """Put back what :meth:`keep_own_parts` remembered (nothing when it did not run)."""
        own = getattr(self, "_own_parts", None)
        if own is not None:
            for name, value in own.items():
                setattr(self, name, copy.deepcopy(value))
            self._own_parts = None

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        """Take the foundation's shape from Hugging Face (flavor ``hf``) and the parts from
        ``model.parts_flavor``; fit the sequence length and the vocabulary to the job."""
        apply_parts_flavor(self, job_config)
        if self.from_hf:
            apply_hf_flavor(self, job_config)
        llm = self.llm_args
        llm.max_seq_len = max(llm.max_seq_len, job_config.training.seq_len)
        validation = getattr(job_config, "validation", None)
        if validation is not None and validation.enable:
            # held-out documents may be as long as validation.seq_len: RoPE must cover them
            llm.max_seq_len = max(llm.max_seq_len, validation.seq_len)
        problem = apply_llm_layers(llm, getattr(getattr(job_config, "omni", None), "llm_layers", 0))
        if problem:
            raise ValueError(problem)
        fit_vocabulary(self, job_config)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token at ``seq_len`` (see ``flops``)."""
        return nparams_and_flops_per_token(self, model, seq_len)


def fit_vocabulary(args: OmniModelArgs, job_config: JobConfig) -> None:
    """Size the foundation's vocabulary for the job's tokenizer, omni tokens added: debug
    flavors take its size; others keep the checkpoint's rows and grow when the added tokens
    do not fit (``hf_vocab_size`` and ``added_token_rows`` tell the loader)."""
    folder = tokenizer_folder(job_config)
    layout = tokenizer_layout(folder)
    if layout is None:
        return
    llm = args.llm_args
    if args.vocab_from_tokenizer:
        llm.vocab_size = layout.size
        return
    rows = llm.hf_vocab_size or llm.vocab_size  # the checkpoint's (kept if called again)
    if layout.base_size > rows:
        raise ValueError(f"the tokenizer in {folder} has {layout.base_size} tokens, more than "
                         f"the model's vocabulary ({rows})")
    llm.vocab_size = max(rows, layout.size)
    llm.hf_vocab_size = rows if layout.size > rows else None
    llm.added_token_rows = (layout.base_size, layout.size) if layout.added else None
    if not layout.added:
        return
    n = len(layout.added)
    what = "embedding" if getattr(llm, "tie_word_embeddings", False) else "embedding and head"
    if layout.size > rows:
        log_once(f"Tokenizer {folder}: added {n} tokens, {what} resized {rows} -> "
                 f"{layout.size}")
    else:
        log_once(f"Tokenizer {folder}: added {n} tokens as ids {layout.base_size}.."
                 f"{layout.size - 1}, unused rows of the {rows}-row {what}")
