"""The boundary communicator: media items encoded on the least-loaded ranks of a group.

Data-parallel ranks hold different batches, so a rank with many large images would encode
them alone while the others wait for it at the encoders' FSDP collectives.
:func:`balanced_encode` spreads the items of every rank of a group over the group:

1. every rank publishes its items' costs (their model FLOPs, ``flops.EncoderCost.items``),
   the rows each item owns in every media tensor (``protocols.media_items.key_rows``), the embedding
   rows it will get back and its host tensors of item sizes (one small ``all_gather_object``
   over a gloo group: the hosts agree without waiting for their GPUs);
2. every rank computes the same assignment (:func:`assign_items`), on top of the work the
   forward's earlier balanced passes gave each rank (:class:`BalanceLedger`): the ranks wait
   for each other at the model's collectives, so what counts is each rank's encoder work over
   the whole forward, across modalities;
3. each item's device rows travel to their encoding rank (one uneven all-to-all per media
   tensor, ``comm.all_to_all_v``; item sizes are rebuilt from the published metadata), which
   encodes what it received in one call;
4. each item's embedding rows travel back to their owner (one uneven all-to-all) and are put
   back in the owner's item order.

Steps 3 and 4 are ``all_to_all_v``, whose backward is the reverse exchange: row gradients go
back to their encoding rank and input gradients (if any) to their owner. Every rank calls the
encoder exactly once (a rank assigned no item encodes ``empty()``, the encoder's dummy item
cut to zero rows), so FSDP's collectives match whatever the assignment.

Per-item tensors whose trailing shape differs between ranks (Whisper features padded to the
batch's longest clip) are zero-padded to the group's largest shape before they travel: the
encoders mask frames past ``lengths``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.tools.logging import logger

from torchtitan_omni.distributed.comm import ProcessGroup, all_to_all_v, gather_rows
from torchtitan_omni.distributed.encoder_sp import split_bounds
from torchtitan_omni.distributed.utils import host_group
from torchtitan_omni.flops import EncoderCost
from torchtitan_omni.modules.host import to_device
from torchtitan_omni.modules.wrapping import extend_class
from torchtitan_omni.protocols.media_items import item_rows, key_rows, slice_items
from torchtitan_omni.protocols.modules import OmniEncoder


def host_index(media: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``media`` with its integer tensors (grids, lengths) copied to the host once: the per-item
    bookkeeping then reads no device memory (one sync per tensor, not one per item)."""
    return {k: v if v.is_floating_point() else v.cpu() for k, v in media.items()}


def assign_items(costs: list[list[float]], start: list[float] | None = None) -> list[list[int]]:
    """Encoding rank of every item: ``costs[r][i]`` is item i of rank r; returns ``dest[r][i]``.
    ``start``: each rank's load before these items (zero when None).

    Greedy longest-processing-time: items by decreasing cost (ties: owner rank, then index),
    each to the least-loaded rank (ties: lowest rank). An item stays on its owner when that
    does not raise the peak load above what the greedy choice gives, so balanced batches
    move nothing. Deterministic: every rank computes the same answer from the same costs.
    """
    world = len(costs)
    load = [0.0] * world if start is None else [float(x) for x in start]
    dest = [[-1] * len(c) for c in costs]
    order = sorted(((c, r, i) for r, cs in enumerate(costs) for i, c in enumerate(cs)),
                   key=lambda x: (-x[0], x[1], x[2]))
    for cost, owner, i in order:
        least = min(range(world), key=lambda r: (load[r], r))
        peak = max(max(load), load[least] + cost)
        target = owner if load[owner] + cost <= peak else least
        dest[owner][i] = target
        load[target] += cost
    return dest


def loads(costs: list[list[float]], dest: list[list[int]] | None = None,
          start: list[float] | None = None) -> list[float]:
    """Per-rank cost: of its own items (``dest`` None), or of the items it encodes; on top of
    ``start`` (each rank's load before these items) when given."""
    out = [0.0] * len(costs) if start is None else [float(x) for x in start]
    for r, cs in enumerate(costs):
        for i, c in enumerate(cs):
            out[r if dest is None else dest[r][i]] += c
    return out


