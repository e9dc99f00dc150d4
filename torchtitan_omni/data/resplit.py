"""Re-splitting the data stream of a checkpoint over another number of shards.

A shard (data-parallel rank x loader worker) of a map-style split reads, in epoch ``e``, the
positions ``q * S + s`` of the epoch's seeded permutation (``source.RowSource``). Its state
(``OmniDataset.state_dict``) says what it has read: the epoch, the next ``q`` (``cursor``), the
keys of the documents it read but has not batched yet (``buffer``), and, for a shard created
by an earlier re-split, the rows it still owes of its epoch (``pending``) and the positions of
its epoch that other shards had read before (``exclude``).

:func:`plan_resplit` turns the states of the old shards into a plan for any number of new
shards (:func:`share`):

- ``E`` = the smallest epoch of the old shards (they may be at most one epoch apart);
- owed: every position of epoch ``E`` that no old shard has read, and every old shard's
  buffered documents; the buffered documents (sorted by epoch, position, chunk) and then the
  owed rows (sorted by position) are dealt round-robin to the new shards, so the split is
  deterministic and complete. A new shard rebuilds its buffered documents from their keys and
  reads its owed rows with the RNG of the old shard that would have read them, so processing
  (e.g. the caption drop) is what the uninterrupted run would have done;
- then each new shard continues with epoch ``E + 1`` under the new sharding, skipping the
  positions of ``E + 1`` that an old shard had already read (``exclude``).

Position sets are stored compactly as arithmetic runs ``[start, step, length]``: the rows owed
are mostly one contiguous tail of the epoch, so a new shard's share is a few runs.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

#: a document key: (epoch, q, chunk, shard index, shard count) -> position q * count + index
Key = tuple[int, int, int, int, int]


def runs_encode(values: np.ndarray) -> list[list[int]]:
    """``[start, step, length]`` runs of consecutive equal steps covering ``values`` in order."""
    a = np.asarray(values, dtype=np.int64)
    n = len(a)
    if n == 0:
        return []
    if n == 1:
        return [[int(a[0]), 1, 1]]
    d = np.diff(a)
    # a run starts at 0 and wherever the step changes; it covers [start, next start)
    starts = np.concatenate([[0], np.flatnonzero(d[1:] != d[:-1]) + 1])
    ends = np.concatenate([starts[1:], [n]])
    steps = np.where(starts < n - 1, d[np.minimum(starts, n - 2)], 1)
    return [[int(a[b]), int(st), int(e - b)] for b, e, st in zip(starts, ends, steps)]


def runs_decode(runs) -> np.ndarray:
    """The values of ``[start, step, length]`` runs, in order."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    lengths = r[:, 2]
    total = int(lengths.sum())
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    offset = np.arange(total, dtype=np.int64) - first
    return np.repeat(r[:, 0], lengths) + offset * np.repeat(r[:, 1], lengths)


