"""Non-colocated encoders: the encoders run on their own ranks, the LLM on the others.

One process group holds both rank sets (:class:`RankSets`). LLM ranks hold the batches and
the LLM (and the decoders); their model's encoders are :class:`RemoteEncoder` stubs without
parameters. Encoder ranks hold the encoders only and no batch. Per micro-batch:

- LLM ranks call :meth:`EncoderClient.exchange` on their batch (or its halves ``send`` and
  ``receive``), then run the model as usual (the stubs hand out the embeddings the exchange
  brought) and ``loss.backward()``;
- encoder ranks call :meth:`EncoderServer.step`, then :meth:`EncoderServer.backward` (or
  their stages one by one: ``receive``, ``encode``, ``send_rows``, ``receive_grads``,
  ``backward_encoders``). ``encoder_schedule`` orders a step's micro-batches ("sync" or
  "pipelined"); validation runs forwards only (``EncoderServer.serve_forward``, ended by
  ``EncoderClient.stop``).

Collectives on the group, in the same order on every rank:

1. one ``all_gather_object``: LLM ranks publish, per encoder pass (``OmniModel
   .encoder_passes``), their items' costs, rows, embedding rows and tensor shapes; encoder
   ranks publish which encoders train. Every rank derives the same plan: each item, weighed
   by its model FLOPs (``flops.EncoderCost.items``), goes to an encoder rank by
   ``boundary.assign_items`` (greedy longest-processing-time over the encoder ranks);
2. per pass with items somewhere and per media tensor, one uneven all-to-all (``comm
   .all_to_all_v_start``) from the LLM ranks to the encoder ranks (data: no gradient),
   launched asynchronously: the LLM ranks wait for it before step 3 (in the pipelined
   schedule after computing the micro-batch before), the encoder ranks before encoding (in
   the pipelined schedule after the backward of an earlier micro-batch);
3. the encoder ranks encode each pass in one call and send the rows back: one all-to-all for
   the passes of trainable encoders (differentiable: its backward routes each row's gradient
   to the rank that encoded it) and one under ``no_grad`` for frozen encoders.

In backward exactly one all-to-all runs on the group (none when every encoder is frozen):
the LLM ranks issue it from ``loss.backward()`` (the adjoint of step 3's), the encoder ranks
explicitly (:meth:`EncoderServer.receive_grads`: their step-3 all-to-all is outside
autograd, so that a schedule can put other exchanges between the gradients' arrival and the
encoders' backward), then run the encoders' backward on them. Encoder parameter gradients
are sums over every LLM rank's loss, as with colocated encoders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_omni.distributed.boundary import assign_items, host_index, pad_tail
from torchtitan_omni.distributed.comm import (
    PendingRows,
    ProcessGroup,
    all_to_all_v,
    all_to_all_v_start,
)
from torchtitan_omni.flops import EncoderCost
from torchtitan_omni.omni_model import pass_media
from torchtitan_omni.protocols.media_items import item_rows, key_rows, slice_items
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


def _describe(encoder: OmniEncoder, cost: EncoderCost, modality: str,
              media: dict[str, torch.Tensor]) -> dict:
    """What an LLM rank publishes about one pass's items (host integers only)."""
    index = host_index(media)
    out = [encoder.output_rows(slice_items(index, i, i + 1), modality)
           for i in range(len(item_rows(index)))]
    return {"modality": modality, "costs": cost.items(index, modality),
            "spans": key_rows(index), "out": out,
            "tails": {k: tuple(t.shape[1:]) for k, t in media.items()},
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
                 device: torch.device) -> dict[str, PendingRows]:
    """Step 2 for one pass: each item's input rows to its encoder rank, launched (the
    caller waits when it needs them, or before the next step 3). Returns what arrives (items
    by LLM rank, then in the LLM rank's order; nothing on an LLM rank)."""
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
        received[key] = all_to_all_v_start(send, out_splits, in_splits, ranks.group)
    return received


@dataclass
class _Kept:
    """An encoder rank's rows of trainable passes sent in step 3, kept with their graph until
    their gradients arrive: ``splits[r]`` rows went to rank ``r``."""

    rows: torch.Tensor
    splits: list[int]

    def receive_grads(self, group: ProcessGroup) -> torch.Tensor:
        """The rows' gradients from the LLM ranks: the adjoint all-to-all of step 3, the one
        the LLM ranks' ``loss.backward()`` issues (``comm._AllToAllV.backward``'s splits)."""
        none = self.rows.new_zeros((0, *self.rows.shape[1:]))
        return all_to_all_v(none, self.splits, [0] * group.size(), group)


