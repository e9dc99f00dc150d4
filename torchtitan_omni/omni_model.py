"""The omni model: encoders + foundation LLM + decoders, composed VeOmni-style.

``OmniModel.forward`` embeds the text, scatters encoder and decoder embeddings into their
placeholder positions, runs the foundation and returns the *summed* loss of every head (text
and each decoder) plus the foundation's auxiliary losses. The trainer normalizes each sum by
its global target count.

Every encoder and decoder runs on every rank and every step, on a one-item dummy input when
the local batch has none of its media, with its output multiplied by zero. Ranks whose batches
hold different modality mixes therefore issue the same FSDP collectives (no hang) and the
encoder still gets correct (zero) gradient contributions from the rank without media.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn as nn

from torchtitan.protocols.model import ModelProtocol

from torchtitan_omni.modules.host import release_host
from torchtitan_omni.modules.init import init_context
from torchtitan_omni.modules.lora import init_adapters
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta, Foundation, OmniDecoder, OmniEncoder
from torchtitan_omni.protocols.plan import OmniParallelPlan

TEXT_LOSS = "text"


@dataclass
class OmniOutput:
    """What one forward returns.

    ``losses``: summed loss per head (``"text"`` and each decoder's modality), to be divided
    by the head's global target count. ``aux_losses``: per-rank means (e.g. MoE load
    balancing), unweighted, to be averaged over ranks (``OmniLoss`` weighs them).
    ``moe_counts``: the foundation's routing counts (``Foundation.moe_counts``), or None.
    """

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    #: summed text loss per label group, when ``forward`` was given ``label_groups``
    text_by_group: dict[int, torch.Tensor] = field(default_factory=dict)
    moe_counts: torch.Tensor | None = None


def _local_media(batch: dict[str, torch.Tensor], modality: str
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """The modality's media and embedding index when this (local) batch carries it, else None.
    The one test of presence: the trainer's cross-rank agreement counts what ``embed`` uses."""
    media, index = B.media(batch, modality), batch.get(B.embed_index_key(modality))
    return (media, index) if media and index is not None else None


def _merge(encoder: nn.Module, local: dict[str, dict[str, torch.Tensor]]
           ) -> tuple[str, dict[str, torch.Tensor]]:
    """One call's input for an encoder that merges modalities: the items of every modality in
    ``local`` (modality -> media, model order) concatenated, and the modality to pass."""
    keys = {frozenset(media) for media in local.values()}
    if len(keys) > 1:
        raise ValueError(f"{type(encoder).__name__} merges {', '.join(local)} but their media "
                         f"tensors differ: {[sorted(k) for k in keys]}")
    merged = {k: torch.cat([media[k] for media in local.values()]) for k in next(iter(keys))}
    return next(iter(local)), merged


def pass_media(batch: dict[str, torch.Tensor], encoder: nn.Module, modalities: Sequence[str]
               ) -> tuple[str, dict[str, torch.Tensor]] | None:
    """What one pass of ``OmniModel.embed`` feeds ``encoder`` from this (local) batch:
    ``(modality, media)``, merged over ``modalities`` as ``embed`` merges them, or None when
    the batch has none of their media (``embed`` then runs the encoder's dummy item)."""
    local = {m: carried[0] for m in modalities if (carried := _local_media(batch, m)) is not None}
    if not local:
        return None
    if len(local) == 1:
        return next(iter(local.items()))
    return _merge(encoder, local)


