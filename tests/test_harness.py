"""The multi-process test harness itself (``tests/harness.py``)."""

from __future__ import annotations

import time

import pytest

from tests.harness import run_distributed


def _sleep_then_return(rank: int, world: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def _rank_one_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one's failure")
    return rank


def test_results_come_back_in_rank_order():
    assert run_distributed(_sleep_then_return, 2, 0.0) == [0, 1]


def test_a_failing_rank_is_reported_with_its_error():
    with pytest.raises(AssertionError, match="(?s)rank 1:.*rank one's failure"):
        run_distributed(_rank_one_fails, 2)


def test_hung_ranks_are_killed_after_one_timeout_for_all_of_them():
    """Four ranks that never finish: reported as hung after about ``timeout`` seconds, not
    four times it (each rank's join waited a whole timeout before)."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 3: no result \(hung\)"):
        run_distributed(_sleep_then_return, 4, 600.0, timeout=4.0)
    assert time.monotonic() - start < 12.0