def _order_rows(ranks: RankSets, plan: list[tuple[int, _Pass]], rows: dict[int, torch.Tensor]
                ) -> tuple[torch.Tensor, list[int]]:
    """An encoder rank's rows of ``plan``'s passes in sending order (by LLM rank, then pass)
    and how many go to each rank of the group."""
    e = ranks.encoders.index(ranks.rank)
    chunks: list[list[torch.Tensor]] = [[] for _ in ranks.llm]
    for i, p in plan:
        sizes = [p.sent(s, e, "out") for s in range(len(ranks.llm))]
        for s, piece in enumerate(rows[i].split(sizes)):
            chunks[s].append(piece)
    splits = [0] * ranks.group.size()
    for s, r in enumerate(ranks.llm):
        splits[r] = sum(c.shape[0] for c in chunks[s])
    return torch.cat([c for per_rank in chunks for c in per_rank]), splits


def _by_trainable(plan: list[_Pass | None]
                  ) -> tuple[list[tuple[int, _Pass]], list[tuple[int, _Pass]]]:
    """The plan's passes (index, pass) of trainable encoders, and of frozen ones."""
    live = [(i, p) for i, p in enumerate(plan) if p is not None]
    return [(i, p) for i, p in live if p.trainable], [(i, p) for i, p in live if not p.trainable]


def _send_rows(ranks: RankSets, plan: list[_Pass | None], rows: dict[int, torch.Tensor]
               ) -> _Kept | None:
    """Step 3 on an encoder rank (``rows``: pass index -> rows in arrival order): one
    all-to-all for the trainable passes' rows, one for the frozen ones'. Returns the
    trainable rows with their graph (None without trainable passes): the exchange itself is
    outside autograd here, their gradients come with :meth:`_Kept.receive_grads`."""
    trainable, frozen = _by_trainable(plan)
    nothing = [0] * ranks.group.size()
    kept = None
    if trainable:
        sent, splits = _order_rows(ranks, trainable, rows)
        all_to_all_v(sent.detach(), nothing, splits, ranks.group)
        kept = _Kept(sent, splits)
    if frozen:
        with torch.no_grad():
            sent, splits = _order_rows(ranks, frozen, rows)
            all_to_all_v(sent, nothing, splits, ranks.group)
    return kept


