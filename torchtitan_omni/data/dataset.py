"""The resumable omni dataset: rows -> documents -> buffered, packed, batched.

Each iterator (one per data-parallel rank and loader worker) reads its shard of the rows,
turns each into documents (skipping bad samples per the policy), keeps up to a buffer of them,
and yields batches chosen by the :class:`BatchPlan`. Its state is the epoch, the next row to
read and the keys of the buffered documents: processing is deterministic per (epoch, row), so a
restored iterator re-creates its buffer and yields exactly the batches it would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.tools.logging import logger

from torchtitan_omni.data.bad_samples import BadSample, BadSampleHandler
from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import Document, DocumentEncoder
from torchtitan_omni.data.packing import BatchPlan
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.source import RowSource, ShardSpec

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

    # ----------------------------------------------------------------- sharding
    def shard(self) -> ShardSpec:
        """This iterator's shard: data-parallel rank x loader worker."""
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return ShardSpec(self.dp_rank * workers + wid, self.dp_world_size * workers)

    # ----------------------------------------------------------------- rows -> documents
    def _rng(self, epoch: int, q: int, shard: ShardSpec) -> random.Random:
        return random.Random(hash((self.seed, epoch, shard.index, shard.count, q)) & (2**63 - 1))

    def _documents(self, shard: ShardSpec, epoch: int, q: int, row: dict, source) -> list[Document]:
        try:
            docs = self.encoder.encode(parse_row(row, source), self._rng(epoch, q, shard))
        except BadSample as bad:
            self.handler(bad)
            return []
        except Exception as e:  # name the row for anything unexpected
            raise RuntimeError(f"{source}: unexpected error while processing the sample: {e!r}") from e
        for i, d in enumerate(docs):
            d.key = (epoch, q, i)
        return docs

    def _restore_buffer(self, shard: ShardSpec) -> None:
        """Rebuild the buffered documents of a loaded state from their keys."""
        keys, self._restore_keys = self._restore_keys, None
        if not keys:
            return
        wanted: dict[tuple[int, int], list[int]] = {}
        for epoch, q, chunk in keys:
            wanted.setdefault((epoch, q), []).append(chunk)
        rebuilt: dict[tuple, Document] = {}
        if not self.source.streaming:
            for epoch, q in wanted:
                row, src = self.source.shard_row(shard, epoch, q)
                for d in self._documents(shard, epoch, q, row, src):
                    rebuilt[d.key] = d
        else:  # re-read the stream from the oldest buffered row
            for epoch in sorted({e for e, _ in wanted}):
                qs = [q for e, q in wanted if e == epoch]
                for q, row, src in self.source.shard_rows(shard, epoch, min(qs)):
                    if q > max(qs):
                        break
                    if (epoch, q) in wanted:
                        for d in self._documents(shard, epoch, q, row, src):
                            rebuilt[d.key] = d
        self._buffer = [rebuilt[tuple(k)] for k in keys if tuple(k) in rebuilt]

    # ----------------------------------------------------------------- iteration
    def _rows(self, shard: ShardSpec) -> Iterator[tuple[int, int, dict, object]]:
        """``(epoch, q, row, source)`` from the current position, looping if infinite."""
        while True:
            whole_epoch = self.cursor == 0
            self._epoch_docs = 0
            produced = 0
            for q, row, src in self.source.shard_rows(shard, self.epoch, self.cursor):
                produced += 1
                yield self.epoch, q, row, src
            if not self.infinite:
                return
            if whole_epoch and produced == 0:
                raise ValueError(
                    f"shard {shard.index} of {shard.count} of {', '.join(self.source.files)} is "
                    "empty: the split has fewer rows than data-parallel ranks x loader workers"
                )
            if whole_epoch and self._epoch_docs == 0:
                raise ValueError(
                    f"no usable sample in a whole epoch of shard {shard.index} of "
                    f"{', '.join(self.source.files)}; skipped: {self.handler.stats()}"
                )
            self.epoch += 1
            self.cursor = 0
            logger.info(f"data shard {shard.index}/{shard.count}: starting epoch {self.epoch}")

    def _need_more(self) -> bool:
        if len(self._buffer) >= MAX_BUFFER:
            return False
        tokens = sum(len(d) for d in self._buffer)
        return len(self._buffer) < self.buffer_docs or tokens < 2 * self.plan.tokens_wanted()

    def __iter__(self):
        shard = self.shard()
        self._restore_buffer(shard)
        rows = self._rows(shard)
        exhausted = False
        while True:
            while not exhausted and self._need_more():
                try:
                    epoch, q, row, src = next(rows)
                except StopIteration:
                    exhausted = True
                    break
                self.cursor = q + 1
                docs = self._documents(shard, epoch, q, row, src)
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
            batch, labels = collate(rows_docs, row_len, self.encoder.sp.pad, self.encoder.processors)
            yield batch, labels, {"shard": shard.index, "skipped": self.handler.stats()}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        keys = [list(d.key) for d in self._buffer] if self._restore_keys is None else self._restore_keys
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": keys,
                "skipped": self.handler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._restore_keys = [tuple(k) for k in state["buffer"]]
        self._buffer = []
        self.handler.load_state_dict(state.get("skipped", {}))


def empty_stats() -> dict[str, int]:
    """Skipped-sample counters with every reason at zero."""
    return BadSampleHandler().stats()