def imbalance(per_rank: list[float]) -> float:
    """max / mean of per-rank costs (1 is perfect balance; 1 when nothing to encode)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def pad_tail(t: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
    """``t`` zero-padded at the end of each trailing dimension to ``tail`` (the group's
    largest per-item shape)."""
    # F.pad takes (left, right) pairs from the last dimension backwards.
    pad = [p for have, want in zip(reversed(t.shape[1:]), reversed(tail)) for p in (0, want - have)]
    return F.pad(t, pad) if any(pad) else t


class BalanceLedger:
    """Each rank's encoder work so far in one forward, in model FLOPs, shared by the balanced
    encoders of a model: a pass balances its items on top of what the earlier passes gave
    each rank (every rank computes the same loads from the same published costs). Reset at
    the start of each forward (``apply_encoder_modes`` hooks the model)."""

    def __init__(self) -> None:
        self.loads: list[float] | None = None

    def reset(self, *_: Any) -> None:
        """Forget the loads (a forward pre-hook: it ignores the hook's arguments)."""
        self.loads = None


def _host_sizes(media: dict[str, torch.Tensor]) -> list[str]:
    """Keys of ``media`` whose tensors are item sizes on the host (``grid_thw``, ``lengths``):
    published with the metadata instead of exchanged (an exchange through the device would
    make the host wait to read them back)."""
    return sorted(k for k, t in media.items() if t.device.type == "cpu"
                  and not t.is_floating_point())


def _tied(rows: torch.Tensor, received: dict[str, torch.Tensor]) -> torch.Tensor:
    """``rows`` (a rank's zero-row output when it encodes nothing) with the received inputs
    that carry gradients joined in at zero weight: their exchange's backward is a collective
    that every rank must join, also a rank whose received tensors are empty."""
    for t in received.values():
        if t.requires_grad:
            rows = rows + 0 * t.sum()
    return rows


def balanced_encode(
    media: dict[str, torch.Tensor],
    encode: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    costs: list[float],
    out_rows: list[int],
    empty: Callable[[], torch.Tensor],
    group: ProcessGroup,
    index: dict[str, torch.Tensor] | None = None,
    ledger: BalanceLedger | None = None,
) -> tuple[torch.Tensor, tuple[float, float]]:
    """Encode the group's items on balanced ranks; return this rank's embedding rows in its
    item order, and the imbalance (max/mean of the ranks' encoder work in the forward so far,
    this pass's items included) with the items left home and as assigned.

    ``costs``: each of this rank's items' cost (any unit the group shares: model FLOPs).
    ``out_rows``: embedding rows of each item. ``encode(media)``: the encoder on the items
    this rank was assigned (keys as ``media``). ``empty()``: a zero-row output that still
    involves every parameter (see the module docstring). Every rank of ``group`` must call
    this together (same keys; possibly no items). ``index``: :func:`host_index` of ``media``
    when the caller has it. ``ledger``: the work earlier passes of the forward gave each rank
    (read, then updated with this pass's).
    """
    rank, world = dist.get_rank(group), group.size()
    index = host_index(media) if index is None else index
    spans = key_rows(index)
    on_host = _host_sizes(media)
    mine: dict[str, Any] = {"costs": [float(c) for c in costs], "spans": spans,
                            "out": list(out_rows),
                            "tails": {k: tuple(t.shape[1:]) for k, t in media.items()},
                            "host": {k: media[k] for k in on_host}}
    if not len(mine["out"]) == len(mine["costs"]) == len(item_rows(index)):
        raise ValueError(f"balanced_encode: {len(out_rows)} output row counts and "
                         f"{len(costs)} costs for {len(item_rows(index))} items")
    meta: list[Any] = [None] * world
    dist.all_gather_object(meta, mine, group=host_group(group))
    keys = sorted(media)
    for r, m in enumerate(meta):
        if sorted(m["spans"]) != keys:  # every rank sees the same metadata: all raise together
            raise ValueError(f"balanced_encode: rank {r} has media {sorted(m['spans'])}, rank "
                             f"{rank} has {keys}")
    all_costs = [m["costs"] for m in meta]
    carried = ledger.loads if ledger is not None and ledger.loads is not None else [0.0] * world
    dest = assign_items(all_costs, carried)
    assigned = loads(all_costs, dest, carried)
    stats = (imbalance(loads(all_costs, None, carried)), imbalance(assigned))
    if ledger is not None:
        ledger.loads = assigned

    # 3. inputs to their encoding ranks, grouped by destination (stable: item order kept)
    order = sorted(range(len(dest[rank])), key=lambda i: dest[rank][i])
    from_rank = [[i for i, e in enumerate(dest[s]) if e == rank] for s in range(world)]
    received = {}
    for key in keys:
        tail = tuple(max(m["tails"][key][d] for m in meta) for d in range(len(mine["tails"][key])))
        if key in on_host:  # item sizes: this rank's items, by source rank, from the metadata
            pieces = [pad_tail(meta[s]["host"][key], tail).split(meta[s]["spans"][key])
                      for s in range(world)]
            parts = [pieces[s][i] for s in range(world) for i in from_rank[s]]
            received[key] = (torch.cat(parts) if parts
                             else media[key].new_zeros((0, *tail)))
            continue
        padded = pad_tail(media[key], tail)
        split = padded.split(spans[key])
        send = torch.cat([split[i] for i in order]) if order else padded[:0]
        in_splits = [sum(spans[key][i] for i in order if dest[rank][i] == d) for d in range(world)]
        out_splits = [sum(n for n, e in zip(meta[s]["spans"][key], dest[s]) if e == rank)
                      for s in range(world)]
        received[key] = all_to_all_v(send, out_splits, in_splits, group)

    # encode what arrived (items ordered by source rank, then by the source's item order)
    expected = sum(meta[s]["out"][i] for s in range(world) for i in from_rank[s])
    rows = encode(received) if any(from_rank) else _tied(empty(), received)
    if rows.shape[0] != expected:
        raise ValueError(f"balanced_encode: the encoder returned {rows.shape[0]} rows for items "
                         f"announced as {expected}")

    # 4. embeddings back to their owners, then back in the owner's item order
    in_splits = [sum(meta[s]["out"][i] for i in from_rank[s]) for s in range(world)]
    out_splits = [sum(out_rows[i] for i in order if dest[rank][i] == e) for e in range(world)]
    back = all_to_all_v(rows, out_splits, in_splits, group)
    if order == sorted(order):
        return back, stats
    starts, acc = {}, 0
    for i in order:
        starts[i], acc = acc, acc + out_rows[i]
    rows_in_order = [starts[i] + j for i in range(len(order)) for j in range(out_rows[i])]
    return back.index_select(0, to_device(rows_in_order, back.device, torch.long)), stats


class BalancedMediaEncoder(nn.Module):
    """Mixin: the encoder's items are encoded over ``_omni_balance_group`` by
    :func:`balanced_encode`, weighed by their model FLOPs, on top of the work the forward's
    earlier balanced passes gave each rank (``_omni_balance_ledger``, shared by the model's
    balanced encoders). Under Ulysses (``_omni_sp_group``) the SP ranks hold the same items:
    each owns a contiguous share (``encoder_sp.split_bounds``) and the shares' rows are
    gathered on every SP rank afterwards, as in ``SplitMediaEncoder``."""

    _omni_balance_group: ProcessGroup
    _omni_sp_group: ProcessGroup | None
    _omni_balance_ledger: BalanceLedger | None = None
    #: the encoder's FLOP model, what its items are weighed by
    _omni_balance_cost: EncoderCost
    #: (before, after) imbalance of the last call, max/mean of per-rank cost
    _omni_balance_stats: tuple[float, float] | None = None

    def _omni_item_out_rows(self, index: dict[str, torch.Tensor], modality: str) -> list[int]:
        encoder = cast(OmniEncoder, self)  # the mixin only extends encoders
        return [encoder.output_rows(slice_items(index, i, i + 1), modality)
                for i in range(len(item_rows(index)))]

    def forward(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        base = super().forward
        device = next(iter(media.values())).device
        index = host_index(media)
        out_rows = self._omni_item_out_rows(index, modality)
        sp = self._omni_sp_group
        if sp is not None:
            rows = item_rows(index)
            bounds = split_bounds(rows, sp.size())
            sizes = [sum(out_rows[a:b]) for a, b in itertools.pairwise(bounds)]
            r = dist.get_rank(sp)
            media = slice_items(media, bounds[r], bounds[r + 1], rows)
            index = slice_items(index, bounds[r], bounds[r + 1], rows)
            out_rows = out_rows[bounds[r]:bounds[r + 1]]

        def empty() -> torch.Tensor:
            # every parameter in the graph (zero gradients), no rows: FSDP's collectives match
            return base(cast(OmniEncoder, self).dummy_media(modality, device), modality)[:0]

        costs = self._omni_balance_cost.items(index, modality)
        encoded, stats = balanced_encode(media, lambda m: base(m, modality), costs, out_rows,
                                         empty, self._omni_balance_group, index,
                                         self._omni_balance_ledger)
        self._omni_balance_stats = stats
        logger.debug(f"{type(self).__name__} {modality}: encoder work max/mean "
                     f"{stats[0]:.3f} -> {stats[1]:.3f} after balancing")
        return gather_rows(encoded, sizes, sp) if sp is not None else encoded


def balance_metrics(encoders: nn.ModuleDict | dict) -> dict[str, float]:
    """``encoders/<name>/cost_max_over_mean_{before,after}``: the encoder cost imbalance over
    the balancing group of each balanced encoder's last pass (the same on every rank)."""
    out: dict[str, float] = {}
    for name, encoder in encoders.items():
        stats = getattr(encoder, "_omni_balance_stats", None)
        if isinstance(encoder, BalancedMediaEncoder) and stats is not None:
            out[f"encoders/{name}/cost_max_over_mean_before"] = stats[0]
            out[f"encoders/{name}/cost_max_over_mean_after"] = stats[1]
    return out


def install_balanced_encoders(encoders: Mapping[str, nn.Module], group: ProcessGroup,
                              sp_group: ProcessGroup | None = None,
                              ledger: BalanceLedger | None = None) -> list[str]:
    """Make each encoder balance its items over ``group`` (``sp_group``: the Ulysses ranks,
    which hold the same items; ``ledger``: shared by the encoders, reset by the caller at each
    forward); returns their names. Refuses an encoder without ``output_rows`` (the owner must
    know each item's embedding rows)."""
    for name, encoder in encoders.items():
        if getattr(type(encoder), "output_rows", None) is OmniEncoder.output_rows:
            raise ValueError(f"sequence_parallel = \"balance\" needs encoders with "
                             f"output_rows; {name} ({type(encoder).__name__}) has none")
    for encoder in encoders.values():
        extend_class(encoder, BalancedMediaEncoder, _omni_balance_group=group,
                     _omni_sp_group=sp_group, _omni_balance_ledger=ledger,
                     _omni_balance_cost=EncoderCost(cast(OmniEncoder, encoder)))
    return list(encoders)