def excluded(positions: np.ndarray, groups) -> np.ndarray:
    """Which ``positions`` an exclusion set holds: groups ``[count, cursors]`` each hold the
    positions ``q * count + s`` with ``q < cursors[s]`` (what shard ``s`` of ``count`` read)."""
    pos = np.asarray(positions, dtype=np.int64)
    out = np.zeros(len(pos), dtype=bool)
    for count, cursors in groups:
        c = np.asarray(cursors, dtype=np.int64)
        out |= (pos // count) < c[pos % count]
    return out


def shard_length(n_rows: int, index: int, count: int) -> int:
    """Rows of shard ``index`` of ``count`` in one epoch of ``n_rows``."""
    return max(0, (n_rows - index + count - 1) // count)


def full_key(key, index: int, count: int) -> Key:
    """A buffered document's key with its shard: 3-element keys (epoch, q, chunk) are the
    reading shard's own (states written before re-splitting existed)."""
    k = tuple(int(v) for v in key)
    if len(k) == 3:
        return (*k, index, count)
    if len(k) != 5:
        raise ValueError(f"malformed buffered-document key {list(key)} in the dataloader state")
    return k  # type: ignore[return-value]


def _merge_groups(groups: dict[int, np.ndarray], count: int, cursors) -> None:
    c = np.asarray(cursors, dtype=np.int64)
    groups[count] = np.maximum(groups[count], c) if count in groups else c


def merge_skipped(states: list[dict]) -> dict:
    """Skipped-sample counters of several shards as one (counts summed)."""
    counts: Counter = Counter()
    logged: set = set()
    per_reason: Counter = Counter()
    for st in states:
        counts.update({k: int(v) for k, v in st.get("counts", {}).items()})
        logged.update(tuple(k) for k in st.get("logged", []))
        for k, v in st.get("per_reason", {}).items():
            per_reason[k] = max(per_reason[k], int(v))
    return {"counts": dict(counts), "logged": sorted(logged), "per_reason": dict(per_reason)}


def plan_resplit(states: list[dict], n_rows: int) -> dict:
    """The plan continuing the stream of old shards ``0..len(states)-1`` (their dataset states,
    map-style, ``n_rows`` rows per epoch) over any number of new shards (module docstring)."""
    count = len(states)
    for s, st in enumerate(states):
        shard = st.get("shard")
        if shard is not None and (int(shard[0]), int(shard[1])) != (s, count):
            raise ValueError(
                f"the dataloader state of old data shard {s} of {count} was written by shard "
                f"{shard[0]} of {shard[1]}: the checkpoint's dataloader entries do not match"
            )
    epochs = [int(st["epoch"]) for st in states]
    first = min(epochs)
    if max(epochs) - first > 1:
        raise ValueError(
            f"the data shards of the checkpoint are more than one epoch apart (epochs "
            f"{sorted(set(epochs))}): their stream cannot be re-split over another number of "
            "data ranks; keep the data-parallel size and loader workers, or pass "
            "--checkpoint.exclude_from_loading dataloader to restart the data stream"
        )
    owed_parts: list[np.ndarray] = []
    bases: set[int] = set()
    groups: dict[int, np.ndarray] = {}  # positions of epoch first + 1 already read
    ahead = np.zeros(count, dtype=np.int64)
    any_ahead = False
    buffered: list[Key] = []
    for s, st in enumerate(states):
        e = int(st["epoch"])
        pending, exclude = st.get("pending"), st.get("exclude")
        buffered += [full_key(k, s, count) for k in st.get("buffer", [])]
        if exclude and int(exclude["epoch"]) == first + 1:
            for c, cursors in exclude["groups"]:
                _merge_groups(groups, int(c), cursors)
        if e == first:
            if pending is not None:
                rows = runs_decode(pending["runs"])[int(pending["next"]):]
                base = int(pending["base"])
            else:
                qs = np.arange(int(st["cursor"]), shard_length(n_rows, s, count), dtype=np.int64)
                rows = qs * count + s
                if exclude and int(exclude["epoch"]) == first:
                    rows = rows[~excluded(rows, exclude["groups"])]
                base = count
            if len(rows):
                owed_parts.append(rows)
                bases.add(base)
        else:
            if pending is not None:
                raise ValueError(
                    f"old data shard {s} is ahead of epoch {first} and still owes rows")
            ahead[s] = int(st["cursor"])
            any_ahead = True
    if any_ahead:
        _merge_groups(groups, count, ahead)
    if len(bases) > 1:
        raise ValueError(f"old data shards owe rows of epoch {first} under different "
                         f"shardings {sorted(bases)}")
    owed = np.sort(np.concatenate(owed_parts)) if owed_parts else np.zeros(0, dtype=np.int64)
    if len(owed) and (np.any(owed[1:] == owed[:-1]) or owed[0] < 0 or owed[-1] >= n_rows):
        raise ValueError("the old data shards' states overlap or exceed the epoch (a corrupted "
                         "or mismatched dataloader state)")
    buffered.sort(key=lambda k: (k[0], k[1] * k[4] + k[3], k[2]))
    if len(set(buffered)) != len(buffered):
        raise ValueError("the old data shards buffered the same document twice (a corrupted "
                         "dataloader state)")
    return {
        "epoch": first,
        "base": bases.pop() if bases else count,
        "owed": runs_encode(owed),
        "buffered": [list(k) for k in buffered],
        "exclude": ({"epoch": first + 1,
                     "groups": [[c, g.tolist()] for c, g in sorted(groups.items())]}
                    if groups else None),
        "skipped": merge_skipped([st.get("skipped", {}) for st in states]),
        "old_shards": count,
    }


def share(plan: dict, index: int, count: int) -> tuple[list[Key], list[list[int]]]:
    """Shard ``index`` of ``count``'s part of a plan: its buffered-document keys and the runs of
    the positions it owes. Item ``i`` of (buffered docs, then owed rows) goes to shard
    ``i % count``."""
    buffered = [tuple(int(v) for v in k) for k in plan["buffered"]]
    mine = buffered[index::count]
    owed = runs_decode(plan["owed"])
    start = (index - len(buffered)) % count
    return mine, runs_encode(owed[start::count])  # type: ignore[return-value]