def _rows_in(ranks: RankSets, plan: list[tuple[int, _Pass]], width: int, dtype: torch.dtype,
             device: torch.device, grad: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Step 3 on an LLM rank for a set of passes (index, pass): the all-to-all of their
    embedding rows. Returns what arrived (in autograd with ``grad``: its backward sends the
    rows' gradients to the ranks that encoded them) and each pass's rows in item order."""
    me, size = ranks.rank, ranks.group.size()
    out_splits = [0] * size
    # A leaf that needs a gradient, so that this rank's backward joins the exchange.
    send = torch.zeros((0, width), dtype=dtype, device=device, requires_grad=grad)
    s = ranks.llm.index(me)
    for e, r in enumerate(ranks.encoders):
        out_splits[r] = sum(p.sent(s, e, "out") for _, p in plan)
    back = all_to_all_v(send, out_splits, [0] * size, ranks.group)
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


def _receive_rows(ranks: RankSets, plan: list[_Pass | None], width: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """Step 3 on an LLM rank: the trainable passes' rows through autograd, then the frozen
    ones' without. Returns the trainable exchange's output (None without one) and the rows
    per pass."""
    trainable, frozen = _by_trainable(plan)
    back, out = None, {}
    if trainable:
        back, got = _rows_in(ranks, trainable, width, dtype, device, grad=True)
        out.update(got)
    if frozen:
        with torch.no_grad():  # frozen encoders: no gradient travels back
            _, got = _rows_in(ranks, frozen, width, dtype, device, grad=False)
        out.update(got)
    return back, out


# ----------------------------------------------------------------- LLM ranks
@dataclass
class _Sent:
    """An LLM rank's micro-batch between :meth:`EncoderClient.send` and ``receive``."""

    passes: list[str]  # the encoder of each pass, in the model's pass order
    plan: list[_Pass | None]
    width: int
    dtype: torch.dtype
    device: torch.device
    flying: list[PendingRows]  # its media's all-to-alls


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
        #: each encoder's FLOP model, what its items are weighed by (built once: it walks
        #: the encoder's parameters)
        self.costs = {name: EncoderCost(spec) for name, spec in self.specs.items()}
        self._pending: dict[str, deque[torch.Tensor]] = {}
        self._sent: deque[_Sent] = deque()  # sent, rows not yet received (oldest first)
        self.last_trainable_exchange = False  # whether the last exchange has a backward

    def install(self) -> list[str]:
        """Replace the model's encoders by stubs fed by this client; returns their names."""
        for name, spec in self.specs.items():
            self.model.encoders[name] = RemoteEncoder(name, spec, self)
        return list(self.specs)

    def send(self, batch: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
        """Steps 1-2 for one micro-batch: its metadata and media out to the encoder ranks
        (while they run ``EncoderServer.receive``). Its rows come with a later
        :meth:`receive` (after the rows of the micro-batches sent before it)."""
        passes = self.model.encoder_passes(absent)
        local = [pass_media(batch, self.specs[name], mods) for name, mods in passes]
        items = [_describe(self.specs[name], self.costs[name], *got) if got is not None else None
                 for (name, _), got in zip(passes, local)]
        weight = cast(torch.Tensor, self.model.llm.tok_embeddings.weight)
        width, dtype, device = weight.shape[-1], weight.dtype, weight.device
        meta: list[Any] = [None] * self.ranks.group.size()
        mine = {"passes": passes, "items": items, "width": width,
                "dtype": str(dtype).removeprefix("torch.")}
        dist.all_gather_object(meta, mine, group=self.ranks.group)
        plan = _plan(meta, self.ranks)
        # in flight until receive(): the media travel while this rank computes
        flying = [rows for p, got in zip(plan, local) if p is not None for rows in _send_inputs(
            self.ranks, p, got[1] if got is not None else None, device).values()]
        self._sent.append(_Sent([name for name, _ in passes], plan, width, dtype, device,
                                flying))

    def receive(self) -> None:
        """Step 3 for the oldest micro-batch sent: its rows, for the stubs of the model's next
        forward (while the encoder ranks run ``EncoderServer.send_rows``)."""
        if any(self._pending.values()):
            raise RuntimeError("EncoderClient.receive: the last micro-batch's embeddings were "
                               "not all used; run the model's forward after each exchange")
        if not self._sent:
            raise RuntimeError("EncoderClient.receive: no micro-batch was sent")
        sent = self._sent.popleft()
        for rows_out in sent.flying:
            rows_out.wait()
        back, rows = _receive_rows(self.ranks, sent.plan, sent.width, sent.dtype, sent.device)
        self.last_trainable_exchange = back is not None
        self._pending = {name: deque() for name in self.specs}
        for i, name in enumerate(sent.passes):
            # a pass no rank has media for: zero rows, outside any graph
            self._pending[name].append(rows.get(i, torch.zeros(
                (0, sent.width), dtype=sent.dtype, device=sent.device)))

    def exchange(self, batch: dict[str, torch.Tensor], absent: Collection[str] = ()) -> None:
        """Steps 1-3 for one micro-batch (:meth:`send`, then :meth:`receive`): call on every
        LLM rank, before the model's forward on ``batch`` with the same ``absent``, while the
        encoder ranks run ``EncoderServer.step``."""
        self.send(batch, absent)
        self.receive()

    def stop(self) -> None:
        """Tell the encoder ranks that no micro-batch follows (the end of a validation, which
        they serve with ``EncoderServer.serve_forward``): the metadata collective of step 1
        with a stop mark instead of passes."""
        meta: list[Any] = [None] * self.ranks.group.size()
        dist.all_gather_object(meta, {"stop": True}, group=self.ranks.group)

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
@dataclass
class _Received:
    """An encoder rank's micro-batch between steps 2 and 3: the plan, the media that arrived
    per pass (by pass index) and the rows' width and dtype; then the rows per pass."""

    plan: list[_Pass | None]
    media: dict[int, dict[str, PendingRows]]  # arriving (encode waits)
    width: int
    dtype: torch.dtype
    rows: dict[int, torch.Tensor] | None = None


class EncoderServer:
    """The encoder ranks' side: encodes what the LLM ranks send and runs the encoders'
    backward on the gradients they send back (see the module docstring).

    Each micro-batch goes through :meth:`receive` (steps 1-2), :meth:`encode`,
    :meth:`send_rows` (step 3), :meth:`receive_grads` and :meth:`backward_encoders`, each
    taking the oldest micro-batch at its stage, so that a schedule may interleave
    micro-batches (``encoder_schedule``); :meth:`step` and :meth:`backward` run one
    micro-batch synchronously."""

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
        self._received: deque[_Received] = deque()  # received, not yet encoded
        self._encoded: deque[_Received] = deque()  # encoded, rows not yet sent
        self._sent: deque[_Kept | None] = deque()  # rows sent, gradients not yet received
        self._grads: deque[tuple[_Kept, torch.Tensor] | None] = deque()  # backward to run
        #: items and embedding rows this rank encoded in the last micro-batch
        self.last_items = self.last_rows = 0
        #: "encode <k>" and "gradients <k>" in the order they ran, k counting micro-batches
        #: from the last clear (the schedule's trace; the trainer clears it each step)
        self.events: list[str] = []

    def trainable(self) -> dict[str, bool]:
        """Whether each encoder has a parameter that needs a gradient."""
        return {n: any(p.requires_grad for p in e.parameters()) for n, e in self.encoders.items()}

    @property
    def idle(self) -> bool:
        """Whether no micro-batch is between :meth:`receive` and :meth:`backward_encoders`."""
        return not (self._received or self._encoded or self._sent or self._grads)

    def receive(self) -> bool:
        """Steps 1-2 for the next micro-batch (while the LLM ranks run
        ``EncoderClient.send``); False, receiving nothing, when they ran ``stop`` instead."""
        meta: list[Any] = [None] * self.ranks.group.size()
        dist.all_gather_object(meta, {"trainable": self.trainable()}, group=self.ranks.group)
        llm = meta[self.ranks.llm[0]]
        if llm.get("stop"):  # every LLM rank stops together (EncoderClient.stop)
            return False
        plan = _plan(meta, self.ranks)
        media = {i: _send_inputs(self.ranks, p, None, self.device)
                 for i, p in enumerate(plan) if p is not None}
        # the rows travel in the LLM's embedding width and dtype, as the LLM ranks announced
        self._received.append(_Received(plan, media, llm["width"], getattr(torch, llm["dtype"])))
        return True

    def encode(self) -> None:
        """Encode each pass of the oldest micro-batch received, in one call per pass (its
        graph kept until :meth:`backward_encoders`)."""
        got = self._received.popleft()
        e = self.ranks.encoders.index(self.ranks.rank)
        got.rows, self.last_items, self.last_rows = {}, 0, 0
        for i, p in enumerate(got.plan):
            if p is None:
                continue
            encoder = cast(OmniEncoder, self.encoders[p.encoder])
            expected = sum(p.sent(s, e, "out") for s in range(len(self.ranks.llm)))
            count = sum(d == e for dest in p.dest for d in dest)
            media = {k: rows.wait() for k, rows in got.media[i].items()}
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
            got.rows[i] = out.to(got.dtype)
            self.last_items += count
            self.last_rows += expected
        got.media = {}  # the inputs are no longer needed
        self.events.append(f"encode {sum(x.startswith('encode') for x in self.events)}")
        self._encoded.append(got)

    def send_rows(self) -> None:
        """Step 3 for the oldest micro-batch encoded (while the LLM ranks run
        ``EncoderClient.receive``). Under ``no_grad`` (validation) nothing is kept for a
        backward."""
        got = self._encoded.popleft()
        assert got.rows is not None  # encode() ran
        kept = _send_rows(self.ranks, got.plan, got.rows)
        if torch.is_grad_enabled():
            self._sent.append(kept)

    def receive_grads(self) -> None:
        """The oldest sent micro-batch's rows' gradients from the LLM ranks (the all-to-all
        their ``loss.backward()`` issues); nothing travels when every encoder is frozen."""
        kept = self._sent.popleft()
        self.events.append(f"gradients {sum(x.startswith('gradients') for x in self.events)}")
        self._grads.append(None if kept is None else
                           (kept, kept.receive_grads(self.ranks.group)))

    def backward_encoders(self) -> None:
        """The encoders' backward of the oldest micro-batch whose gradients arrived
        (accumulated into their parameters' gradients)."""
        got = self._grads.popleft()
        if got is not None:
            kept, grad = got
            torch.autograd.backward(kept.rows, grad)

    def step(self) -> None:
        """Steps 1-3 for one micro-batch: call on every encoder rank while the LLM ranks call
        ``EncoderClient.exchange``; then :meth:`backward` after the LLM ranks' forward."""
        if not self.idle:
            raise RuntimeError("EncoderServer.step: the last step's backward has not run")
        if not self.receive():
            raise RuntimeError("EncoderServer.step: the LLM ranks stopped instead of sending")
        self.encode()
        self.send_rows()

    def backward(self) -> None:
        """The encoders' backward: receives the rows' gradients from the LLM ranks (while
        they run ``loss.backward()``), then backward. Nothing travels when every encoder is
        frozen."""
        self.receive_grads()
        self.backward_encoders()

    @torch.no_grad()
    def serve_forward(self) -> int:
        """Encode micro-batches without backward (validation, the encoders in eval mode as
        the caller sets them) until the LLM ranks run ``EncoderClient.stop``; returns how
        many came."""
        if not self.idle:
            raise RuntimeError("EncoderServer.serve_forward: a training step is not finished")
        served = 0
        while self.receive():
            self.encode()
            self.send_rows()
            served += 1
        return served


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
