"""Bad data: skipped, logged once with its source and row, and counted; or fatal.

Processing code raises :class:`BadSample` with a reason from :data:`REASONS`; the dataset hands
it to :class:`BadSampleHandler`, which applies ``data.bad_sample_policy``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torchtitan.tools.logging import logger

from torchtitan_omni.errors import OmniInputError

MISSING_MEDIA = "missing_media"
CORRUPT_MEDIA = "corrupt_media"
UNKNOWN_PLACEHOLDER = "unknown_placeholder"
PLACEHOLDER_MISMATCH = "placeholder_mismatch"
TOO_LONG = "too_long"
MODALITY_DISABLED = "modality_disabled"
MALFORMED = "malformed_row"
INVALID_JSON = "invalid_json"
EMPTY_TEXT = "empty_text"
EMPTY_CONVERSATION = "empty_conversation"
NO_TARGETS = "no_targets"

#: every reason a sample can be skipped for (the keys of ``loader.stats()``)
REASONS = (MISSING_MEDIA, CORRUPT_MEDIA, UNKNOWN_PLACEHOLDER, PLACEHOLDER_MISMATCH, TOO_LONG,
           MODALITY_DISABLED, MALFORMED, INVALID_JSON, EMPTY_TEXT, EMPTY_CONVERSATION,
           NO_TARGETS)

#: log lines per reason and worker before further skips are only counted
MAX_LOGGED_PER_REASON = 50
#: a disabled modality is a configuration choice, not a data problem: a few lines suffice
MAX_LOGGED = {MODALITY_DISABLED: 3}


@dataclass(frozen=True)
class Source:
    """Where a sample comes from: a data file, its row (0-based) in that file and, for JSON
    lines, the row's 1-based line number (what an editor shows; blank lines are not rows)."""

    file: str
    row: int
    line: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file} line {self.line}"
        return f"{self.file} row {self.row}"


class BadSample(Exception):
    """A sample that cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str, source: Source | None = None) -> None:
        assert reason in REASONS, reason
        self.reason, self.detail, self.source = reason, detail, source
        super().__init__(self.message())

    def message(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.reason}: {self.detail}"


class BadSampleError(OmniInputError, ValueError):
    """Raised instead of skipping when ``data.bad_sample_policy = "error"``."""


class BadSampleHandler:
    """Applies the bad-sample policy and keeps the per-reason counters."""

    def __init__(self, policy: str = "skip") -> None:
        if policy not in ("skip", "error"):
            raise ValueError(f"data.bad_sample_policy must be 'skip' or 'error', got {policy!r}")
        self.policy = policy
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, int]] = set()
        self._per_reason: Counter[str] = Counter()

    def __call__(self, bad: BadSample) -> None:
        """Skip (count and log the first time) or raise, per the policy."""
        if self.policy == "error":
            raise BadSampleError(
                f"bad sample ({bad.message()}); set data.bad_sample_policy='skip' to skip such "
                "samples instead"
            ) from bad
        self.counts[bad.reason] += 1
        key = (bad.source.file, bad.source.row) if bad.source else None
        if key is not None and key in self._logged:
            return  # seen in an earlier epoch: counted, not logged again
        self._per_reason[bad.reason] += 1
        n = self._per_reason[bad.reason]
        limit = MAX_LOGGED.get(bad.reason, MAX_LOGGED_PER_REASON)
        if n <= limit:
            if key is not None:
                self._logged.add(key)  # bounded: at most `limit` per reason
            logger.warning(f"skipping sample: {bad.message()}")
        if n == limit:
            logger.warning(
                f"{limit} samples skipped for {bad.reason}; further ones are counted "
                "(loader.stats()) but not logged"
            )

    def stats(self) -> dict[str, int]:
        """Skipped samples per reason (every reason present, zeros included)."""
        return {reason: int(self.counts.get(reason, 0)) for reason in REASONS}

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "logged": sorted(self._logged),
                "per_reason": dict(self._per_reason)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state.get("counts", {}))
        self._logged = {tuple(k) for k in state.get("logged", [])}
        self._per_reason = Counter(state.get("per_reason", {}))
