"""Non-colocated encoders: the encoders run on their own ranks, the LLM on the others.

One process group holds both rank sets (:class:`RankSets`). LLM ranks hold the batches and
the LLM (and the decoders); their model's encoders are :class:`RemoteEncoder` stubs without
parameters. Encoder ranks hold the encoders only and no batch. Per step, synchronously:

- LLM ranks call :meth:`EncoderClient.exchange` on their batch, then run the model as usual
  (the stubs hand out the embeddings the exchange brought) and ``loss.backward()``;
- encoder ranks call :meth:`EncoderServer.step`, then :meth:`EncoderServer.backward`.

Collectives on the group, in the same order on every rank:

1. one ``all_gather_object``: LLM ranks publish, per encoder pass (``OmniModel
   .encoder_passes``), their items' costs, rows, embedding rows and tensor shapes; encoder
   ranks publish which encoders train. Every rank derives the same plan: each item goes to an
   encoder rank by the cost model of ``boundary`` (``assign_items``, greedy
   longest-processing-time over the encoder ranks);
2. per pass with items somewhere and per media tensor, one uneven all-to-all (``comm
   .all_to_all_v``) from the LLM ranks to the encoder ranks (data: no gradient);
3. the encoder ranks encode each pass in one call and send the rows back: one all-to-all for
   the passes of trainable encoders (differentiable: its backward routes each row's gradient
   to the rank that encoded it) and one under ``no_grad`` for frozen encoders.

In backward exactly one all-to-all runs on the group (none when every encoder is frozen):
the LLM ranks issue it from ``loss.backward()``, the encoder ranks from
:meth:`EncoderServer.backward`, which then runs the encoders' backward. Encoder parameter
gradients are sums over every LLM rank's loss, as with colocated encoders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_omni.distributed.boundary import assign_items, host_index, item_costs, pad_tail
from torchtitan_omni.distributed.comm import ProcessGroup, all_to_all_v
from torchtitan_omni.distributed.encoder_sp import item_rows, key_rows, slice_items
from torchtitan_omni.omni_model import pass_media
from torchtitan_omni.protocols.modules import OmniEncoder


@dataclass(frozen=True)
class RankSets:
    """Which ranks of ``group`` (group ranks) run the encoders and which the LLM: disjoint,
    non-empty, together the whole group."""

    encoders: tuple[int, ...]
    llm: tuple[int, ...]
    group: ProcessGroup

    def __post_init__(self) -> None:
        both = sorted(self.encoders + self.llm)
        if not self.encoders or not self.llm or both != list(range(self.group.size())):
            raise ValueError(f"non-colocated encoders need disjoint, non-empty encoder ranks "
                             f"{list(self.encoders)} and LLM ranks {list(self.llm)} that make up "
                             f"the group of {self.group.size()}")

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return dist.get_rank(self.group)

    @property
    def on_encoders(self) -> bool:
        """Whether this process is an encoder rank."""
        return self.rank in self.encoders


# ----------------------------------------------------------------- the shared plan
@dataclass
class _Pass:
    """One encoder pass as every rank sees it after the metadata exchange."""

    encoder: str
    modality: str  # passed to the encoder (see _plan)
    keys: list[str]
    tails: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    items: list[dict | None]  # per LLM rank: what _describe says, None without media
    dest: list[list[int]]  # per LLM rank and item: index of its encoder rank
    trainable: bool

    def sent(self, s: int, e: int, what: str, key: str | None = None) -> int:
        """Rows LLM rank ``s`` sends encoder rank ``e``: of media tensor ``key``
        (``what="spans"``) or of embeddings (``what="out"``)."""
        desc = self.items[s]
        if desc is None:
            return 0
        sizes = desc[what][key] if key is not None else desc[what]
        return sum(n for n, d in zip(sizes, self.dest[s]) if d == e)


def _describe(encoder: OmniEncoder, modality: str, media: dict[str, torch.Tensor]) -> dict:
    """What an LLM rank publishes about one pass's items (host integers only)."""
    index = host_index(media)
    out = [encoder.output_rows(slice_items(index, i, i + 1), modality)
           for i in range(len(item_rows(index)))]
    return {"modality": modality, "costs": item_costs(index), "spans": key_rows(index),
            "out": out, "tails": {k: tuple(t.shape[1:]) for k, t in media.items()},
            "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in media.items()}}


def _plan(meta: list[Any], ranks: RankSets) -> list[_Pass | None]:
    """Every rank's identical plan from the gathered metadata: one entry per pass of the LLM
    ranks' model, None for a pass no LLM rank has media for (skipped by all)."""
    llm_meta = [meta[r] for r in ranks.llm]
    passes = llm_meta[0]["passes"]
    for r, m in zip(ranks.llm, llm_meta):
        if m["passes"] != passes:  # every rank sees the same metadata: all raise together
            raise ValueError(f"non-colocated encoders: LLM rank {r} makes encoder passes "
                             f"{m['passes']}, rank {ranks.llm[0]} makes {passes}")
    trainable = meta[ranks.encoders[0]]["trainable"]
    plan: list[_Pass | None] = []
    for p, (name, _) in enumerate(passes):
        items = [m["items"][p] for m in llm_meta]
        present = [d for d in items if d is not None]
        if not present:
            plan.append(None)
            continue
        first = present[0]
        keys = sorted(first["spans"])
        if any(sorted(d["spans"]) != keys for d in present):
            raise ValueError(f"non-colocated encoders: LLM ranks send {name} different media "
                             f"tensors: {[sorted(d['spans']) for d in present]}")
        tails = {k: tuple(max(d["tails"][k][i] for d in present)
                          for i in range(len(first["tails"][k]))) for k in keys}
        dtypes = {k: getattr(torch, first["dtypes"][k]) for k in keys}
        # greedy LPT over the encoder ranks: as if encoder rank 0 owned every item
        flat = [c for d in items for c in (d["costs"] if d else [])]
        dest_flat = assign_items([flat] + [[] for _ in ranks.encoders[1:]])[0]
        dest, at = [], 0
        for d in items:
            n = len(d["costs"]) if d else 0
            dest.append(dest_flat[at:at + n])
            at += n
        # Merged modalities share one layout (``OmniEncoder.merge_modalities``): the encoder
        # ranks encode the pass's items of every LLM rank in one call, with the first one's.
        plan.append(_Pass(name, first["modality"], keys, tails, dtypes, items, dest,
                          trainable[name]))
    return plan


def _send_inputs(ranks: RankSets, p: _Pass, media: dict[str, torch.Tensor] | None,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Step 2 for one pass: each item's input rows to its encoder rank. Returns what arrived
    (items by LLM rank, then in the LLM rank's order; nothing on an LLM rank)."""
    me, size = ranks.rank, ranks.group.size()
    received = {}
    for key in p.keys:
        in_splits, out_splits = [0] * size, [0] * size
        send = torch.empty((0, *p.tails[key]), dtype=p.dtypes[key], device=device)
        if not ranks.on_encoders:
            s = ranks.llm.index(me)
            desc = p.items[s]
            if desc is not None and media is not None:
                order = sorted(range(len(p.dest[s])), key=lambda i: p.dest[s][i])  # stable
                pieces = pad_tail(media[key], p.tails[key]).split(desc["spans"][key])
                send = torch.cat([pieces[i] for i in order])
                for e, r in enumerate(ranks.encoders):
                    in_splits[r] = p.sent(s, e, "spans", key)
        else:
            e = ranks.encoders.index(me)
            for s, r in enumerate(ranks.llm):
                out_splits[r] = p.sent(s, e, "spans", key)
        received[key] = all_to_all_v(send, out_splits, in_splits, ranks.group)
    return received


def _rows_back(ranks: RankSets, plan: list[tuple[int, _Pass]], rows: dict[int, torch.Tensor],
               width: int, dtype: torch.dtype, device: torch.device, grad: bool
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Step 3 for a set of passes (index, pass): one all-to-all of their embedding rows from
    the encoder ranks (``rows``: pass index -> rows in arrival order) to the LLM ranks.
    Returns what arrived, and on an LLM rank each pass's rows in its item order."""
    me, size = ranks.rank, ranks.group.size()
    in_splits, out_splits = [0] * size, [0] * size
    if ranks.on_encoders:
        e = ranks.encoders.index(me)
        chunks: list[list[torch.Tensor]] = [[] for _ in ranks.llm]
        for i, p in plan:
            sizes = [p.sent(s, e, "out") for s in range(len(ranks.llm))]
            for s, piece in enumerate(rows[i].split(sizes)):
                chunks[s].append(piece)
        for s, r in enumerate(ranks.llm):
            in_splits[r] = sum(c.shape[0] for c in chunks[s])
        send = torch.cat([c for per_rank in chunks for c in per_rank])
    else:
        # A leaf that needs a gradient, so that this rank's backward joins the exchange.
        send = torch.zeros((0, width), dtype=dtype, device=device, requires_grad=grad)
        s = ranks.llm.index(me)
        for e, r in enumerate(ranks.encoders):
            out_splits[r] = sum(p.sent(s, e, "out") for _, p in plan)
    back = all_to_all_v(send, out_splits, in_splits, ranks.group)
    if ranks.on_encoders:
        return back, {}
    # arrival order: by encoder rank, then pass, then item; put each pass in item order
    starts: dict[tuple[int, int], int] = {}
    at = 0
    for e in range(len(ranks.encoders)):
        for i, p in plan:
            desc = p.items[s]
            for j, (n, d) in enumerate(zip(desc["out"] if desc else [], p.dest[s])):
                if d == e:
                    starts[i, j], at = at, at + n
    out = {}
    for i, p in plan:
        desc = p.items[s]
        picks = [starts[i, j] + k for j, n in enumerate(desc["out"] if desc else [])
                 for k in range(n)]
        out[i] = back.index_select(0, torch.tensor(picks, dtype=torch.long, device=device))
    return back, out


def _exchange_rows(ranks: RankSets, plan: list[_Pass | None], rows: dict[int, torch.Tensor],
                   width: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """Step 3: the trainable passes' rows through autograd, the frozen ones' without. Returns
    the trainable exchange's output (None without one) and the LLM rank's rows per pass."""
    live = [(i, p) for i, p in enumerate(plan) if p is not None]
    trainable = [(i, p) for i, p in live if p.trainable]
    frozen = [(i, p) for i, p in live if not p.trainable]
    back, out = None, {}
    if trainable:
        back, got = _rows_back(ranks, trainable, rows, width, dtype, device, grad=True)
        out.update(got)
    if frozen:
        with torch.no_grad():  # frozen encoders: no gradient travels back
            _, got = _rows_back(ranks, frozen, rows, width, dtype, device, grad=False)
        out.update(got)
    return back, out


# ----------------------------------------------------------------- LLM ranks
class RemoteEncoder(OmniEncoder):
    """Stands in for an encoder on the LLM ranks: no parameters; ``forward`` returns the rows
    that :meth:`EncoderClient.exchange` brought for the next pass of this encoder."""

    _omni_spec: OmniEncoder
    _omni_client: EncoderClient
    _omni_name: str

    def __init__(self, name: str, spec: OmniEncoder, client: EncoderClient) -> None:
        super().__init__()
        self.modalities, self.merge_modalities = spec.modalities, spec.merge_modalities
        # Held outside the module tree: the LLM ranks hold no encoder parameters; the spec
        # (built on the meta device in a real job) only answers shape questions.
        self.__dict__["_omni_spec"], self.__dict__["_omni_client"] = spec, client
        self._omni_name = name

    @property
    def client(self) -> EncoderClient:
        """The client that feeds this stub."""
        return self._omni_client

    def lm_encode(self, media: dict[str, torch.Tensor], modality: str) -> torch.Tensor:
        return self._omni_client.take(self._omni_name)

    def output_rows(self, media: dict[str, torch.Tensor], modality: str) -> int:
        return self._omni_spec.output_rows(media, modality)

    def processing(self, modality: str):
        return self._omni_spec.processing(modality)

    def dummy_media(self, modality: str, device: torch.device) -> dict[str, torch.Tensor]:
        return self._omni_spec.dummy_media(modality, device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Nothing to initialize: the encoder ranks own the parameters."""


class EncoderClient:
    """The LLM ranks' side: ships a batch's media to the encoder ranks and hands the
    embeddings to the model's :class:`RemoteEncoder` stubs (see the module docstring)."""

    def __init__(self, ranks: RankSets, model: nn.Module) -> None:
        if ranks.on_encoders:
            raise ValueError(f"rank {ranks.rank} is an encoder rank; it runs EncoderServer")
        self.ranks = ranks
        self.model: Any = model  # an OmniModel (or FSDP's subclass of it)
        encoders = cast(nn.ModuleDict, model.encoders)
        self.specs = {name: cast(OmniEncoder, enc) for name, enc in encoders.items()}
        self._pending: dict[str, deque[torch.Tensor]] = {}
        self.last_trainable_exchange = False  # whether the last exchange has a backward

    def install(self) -> list[str]:
        """Replace the model's encoders by stubs fed by this client; returns their names."""
        for name, spec in self.specs.items():
            self.model.encoders[name] = RemoteEncoder(name, spec, self)
        return list(self.specs)

    def exchange(self, batch: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
        """Steps 1-3 for one micro-batch: call on every LLM rank, before the model's forward
        on ``batch`` with the same ``absent``, while the encoder ranks run ``step``."""
        if any(self._pending.values()):
            raise RuntimeError("EncoderClient.exchange: the last micro-batch's embeddings were "
                               "not all used; run the model's forward after each exchange")
        passes = self.model.encoder_passes(absent)
        local = [pass_media(batch, self.specs[name], mods) for name, mods in passes]
        items = [_describe(self.specs[name], *got) if got is not None else None
                 for (name, _), got in zip(passes, local)]
        weight = cast(torch.Tensor, self.model.llm.tok_embeddings.weight)
        width, dtype, device = weight.shape[-1], weight.dtype, weight.device
        meta: list[Any] = [None] * self.ranks.group.size()
        mine = {"passes": passes, "items": items, "width": width,
                "dtype": str(dtype).removeprefix("torch.")}
        dist.all_gather_object(meta, mine, group=self.ranks.group)
        plan = _plan(meta, self.ranks)
        for p, got in zip(plan, local):
            if p is not None:
                _send_inputs(self.ranks, p, got[1] if got is not None else None, device)
        back, rows = _exchange_rows(self.ranks, plan, {}, width, dtype, device)
        self.last_trainable_exchange = back is not None
        self._pending = {name: deque() for name in self.specs}
        for i, (name, _) in enumerate(passes):
            # a pass no rank has media for: zero rows, outside any graph
            self._pending[name].append(rows.get(i, torch.zeros((0, width), dtype=dtype,
                                                               device=device)))

    def take(self, name: str) -> torch.Tensor:
        """The rows of ``name``'s next pass (this rank's items in its order; zero rows when it
        has none, still in the exchange's graph so that its backward joins the exchange)."""
        queue = self._pending.get(name)
        if not queue:
            raise RuntimeError(f"encoder {name} ran without embeddings: call "
                               "EncoderClient.exchange on the micro-batch first")
        return queue.popleft()


def install_remote_encoders(model: nn.Module, ranks: RankSets) -> EncoderClient:
    """On an LLM rank: the model's encoders become stubs fed by the returned client."""
    client = EncoderClient(ranks, model)
    client.install()
    return client


def encoder_client(model: nn.Module) -> EncoderClient | None:
    """The client feeding ``model``'s ``RemoteEncoder`` stubs, or None (colocated)."""
    for encoder in getattr(model, "encoders", {}).values():
        if isinstance(encoder, RemoteEncoder):
            return encoder.client
    return None


# ----------------------------------------------------------------- encoder ranks
class EncoderServer:
    """The encoder ranks' side: encodes what the LLM ranks send and runs the encoders'
    backward on the gradients they send back (see the module docstring)."""

    def __init__(self, ranks: RankSets, encoders: Mapping[str, nn.Module],
                 device: torch.device | None = None,
                 run: Callable[[str, dict[str, torch.Tensor], str], torch.Tensor] | None = None,
                 ) -> None:
        """``run(name, media, modality)`` encodes one pass (default: the encoder's forward;
        the trainer passes its FSDP root, ``split_model.EncoderRanksModel``)."""
        if not ranks.on_encoders:
            raise ValueError(f"rank {ranks.rank} is an LLM rank; it runs EncoderClient")
        self.ranks, self.encoders = ranks, encoders
        self.run = run or (lambda name, media, modality: self.encoders[name](media, modality))
        first = next((p for e in encoders.values() for p in e.parameters()), None)
        self.device = device or (first.device if first is not None else torch.device("cpu"))
        self._back: torch.Tensor | None = None
        #: items and embedding rows this rank encoded in the last step
        self.last_items = self.last_rows = 0

    def trainable(self) -> dict[str, bool]:
        """Whether each encoder has a parameter that needs a gradient."""
        return {n: any(p.requires_grad for p in e.parameters()) for n, e in self.encoders.items()}

    def step(self) -> None:
        """Steps 1-3 for one micro-batch: call on every encoder rank while the LLM ranks call
        ``EncoderClient.exchange``; then :meth:`backward` after the LLM ranks' forward."""
        if self._back is not None:
            raise RuntimeError("EncoderServer.step: the last step's backward has not run")
        meta: list[Any] = [None] * self.ranks.group.size()
        dist.all_gather_object(meta, {"trainable": self.trainable()}, group=self.ranks.group)
        plan = _plan(meta, self.ranks)
        # the rows travel in the LLM's embedding width and dtype, as the LLM ranks announced
        llm = meta[self.ranks.llm[0]]
        width, dtype = llm["width"], getattr(torch, llm["dtype"])
        e = self.ranks.encoders.index(self.ranks.rank)
        rows, self.last_items, self.last_rows = {}, 0, 0
        for i, p in enumerate(plan):
            if p is None:
                continue
            media = _send_inputs(self.ranks, p, None, self.device)
            encoder = cast(OmniEncoder, self.encoders[p.encoder])
            expected = sum(p.sent(s, e, "out") for s in range(len(self.ranks.llm)))
            count = sum(d == e for dest in p.dest for d in dest)
            if count:
                out = self.run(p.encoder, media, p.modality)
            else:
                # every parameter in the graph, no rows: FSDP's collectives among the encoder
                # ranks match whatever the assignment
                dummy = encoder.dummy_media(p.modality, self.device)
                out = self.run(p.encoder, dummy, p.modality)[:0]
            if out.shape[0] != expected:
                raise ValueError(f"non-colocated {p.encoder}: the encoder returned "
                                 f"{out.shape[0]} rows for items announced as {expected}")
            rows[i] = out.to(dtype)
            self.last_items += count
            self.last_rows += expected
        self._back, _ = _exchange_rows(self.ranks, plan, rows, width, dtype, self.device)

    def backward(self) -> None:
        """The encoders' backward: receives the rows' gradients from the LLM ranks (while
        they run ``loss.backward()``). Nothing travels when every encoder is frozen."""
        back, self._back = self._back, None
        if back is not None:
            torch.autograd.backward(back, torch.zeros_like(back))


# ----------------------------------------------------------------- both rank sets, per step
def combine_grad_norms(square: torch.Tensor, ranks: RankSets) -> torch.Tensor:
    """The job's squared gradient norm from each set's (``square``: this rank's set's, the
    same on every rank of the set): one all-reduce (max) over the world group, each set in its
    own slot, so the sum counts each set once. Every rank then clips as colocated would."""
    slots = torch.zeros(2, dtype=square.dtype, device=square.device)
    slots[int(ranks.on_encoders)] = square
    dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=ranks.group)
    return slots.sum()


def share_from_llm(payload: Any, ranks: RankSets) -> Any:
    """``payload`` of the first LLM rank, on every rank of the group (e.g. the step's log
    line for the encoder ranks, which see no loss); a collective of the whole group."""
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ranks.group, ranks.llm[0]),
                               group=ranks.group)
    return box[0]
