"""The composition contract: encoders, a foundation LLM and decoders.

An omni model (``torchtitan_omni.omni_model.OmniModel``) embeds the text tokens with the
foundation, scatters every encoder's ``lm_encode`` rows and every decoder's ``lm_embed`` rows
into their placeholder positions, runs the foundation, and applies the text head and each
decoder's ``lm_head`` to the hidden states at their target positions.

Adding a modality means writing one encoder (or decoder), its processor config and processor,
and registering them (``torchtitan_omni.protocols.modality.register_modality``); nothing in
the framework changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn as nn


@dataclass
class AttentionMeta:
    """What attention needs to know about the packed sequence.

    ``cu_seqlens`` and ``max_seqlen`` describe the documents of the *full* flattened
    ``B * S`` sequence, also under sequence parallelism (Ulysses attention sees the full
    sequence for a subset of heads). ``position_ids`` is ``[B, S_local]``: this rank's slice.
    The encoders run one packed sequence without a batch dimension: ``position_ids`` ``[T]``
    (``[T, 2]`` for the vision encoder's (row, column) positions).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    causal: bool = True
    #: every row is one document followed only by padding: causal attention over whole rows
    #: is then exact for every real token (it never looks ahead into the padding), and runs on
    #: the fastest dense kernel (``torchtitan_omni.modules.attention``)
    whole_rows: bool = False
    #: generation only: a ``torchtitan_omni.modules.attention.KVCache``; each row of the batch
    #: is then one sequence (no packing), and keys/values are appended to the cache
    kv_cache: object | None = None
    #: rotary tables of ``position_ids`` computed once per forward by the module that owns the
    #: rotary embedding (the vision encoder: ``VisionRotary2D.tables``), so that each block only
    #: applies them; None: a block computes them from ``position_ids`` itself
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None


class Foundation(nn.Module, ABC):
    """The LLM: token embedding, decoder layers, final norm and the text head.

    Required attributes: ``tok_embeddings`` (``nn.Embedding``), ``layers``
    (``nn.ModuleDict`` of decoder blocks keyed "0", "1", ...), ``norm`` and ``output`` (the
    text head, an ``nn.Linear`` that also gives its loss), and ``dim`` (hidden width). The omni
    model calls ``tok_embeddings`` and ``output`` directly, so a plan makes each an FSDP unit.
    """

    dim: int
    tok_embeddings: nn.Embedding
    #: the text head (``modules.linear_cross_entropy.LinearHead``): ``output(hidden)`` gives
    #: logits, ``output(hidden, labels)`` the positions' summed loss
    output: nn.Module

    @abstractmethod
    def forward(self, h: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """Run the decoder layers and the final norm on input embeddings ``[B, S, dim]``."""

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Auxiliary losses gathered during the last forward (e.g. MoE load balancing).

        Each value is an unweighted mean over this rank's tokens; ``OmniLoss`` weighs it and
        the trainer averages it over ranks.
        """
        return {}

    def moe_counts(self) -> torch.Tensor | None:
        """Routing counts of the last forward for the trainer's logs, or None (no experts):
        ``[2, MoE layers, experts]`` int64, the router's assignments per expert (row 0) and the
        assignments dropped over capacity (row 1), on the device."""
        return None

    @abstractmethod
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize parameters and buffers in place."""

    def hf_adapter(self):
        """An ``HFAdapter`` mapping this part to its Hugging Face counterpart, or None."""
        return None


class OmniEncoder(nn.Module, ABC):
    """Turns processed media of one or more modalities into LLM-width embeddings.

    The omni model calls ``encoder(media, modality)`` (so FSDP's hooks run); ``forward`` is
    ``lm_encode``.
    """

    #: the batch modalities this encoder consumes, e.g. ("image", "video")
    modalities: tuple[str, ...] = ()
    #: True when the modalities' media share one layout (same tensors, items independent):
    #: the omni model then encodes all of a batch's items in one pass (``output_rows`` splits
    #: the result), which halves the per-step kernel launches of a deep encoder
    merge_modalities: bool = False
    #: sub-modules (names relative to the encoder) that run on another number of rows than its
    #: blocks, with their rows per block row (a merger on a quarter, a strided stem's first
    #: conv on twice as many): model FLOPs count them so (``torchtitan_omni.flops``)
    flops_row_ratios: Mapping[str, float] = MappingProxyType({})

    def forward(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        return self.lm_encode(media, modality)

    @abstractmethod
    def lm_encode(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        """Embeddings ``[N, llm_dim]``, one row per placeholder token, in placeholder order.

        ``media`` holds the modality's tensors without their ``<modality>_`` prefix (see
        ``torchtitan_omni.protocols.processing``).
        """

    def output_rows(self, media: dict[str, torch.Tensor], modality: str) -> int:
        """Rows ``lm_encode`` returns for ``media`` (needed when ``merge_modalities``, and by
        ``parallelism.encoder_sequence_parallel = "balance"``)."""
        raise NotImplementedError(f"{type(self).__name__} does not merge modalities")

    @abstractmethod
    def processing(self, modality: str):
        """The processor config (``torchtitan_omni.protocols.processing``) for ``modality``."""

    @abstractmethod
    def dummy_media(self, modality: str, device: torch.device) -> dict[str, torch.Tensor]:
        """The smallest valid input of ``modality`` (one item), for ranks without media.

        The omni model runs it and multiplies the result by zero, so every rank issues the
        same collectives whatever its batch holds.
        """

    @abstractmethod
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize parameters and buffers in place."""

    def hf_adapter(self):
        """An ``HFAdapter`` mapping this part to its Hugging Face counterpart, or None."""
        return None

    def attention_segments(self, media: dict[str, torch.Tensor], modality: str
                           ) -> list[int] | None:
        """Rows of each sequence the encoder's attention runs within, or None: within each
        whole item. Model FLOPs count attention by these (``torchtitan_omni.flops``)."""
        del media, modality
        return None


class OmniDecoder(nn.Module, ABC):
    """Turns LLM hidden states into one modality.

    Training: ``encode_targets`` maps the target media to discrete ids (for images, through a
    frozen VQ tokenizer), ``lm_embed`` turns ids into the LLM inputs at the generated
    positions (teacher forcing), and ``lm_head`` gives the loss of predicting the ids from
    hidden states. Generation: ``logits`` + sampling, ``lm_embed`` of the sample for the next
    step, and ``lm_generate`` to turn the finished ids into the output (an image).

    The omni model calls these methods directly, not through ``__call__``: every module they
    use must be a sub-module that the spec's plan makes an FSDP unit (or leaves unsharded),
    and the decoder itself must hold no parameters of its own.
    """

    #: the batch modality this decoder produces, e.g. "gen_image"; also its loss name
    modality: str = ""

    @abstractmethod
    def encode_targets(self, media: dict[str, torch.Tensor]) -> torch.Tensor:
        """Target ids ``[N]`` (int64), one per generated position, in placeholder order."""

    @abstractmethod
    def lm_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """LLM input embeddings ``[N, llm_dim]`` for target ids ``[N]``."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores ``[N, num_ids]`` over target ids for hidden states ``[N, llm_dim]``."""

    def lm_head(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of predicting ``targets`` ``[N]`` from ``hidden``."""
        logits = self.logits(hidden).float()
        return nn.functional.cross_entropy(logits, targets, reduction="sum")

    @abstractmethod
    def lm_generate(self, ids: torch.Tensor) -> torch.Tensor:
        """The modality output (e.g. images ``[n, 3, H, W]`` in [-1, 1]) from ids ``[n, T]``."""

    @abstractmethod
    def processing(self):
        """The processor config for this decoder's targets."""

    @abstractmethod
    def dummy_media(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The smallest valid target (one item), for ranks without targets: the omni model runs
        ``encode_targets`` on it so every rank issues the same collectives."""

    @abstractmethod
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize parameters and buffers in place."""

    def hf_adapter(self):
        """An ``HFAdapter`` mapping this part to its Hugging Face counterpart, or None."""
        return None
