"""Parameter and training-FLOP counts of an omni model, for TorchTitan's MFU figure.

Per-token figure (:func:`nparams_and_flops_per_token`, TorchTitan's convention, so MFU figures
compare with stock runs): a token costs ``6 x active non-embedding LLM parameters`` plus
attention ``12 x layers x heads x head_dim x seq_len`` (forward + backward of QK^T and AV,
without the causal halving). MoE experts count by their ``active_fraction`` (``top_k / E``).

Per-batch figure (:class:`FlopCounter`, what the trainer logs): the FLOPs of the micro-batches
actually trained, counting model FLOPs (useful work) rather than what a rank happens to run:

- LLM: ``6 x active parameters`` per token except the text head, which runs only on the
  positions with a text label; causal attention by the documents' real lengths
  (``sum_d len_d (len_d + 1) / 2`` query-key pairs, 4 FLOPs x heads x head_dim each, x3 for
  forward + backward);
- encoders: ``6 x parameters`` per encoder token plus bidirectional attention within each
  item (:func:`encoder_items`), or within each sequence the encoder's
  ``attention_segments(media, modality)`` names (Qwen2-VL's tower attends within each temporal
  patch of a video, not across the clip); a sub-module that runs on another number of rows than the
  encoder's blocks (a patch merger, a strided stem) counts at its rows per encoder token, which
  the encoder's ``flops_row_ratios`` (sub-module name -> ratio) declares; an encoder may
  instead define ``flops(media, modality)``;
- decoders: ``6 x trainable, non-lookup parameters`` per generated position (the frozen VQ
  tokenizer and embedding lookups are free).

Everything is divided by the Ulysses degree: the SP ranks of a batch share its work.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.media_items import item_rows, slice_items
from torchtitan_omni.protocols.modules import OmniEncoder


def _llm(model: nn.Module) -> nn.Module:
    return getattr(model, "llm", model)


def _numel(params) -> int:
    # DTensor.numel() is the global size, so sharded models count like unsharded ones.
    return sum(p.numel() for p in params)


def active_llm_params(model: nn.Module) -> float:
    """Non-embedding LLM parameters one token passes through (MoE experts by top_k/E)."""
    llm = _llm(model)
    total = 0.0
    seen: set[int] = set()
    for module in llm.modules():
        fraction = getattr(module, "active_fraction", None)
        if fraction is None:
            continue
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * float(fraction)
    embedding = getattr(llm, "tok_embeddings", None)
    skip = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    # a head tied to the embedding is a matrix product all the same: it counts
    head = getattr(llm, "output", None)
    skip -= {id(p) for p in head.parameters()} if head is not None else set()
    for p in llm.parameters():
        if id(p) not in seen and id(p) not in skip:
            total += p.numel()
    return total


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(layers, query heads, head_dim) of the LLM's attention."""
    llm = _llm(model)
    layers = list(llm.layers.values())
    attn = layers[0].attention
    return len(layers), attn.n_heads, attn.head_dim