def _scatter_rows(h: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Replace ``h[b, s]`` by ``rows[index[b, s]]`` where ``index >= 0`` (out of place).

    Each row fills at most one position (``protocols.batch``), so the rows are copied to their
    positions and their gradient is a gather of those positions. Gathering ``rows`` at every
    position instead (``rows[index.clamp(min=0)]``) sends every text position's gradient to
    row 0: a sort-based accumulation over the whole sequence in backward, about 7 ms per
    modality for an 8K row on an H200, where this takes microseconds."""
    if rows.shape[-1] != h.shape[-1]:
        raise ValueError(
            f"embedding width {rows.shape[-1]} does not match the LLM width {h.shape[-1]}"
        )
    b, s, d = h.shape
    n = b * s
    # slot[r + 1]: the flat position row r fills. Rows placed on other sequence shards keep n,
    # a spare position cut off below; slot[0] takes the positions without a row (discarded).
    slot = torch.full((rows.shape[0] + 1,), n, dtype=torch.long, device=h.device)
    slot.scatter_(0, index.reshape(n) + 1, torch.arange(n, device=h.device))
    spare = torch.cat([h.reshape(n, d), h.new_zeros(1, d)])
    return spare.index_copy(0, slot[1:], rows.to(h.dtype))[:n].view(b, s, d)


class OmniModel(ModelProtocol):
    """Encoders + foundation + decoders. Model specs build one from their parts."""

    def __init__(
        self,
        llm: Foundation,
        encoders: dict[str, OmniEncoder] | None = None,
        decoders: dict[str, OmniDecoder] | None = None,
        plan: OmniParallelPlan | None = None,
    ) -> None:
        nn.Module.__init__(self)
        #: what the spec declares about sharding; ``torchtitan_omni.distributed`` applies it
        self.parallel_plan = plan or OmniParallelPlan()
        self.llm = llm
        self.encoders = nn.ModuleDict(encoders or {})
        self.decoders = nn.ModuleDict(decoders or {})
        self.encoder_of: dict[str, str] = {}
        for name in self.encoders:
            for modality in self.encoder(name).modalities:
                if modality in self.encoder_of:
                    raise ValueError(f"two encoders claim modality {modality!r}")
                self.encoder_of[modality] = name
        self.init_seed = 0

    def encoder(self, name: str) -> OmniEncoder:
        """The encoder called ``name`` (``nn.ModuleDict`` types its items as ``nn.Module``)."""
        return cast(OmniEncoder, self.encoders[name])

    def decoder(self, name: str) -> OmniDecoder:
        """The decoder called ``name`` (``nn.ModuleDict`` types its items as ``nn.Module``)."""
        return cast(OmniDecoder, self.decoders[name])

    # ----------------------------------------------------------------- introspection
    @property
    def modalities(self) -> tuple[str, ...]:
        """Every batch modality this model consumes or produces."""
        return tuple(self.encoder_of) + tuple(self.decoders)

    def loss_names(self) -> tuple[str, ...]:
        """Names of the summed losses ``forward`` returns."""
        return (TEXT_LOSS,) + tuple(self.decoders)

    def media_present(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """1/0 per modality of :attr:`modalities`: does this (local) batch carry it?"""
        return torch.tensor(
            [int(_local_media(batch, m) is not None) for m in self.modalities],
            dtype=torch.long,
        )

    def count_targets(
        self, batch: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Number of targets of every loss in a (local) batch; the losses' normalizers."""
        counts = {TEXT_LOSS: (labels != B.IGNORE_INDEX).sum()}
        for name in self.decoders:
            idx = batch.get(B.target_index_key(name))
            counts[name] = (
                (idx >= 0).sum() if idx is not None else torch.zeros((), dtype=torch.long)
            )
        return counts

    def encoder_order(self, work: Mapping[str, float]) -> tuple[str, ...]:
        """The encoders by increasing work (``work``: per modality, e.g. FLOPs summed over the
        ranks; ties keep the model's order). The lightest encoder runs first: its pass is the
        most launch-bound, and at the step's start its launches overlap the previous step's
        queued kernels, while the heaviest runs last, queueing work ahead of the LLM's
        launches (and, reversed, first in the backward, right after the LLM's)."""
        names = list(self.encoders)
        load = {n: sum(float(w) for m, w in work.items() if self.encoder_of.get(m) == n)
                for n in names}
        return tuple(sorted(names, key=lambda n: (load[n], names.index(n))))

    def encoder_passes(self, absent: Collection[str] = (), order: Sequence[str] = ()
                       ) -> list[tuple[str, tuple[str, ...]]]:
        """The encoder calls ``embed`` makes, in order: ``(encoder name, modalities)``, one per
        modality, or one for all of an encoder's modalities when it merges them; the encoders
        in the model's order, or in ``order`` (every encoder's name once). Non-colocated
        encoder ranks replay this order (``torchtitan_omni.distributed.noncolocated``)."""
        if order and sorted(order) != sorted(self.encoders):
            raise ValueError(f"encoder order {list(order)} does not name each of the model's "
                             f"encoders {list(self.encoders)} once")
        passes = []
        for enc_name in order or self.encoders:
            encoder = self.encoder(enc_name)
            modalities = tuple(
                m for m, e in self.encoder_of.items() if e == enc_name and m not in absent
            )
            groups = [modalities] if encoder.merge_modalities else [(m,) for m in modalities]
            passes += [(enc_name, g) for g in groups if g]
        return passes

    # ----------------------------------------------------------------- forward
    def embed(self, tokens: torch.Tensor, batch: dict[str, torch.Tensor],
              absent: Collection[str] = (), encoder_order: Sequence[str] = ()
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Input embeddings with media scattered in, and the decoders' target ids (the
        encoders run in ``encoder_order``, see :meth:`encoder_passes`)."""
        h = self.llm.tok_embeddings(tokens)
        for enc_name, group in self.encoder_passes(absent, encoder_order):
            h = self._encode(h, self.encoder(enc_name), list(group), batch)
        targets: dict[str, torch.Tensor] = {}
        for name in self.decoders:
            if name in absent:
                continue
            decoder = self.decoder(name)
            carried = _local_media(batch, name)
            if carried is not None:
                media, index = carried
                with torch.no_grad():
                    ids = decoder.encode_targets(media)
                targets[name] = ids
                h = _scatter_rows(h, index, decoder.lm_embed(ids))
            else:
                # The target tokenizer (e.g. a VQ, an FSDP unit) runs here too, so every rank
                # records the same forward order and FSDP's backward prefetch stays in step.
                with torch.no_grad():
                    decoder.encode_targets(decoder.dummy_media(h.device))
                dummy = torch.zeros(1, dtype=torch.long, device=h.device)
                h = h + 0.0 * decoder.lm_embed(dummy).sum()
        return h, targets

    @staticmethod
    def _encode(h: torch.Tensor, encoder: OmniEncoder, modalities: list[str],
                batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One pass of ``encoder`` over the batch's items of ``modalities`` (several only for
        an encoder that merges them), its rows scattered onto their placeholders; a dummy item
        times zero when the batch has none, so every rank makes the same calls."""
        local = {m: carried for m in modalities if (carried := _local_media(batch, m)) is not None}
        if not local:
            dummy = encoder.dummy_media(modalities[0], h.device)
            return h + 0.0 * encoder(dummy, modalities[0]).sum()
        if len(local) == 1:
            (modality, (media, index)), = local.items()
            return _scatter_rows(h, index, encoder(media, modality))
        modality, merged = _merge(encoder, {m: media for m, (media, _) in local.items()})
        rows = encoder(merged, modality)
        sizes = [encoder.output_rows(media, modality) for modality, (media, _) in local.items()]
        for (_, index), part in zip(local.values(), rows.split(sizes)):
            h = _scatter_rows(h, index, part)
        return h

    def forward(
        self,
        tokens: torch.Tensor,
        meta: AttentionMeta,
        labels: torch.Tensor,
        absent: Collection[str] = (),
        label_groups: torch.Tensor | None = None,
        groups: Sequence[int] = (),
        labelled: torch.Tensor | None = None,
        encoder_order: Sequence[str] = (),
        **batch: torch.Tensor,
    ) -> OmniOutput:
        """Summed losses of every head for one micro-batch (see module docstring).

        ``absent``: modalities that no rank has in this micro-batch (the trainer agrees on
        them over all ranks): their encoders and decoders are skipped instead of run on dummy
        media, and their parameters get no gradient this step. Without it, a rank lacking a
        modality runs the dummy so that every rank runs every FSDP unit. ``labelled``: the flat
        indices of the labelled positions, found on the host
        (``components.inputs.model_inputs``); without it the text loss finds them on the
        device, which makes the host wait for the forward to finish. ``encoder_order``: the
        encoders' names in the order they run (the trainer's :meth:`encoder_order`, the same
        on every rank); empty: the model's order.
        """
        batch = release_host(batch)  # item sizes the caller kept on the host (hold_on_host)
        h, targets = self.embed(tokens, batch, absent, encoder_order)
        hidden = self.llm(h, meta)
        out = OmniOutput()
        # labelled positions only, and no full-vocabulary logits kept (LinearHead)
        if label_groups is None or not groups:
            if labelled is not None:  # found on the host: no wait for the forward here
                picked = (hidden.flatten(0, 1).index_select(0, labelled),
                          labels.flatten().index_select(0, labelled))
            else:
                text_mask = labels != B.IGNORE_INDEX
                picked = (hidden[text_mask], labels[text_mask])
            out.losses[TEXT_LOSS] = self.llm.output(*picked)
        else:
            text_mask = labels != B.IGNORE_INDEX
            for g in groups:
                mask = text_mask & (label_groups == g)
                out.text_by_group[g] = self.llm.output(hidden[mask], labels[mask])
            out.losses[TEXT_LOSS] = torch.stack(list(out.text_by_group.values())).sum()
        for name in self.decoders:
            decoder = self.decoder(name)
            index = batch.get(B.target_index_key(name))
            if name in absent:
                out.losses[name] = hidden.new_zeros((), dtype=torch.float32)
            elif name in targets and index is not None:
                mask = index >= 0
                out.losses[name] = decoder.lm_head(hidden[mask], targets[name][index[mask]])
            else:
                out.losses[name] = 0.0 * decoder.logits(hidden[:, :1].flatten(0, 1)).sum()
        out.aux_losses = self.llm.aux_losses()
        out.moe_counts = self.llm.moe_counts()
        return out

    # ----------------------------------------------------------------- init
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Layout-invariant init of every part (see ``torchtitan_omni.modules.init``)."""
        tie = getattr(self.llm, "tie_weights", None)
        if callable(tie):
            tie()  # before the parameters are named: one tensor, one name, on any layout
        with init_context(self, seed=self.init_seed):
            self.llm.init_weights(buffer_device)
            for enc_name in self.encoders:
                self.encoder(enc_name).init_weights(buffer_device)
            for dec_name in self.decoders:
                self.decoder(dec_name).init_weights(buffer_device)
            init_adapters(self)  # LoRA adapters, if any

    def freeze(self, prefixes: list[str]) -> list[str]:
        """Stop gradients of the sub-modules at these dotted paths; returns what was frozen."""
        modules = dict(self.named_modules())
        frozen = []
        for prefix in prefixes:
            if prefix not in modules:
                raise ValueError(
                    f"cannot freeze {prefix!r}: no such module (parts: "
                    f"{', '.join(n for n in modules if n.count('.') <= 1 and n)})"
                )
            for p in modules[prefix].parameters():
                p.requires_grad_(False)
            frozen.append(prefix)
        return frozen
