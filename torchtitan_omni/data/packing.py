"""Choosing which buffered documents form the next batch, and how long its rows are.

Packing (``data.packing``): rows of capacity ``seq_len`` hold several documents. The oldest
buffered document always opens the first row (so none waits forever); then each row takes the
largest document that still fits, until none does.

Without packing, a row holds one document. The token-budget batcher (``data.token_budget``)
then starts from the oldest document and adds those closest to it in length while
``rows x padded length`` stays within the budget, so padding stays small.

Rows are padded to a multiple of ``multiple`` (lcm of ``data.pad_multiple`` and the Ulysses
degree) capped at ``seq_len``, or to ``seq_len`` when ``fixed_length`` is set (static shapes for
``torch.compile``). Long rows round coarser, to ``multiple`` times the largest power of two that
stays within 1/32 of their length (:func:`bucket`): every new row length costs a cuDNN attention
plan (about 45 ms forward and 45 ms backward on an H200, each step when lengths drift) and may
cost a recompile, and with buckets an 8K job sees at most a few dozen lengths for <3% padding.
"""

from __future__ import annotations

from dataclasses import dataclass


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


#: a row's padding stays under 1/BUCKET_FRACTION of its length
BUCKET_FRACTION = 32


def bucket(n: int, multiple: int) -> int:
    """``n`` rounded up to ``multiple`` x 2^k, the largest such step within ``n / 32``."""
    step = multiple
    while step * 2 * BUCKET_FRACTION <= n:
        step *= 2
    return round_up(n, step)


@dataclass(frozen=True)
class BatchPlan:
    """How batches are shaped."""

    seq_len: int
    rows: int = 1  # rows per batch when token_budget is 0
    token_budget: int = 0
    packing: bool = True
    fixed_length: bool = False
    multiple: int = 1

    def __post_init__(self) -> None:
        if (
            self.token_budget
            and self.token_budget < self.seq_len
            and (self.packing or self.fixed_length)
        ):
            raise ValueError(
                f"data.token_budget ({self.token_budget}) must be at least training.seq_len "
                f"({self.seq_len}) when rows are packed or of fixed length"
            )

    @property
    def packed_rows(self) -> int:
        """Rows per batch when rows are packed or of fixed length."""
        if self.token_budget:
            return max(1, self.token_budget // self.seq_len)
        return self.rows

    def max_tokens(self) -> int:
        """The most tokens (padding included) one batch can hold."""
        if self.token_budget and not self.packing and not self.fixed_length:
            return self.token_budget
        return self.packed_rows * self.seq_len

    def row_length(self, longest: int) -> int:
        """Padded row length for rows whose longest content is ``longest`` tokens."""
        if self.fixed_length:
            return self.seq_len
        return min(bucket(max(longest, 1), self.multiple), self.seq_len)

    def tokens_wanted(self) -> int:
        """Buffered tokens that let a batch fill up."""
        return (
            self.packed_rows * self.seq_len
            if (self.packing or not self.token_budget)
            else self.token_budget
        )

    def select(self, lengths: list[int]) -> list[list[int]]:
        """Rows of buffer indices (``lengths`` in arrival order) forming the next batch."""
        if not lengths:
            return []
        if self.packing:
            return self._pack(lengths)
        if self.token_budget and not self.fixed_length:
            return self._budget(lengths)
        return [[i] for i in range(min(self.packed_rows, len(lengths)))]

    def _pack(self, lengths: list[int]) -> list[list[int]]:
        remaining = list(range(len(lengths)))
        rows = []
        for _ in range(self.packed_rows):
            if not remaining:
                break
            first = remaining.pop(0)
            row, space = [first], self.seq_len - lengths[first]
            while True:
                best = None
                for i in remaining:
                    if lengths[i] <= space and (best is None or lengths[i] > lengths[best]):
                        best = i
                if best is None:
                    break
                remaining.remove(best)
                row.append(best)
                space -= lengths[best]
            rows.append(row)
        return rows

    def _budget(self, lengths: list[int]) -> list[list[int]]:
        chosen = [0]
        longest = lengths[0]
        by_closeness = sorted(
            range(1, len(lengths)), key=lambda i: (abs(lengths[i] - lengths[0]), i)
        )
        for i in by_closeness:
            new_longest = max(longest, lengths[i])
            if (len(chosen) + 1) * self.row_length(new_longest) > self.token_budget:
                continue
            chosen.append(i)
            longest = new_longest
        return [[i] for i in sorted(chosen)]