def nparams_and_flops_per_token(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    """Total parameters of the whole omni model and LLM training FLOPs per token."""
    del args
    nparams = _numel(model.parameters())
    layers, heads, head_dim = attention_shape(model)
    flops = 6 * active_llm_params(model) + 12 * layers * heads * head_dim * seq_len
    return nparams, int(flops)


def causal_pairs(lengths: torch.Tensor) -> float:
    """Query-key pairs of causal attention within documents of these lengths."""
    lengths = lengths.double()
    return float((lengths * (lengths + 1) / 2).sum())


def encoder_items(media: dict[str, torch.Tensor], processing) -> list[int]:
    """Sequence length the encoder's blocks see for each item, from the media layout
    (``torchtitan_omni.protocols.processing``); empty for a layout it does not know.

    ``grid_thw``: ``t x h x w`` patches; ``pixels`` (fixed-size images): ``(size / patch)**2``;
    ``lengths`` (log-mel audio): ``ceil(frames / 2)``, after a Whisper-style stride-2 conv.
    """
    if "grid_thw" in media:
        return [int(t * h * w) for t, h, w in media["grid_thw"].tolist()]
    if "pixels" in media and hasattr(processing, "patch_size"):
        n, _, h, w = media["pixels"].shape
        return [(h // processing.patch_size) * (w // processing.patch_size)] * n
    if "lengths" in media:
        return [math.ceil(int(n) / 2) for n in media["lengths"].tolist()]
    return []


class EncoderCost:
    """Training FLOPs of one encoder from its media (the generic estimate of the docstring):
    of a pass (``cost(media, modality)``) or of each item alone (:meth:`items`, what balancing
    the encoders' items over ranks weighs them by)."""

    def __init__(self, encoder: OmniEncoder) -> None:
        self.encoder = encoder
        # parameters weighted by the rows they run on per encoder token: 1 unless the encoder
        # lists the sub-module in ``flops_row_ratios`` (a merger on a quarter of the rows, a
        # stem on twice as many)
        weighted, counted = 0.0, set()
        for name, ratio in encoder.flops_row_ratios.items():
            for p in encoder.get_submodule(name).parameters():
                weighted += p.numel() * float(ratio)
                counted.add(id(p))
        self.params = weighted + _numel(p for p in encoder.parameters() if id(p) not in counted)
        # Sum of heads x head_dim over the encoder's attention modules (all layers).
        self.attention_width = sum(
            m.n_heads * m.head_dim for m in encoder.modules() if isinstance(m, SelfAttention)
        )

    def __call__(self, media: dict[str, torch.Tensor], modality: str) -> float:
        custom = getattr(self.encoder, "flops", None)
        if callable(custom):
            return float(custom(media, modality))
        items = encoder_items(media, self.encoder.processing(modality))
        tokens = sum(items)
        # bidirectional within each item, or within the spans the encoder says it attends
        # over (a video's frames each on their own)
        segments = self.encoder.attention_segments(media, modality)
        spans = items if segments is None else segments
        pairs = sum(n * n for n in spans)
        return 6.0 * self.params * tokens + 3 * 4 * self.attention_width * pairs

    def items(self, media: dict[str, torch.Tensor], modality: str) -> list[float]:
        """The FLOPs of each item of ``media`` encoded alone (integer tensors on the host:
        ``protocols.media_items.slice_items`` reads them)."""
        rows = item_rows(media)
        return [self(slice_items(media, i, i + 1, rows), modality) for i in range(len(rows))]


class FlopCounter:
    """Training FLOPs of real packed micro-batches for the whole omni model (see docstring)."""

    def __init__(self, model: nn.Module) -> None:
        llm = _llm(model)
        self.layers, self.heads, self.head_dim = attention_shape(model)
        output = getattr(llm, "output", None)
        self.head_params = _numel(output.parameters()) if output is not None else 0
        self.body_params = active_llm_params(model) - self.head_params
        self.encoders: dict[str, EncoderCost] = {}
        for enc in getattr(model, "encoders", {}).values():
            cost = EncoderCost(enc)
            for modality in enc.modalities:
                self.encoders[modality] = cost
        self.decoders: dict[str, float] = {}
        for name, dec in getattr(model, "decoders", {}).items():
            lookups = {
                id(p) for m in dec.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
            }
            self.decoders[name] = float(_numel(
                p for p in dec.parameters() if p.requires_grad and id(p) not in lookups
            ))

    def llm(self, cu_seqlens: torch.Tensor, text_targets: int | None = None) -> float:
        """LLM FLOPs of documents ``cu_seqlens``; the head on ``text_targets`` positions (all
        tokens when None)."""
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        tokens = float(lengths.sum())
        head_tokens = tokens if text_targets is None else float(text_targets)
        attention = 3 * 4 * self.layers * self.heads * self.head_dim * causal_pairs(lengths)
        return 6 * self.body_params * tokens + 6 * self.head_params * head_tokens + attention

    def encoder_work(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Encoder FLOPs of the media in ``batch``, per modality an encoder serves (0 for one
        the batch lacks)."""
        return {modality: cost(media, modality) if (media := B.media(batch, modality)) else 0.0
                for modality, cost in self.encoders.items()}

    def media(self, batch: dict[str, torch.Tensor]) -> float:
        """Encoder and decoder FLOPs of the media in ``batch``."""
        total = sum(self.encoder_work(batch).values())
        for name, params in self.decoders.items():
            index = batch.get(B.embed_index_key(name))
            if index is not None:
                total += 6 * params * float((index >= 0).sum())
        return total

    def batch(
        self, cu_seqlens: torch.Tensor, sp_degree: int = 1,
        batch: dict[str, torch.Tensor] | None = None, labels: torch.Tensor | None = None,
    ) -> float:
        """FLOPs of one (unsliced) micro-batch per sequence-parallel rank.

        With only ``cu_seqlens``, the LLM with its head on every token; ``labels`` count the
        head on text targets only, and ``batch`` adds its encoders' and decoders' media.
        """
        targets = None if labels is None else int((labels != B.IGNORE_INDEX).sum())
        total = self.llm(cu_seqlens, targets)
        if batch is not None:
            total += self.media(batch)
        return total / sp_degree
