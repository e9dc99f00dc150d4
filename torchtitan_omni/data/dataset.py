"""The resumable omni dataset: rows -> documents -> buffered, packed, batched.

Each iterator (one per data-parallel rank and loader worker) reads its shard of the rows,
turns each into documents (skipping bad samples per the policy), keeps up to a buffer of them,
and yields batches chosen by the :class:`BatchPlan`. Its state is the epoch, the next row to
read and the keys of the buffered documents: processing is deterministic per (epoch, row), so a
restored iterator re-creates its buffer and yields exactly the batches it would have.

The states of all shards of a checkpoint can also be re-split over another number of shards
(:meth:`OmniDataset.load_resplit`, ``torchtitan_omni.data.resplit``): a re-split shard first
reads the rows it was dealt of the oldest epoch (``pending``), then continues with the next
epoch under the new sharding, skipping the positions old shards had read (``exclude``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.tools.logging import logger

from torchtitan_omni.data.bad_samples import BadSample, BadSampleHandler
from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import Document, DocumentEncoder
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.data.resplit import (
    excluded, full_key, plan_resplit, runs_decode, shard_length, share,
)
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.source import RowSource, ShardSpec
from torchtitan_omni.errors import DataFileError

#: hard cap on buffered documents whatever the token target (bounds memory)
MAX_BUFFER = 4096


class OmniDataset(IterableDataset, Stateful):
    """Yields ``(batch, labels, stats)``; ``OmniDataLoader`` strips ``stats`` off."""

    def __init__(
        self, source: RowSource, encoder: DocumentEncoder, plan: BatchPlan, *, dp_rank: int = 0,
        dp_world_size: int = 1, buffer_docs: int = 64, infinite: bool = True, seed: int = 0,
        bad_sample_policy: str = "skip",
    ) -> None:
        self.source = source
        self.encoder = encoder
        self.plan = plan
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.buffer_docs = buffer_docs
        self.infinite = infinite
        self.seed = seed
        self.handler = BadSampleHandler(bad_sample_policy)
        self.epoch = 0
        self.cursor = 0  # next row (shard-local number) to read in this epoch
        self._buffer: list[Document] = []
        self._restore_keys: list[tuple] | None = None
        self._epoch_docs = 0
        # after a re-split: rows of `epoch` still owed ({"base", "runs", "next"}), positions of
        # an epoch already read by old shards ({"epoch", "groups"}), the plan not yet applied
        self._pending: dict | None = None
        self._exclude: dict | None = None
        self._resplit: dict | None = None

    # ----------------------------------------------------------------- sharding
    def shard(self) -> ShardSpec:
        """This iterator's shard: data-parallel rank x loader worker."""
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return ShardSpec(self.dp_rank * workers + wid, self.dp_world_size * workers)

    # ----------------------------------------------------------------- rows -> documents
    def _rng(self, epoch: int, q: int, index: int, count: int) -> random.Random:
        return random.Random(hash((self.seed, epoch, index, count, q)) & (2**63 - 1))

    def _documents(self, ref: tuple[int, int, int, int], row: dict, source) -> list[Document]:
        """Documents of the row ``ref = (epoch, q, shard index, shard count)``: processed with the
        RNG of that shard and row, keyed ``(epoch, q, chunk, shard index, shard count)``."""
        epoch, q, index, count = ref
        try:
            sample = parse_row(row, source)
            docs = self.encoder.encode(sample, self._rng(epoch, q, index, count))
            self.encoder.require_targets(sample, docs)
        except BadSample as bad:
            self.handler(bad)
            return []
        except Exception as e:  # name the row for anything unexpected
            raise RuntimeError(
                f"{source}: unexpected error while processing the sample: {e!r}"
            ) from e
        for i, d in enumerate(docs):
            d.key = (epoch, q, i, index, count)
        return docs

    def _restore_buffer(self, shard: ShardSpec) -> None:
        """Rebuild the buffered documents of a loaded state from their keys."""
        keys, self._restore_keys = self._restore_keys, None
        if not keys:
            return
        keys = [full_key(k, shard.index, shard.count) for k in keys]
        wanted: dict[tuple[int, int, int, int], list[int]] = {}
        for epoch, q, chunk, index, count in keys:
            wanted.setdefault((epoch, q, index, count), []).append(chunk)
        rebuilt: dict[tuple, Document] = {}
        if not self.source.streaming:
            for epoch, q, index, count in wanted:
                row, src = self.source.shard_row(ShardSpec(index, count), epoch, q)
                for d in self._documents((epoch, q, index, count), row, src):
                    rebuilt[d.key] = d
        else:  # re-read the stream from the oldest buffered row (own keys only: no re-split)
            if any((i, c) != (shard.index, shard.count) for _, _, i, c in wanted):
                raise ValueError("a streaming dataset's state holds documents of another shard")
            for epoch in sorted({e for e, *_ in wanted}):
                qs = [q for e, q, _, _ in wanted if e == epoch]
                for q, row, src in self.source.shard_rows(shard, epoch, min(qs)):
                    if q > max(qs):
                        break
                    if (epoch, q, shard.index, shard.count) in wanted:
                        for d in self._documents((epoch, q, shard.index, shard.count), row, src):
                            rebuilt[d.key] = d
        self._buffer = [rebuilt[k] for k in keys if k in rebuilt]

    # ----------------------------------------------------------------- iteration
    def _regular_rows(self, shard: ShardSpec) -> Iterator[tuple[tuple, dict, object]]:
        """The shard's own rows of the epoch from the cursor, minus excluded positions."""
        e = self.epoch
        groups = self._exclude["groups"] if self._exclude and self._exclude["epoch"] == e else None
        if groups is None:
            for q, row, src in self.source.shard_rows(shard, e, self.cursor):
                self.cursor = q + 1
                yield (e, q, shard.index, shard.count), row, src
            return
        qs = np.arange(self.cursor, shard_length(len(self.source), shard.index, shard.count))
        skip = excluded(qs * shard.count + shard.index, groups)
        for q, skipped in zip(qs.tolist(), skip.tolist()):
            self.cursor = q + 1
            if skipped:  # an old shard read it before the re-split
                continue
            row, src = self.source.shard_row(shard, e, q)
            yield (e, q, shard.index, shard.count), row, src

    def _pending_rows(self) -> Iterator[tuple[tuple, dict, object]]:
        """Rows of the epoch dealt to this shard by a re-split, read with the old shard's RNG."""
        e, pending = self.epoch, self._pending
        base = int(pending["base"])
        positions = runs_decode(pending["runs"])
        for j in range(int(pending["next"]), len(positions)):
            p = int(positions[j])
            index, q = p % base, p // base
            row, src = self.source.shard_row(ShardSpec(index, base), e, q)
            pending["next"] = j + 1
            yield (e, q, index, base), row, src

    def _rows(self, shard: ShardSpec) -> Iterator[tuple[tuple, dict, object]]:
        """``(row ref, row, source)`` from the current position, looping if infinite."""
        while True:
            whole_epoch = (self.cursor == 0 and self._pending is None
                           and not (self._exclude and self._exclude["epoch"] == self.epoch))
            self._epoch_docs = 0
            produced = 0
            reader = (
                self._pending_rows() if self._pending is not None else self._regular_rows(shard)
            )
            for item in reader:
                produced += 1
                yield item
            if not self.infinite:
                return
            if whole_epoch and produced == 0:
                raise DataFileError(
                    f"shard {shard.index} of {shard.count} of {', '.join(self.source.files)} is "
                    "empty: the split has fewer rows than data-parallel ranks x loader workers"
                )
            if whole_epoch and self._epoch_docs == 0:
                raise DataFileError(
                    f"no usable sample in a whole epoch of shard {shard.index} of "
                    f"{', '.join(self.source.files)}; skipped: {self.handler.stats()}"
                )
            self.epoch += 1
            self.cursor = 0
            self._pending = None
            if self._exclude is not None and self._exclude["epoch"] < self.epoch:
                self._exclude = None
            logger.info(f"data shard {shard.index}/{shard.count}: starting epoch {self.epoch}")

    def _need_more(self) -> bool:
        if len(self._buffer) >= MAX_BUFFER:
            return False
        tokens = sum(len(d) for d in self._buffer)
        return len(self._buffer) < self.buffer_docs or tokens < 2 * self.plan.tokens_wanted()

    def __iter__(self):
        shard = self.shard()
        self._apply_resplit(shard)
        self._restore_buffer(shard)
        rows = self._rows(shard)
        exhausted = False
        while True:
            while not exhausted and self._need_more():
                try:
                    ref, row, src = next(rows)
                except StopIteration:
                    exhausted = True
                    break
                docs = self._documents(ref, row, src)
                self._buffer.extend(docs)
                self._epoch_docs += len(docs)
            if not self._buffer:
                return
            rows_idx = self.plan.select([len(d) for d in self._buffer])
            chosen = {i for row in rows_idx for i in row}
            rows_docs = [[self._buffer[i] for i in row] for row in rows_idx]
            self._buffer = [d for i, d in enumerate(self._buffer) if i not in chosen]
            longest = max(sum(len(d) for d in row) for row in rows_docs)
            row_len = self.plan.row_length(longest)
            if self.plan.fixed_length:
                rows_docs += [[] for _ in range(self.plan.packed_rows - len(rows_docs))]
            batch, labels = collate(
                rows_docs, row_len, self.encoder.sp.pad, self.encoder.processors
            )
            yield batch, labels, {"shard": shard.index, "skipped": self.handler.stats()}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        shard = self.shard()
        self._apply_resplit(shard)
        if self._restore_keys is None:
            keys = [list(d.key) for d in self._buffer]
        else:
            keys = [list(full_key(k, shard.index, shard.count)) for k in self._restore_keys]
        pending = None
        if self._pending is not None:
            pending = {"base": int(self._pending["base"]), "runs": self._pending["runs"],
                       "next": int(self._pending["next"])}
        exclude = None
        if self._exclude is not None:
            exclude = {"epoch": int(self._exclude["epoch"]), "groups": self._exclude["groups"]}
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": keys,
                "skipped": self.handler.state_dict(), "shard": [shard.index, shard.count],
                "pending": pending, "exclude": exclude}

    def load_state_dict(self, state: dict) -> None:
        shard = self.shard()
        saved = state.get("shard")
        if saved is not None and (int(saved[0]), int(saved[1])) != (shard.index, shard.count):
            raise ValueError(
                f"the dataloader state is shard {saved[0]} of {saved[1]}, this loader reads shard "
                f"{shard.index} of {shard.count}: resuming needs the same data-parallel degree "
                "and number of loader workers"
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._restore_keys = [tuple(k) for k in state["buffer"]]
        self._buffer = []
        self.handler.load_state_dict(state.get("skipped", {}))
        pending, exclude = state.get("pending"), state.get("exclude")
        self._pending = None if pending is None else {
            "base": int(pending["base"]), "runs": pending["runs"], "next": int(pending["next"])}
        self._exclude = None if exclude is None else {
            "epoch": int(exclude["epoch"]), "groups": exclude["groups"]}
        self._resplit = None

    def load_resplit(self, states: list[dict]) -> dict[str, int]:
        """Continue the stream of old shards ``0..len(states)-1`` (their :meth:`state_dict`),
        whatever this run's number of shards (``torchtitan_omni.data.resplit``). Each shard
        takes its part when it starts (in its loader worker, if any). Returns the old shards'
        skipped-sample counters by reason (new shard 0 carries them on)."""
        if self.source.streaming:
            raise ValueError(
                "data.streaming: a streaming dataset's position cannot be re-split over another "
                "number of data-parallel ranks or loader workers (only map-style datasets can); "
                "keep both, or pass --checkpoint.exclude_from_loading dataloader to restart the "
                "data stream"
            )
        self._resplit = plan_resplit(states, len(self.source))
        return dict(self._resplit["skipped"]["counts"])

    def _apply_resplit(self, shard: ShardSpec) -> None:
        """Take this shard's part of a loaded re-split plan (once)."""
        plan, self._resplit = self._resplit, None
        if plan is None:
            return
        keys, runs = share(plan, shard.index, shard.count)
        self.epoch = int(plan["epoch"])
        self.cursor = 0
        self._pending = {"base": int(plan["base"]), "runs": runs, "next": 0}
        self._exclude = plan["exclude"]
        self._buffer = []
        self._restore_keys = list(keys)
        skipped = dict(plan["skipped"])
        if shard.index != 0:  # the counters go to shard 0 only, so the totals are preserved
            skipped["counts"] = {}
        self.handler.load_state_dict(skipped)
        owed = sum(int(r[2]) for r in runs)
        logger.info(
            f"data shard {shard.index}/{shard.count}: continuing epoch {self.epoch} of "
            f"{plan['old_shards']} old shard(s) with {len(keys)} buffered document(s) and "
            f"{owed} owed row(s)"
        )


def empty_stats() -> dict[str, int]:
    """Skipped-sample counters with every reason at zero."""
    return BadSampleHandler().stats()
