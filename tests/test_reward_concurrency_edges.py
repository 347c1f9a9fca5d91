"""Edge cases of scoring calls concurrently under a time limit (rewards/concurrent.py), written
against behaviour: no calls, and a call that answers after its time limit (its late answer is
discarded, the calls after it still count)."""

from __future__ import annotations

import threading

import pytest

from rewards.concurrent import run_concurrently

HANG_GUARD_S = 300


def test_no_calls_return_no_outcomes():
    assert run_concurrently([], timeout_s=1.0, max_workers=4) == []
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        run_concurrently([lambda: 1], timeout_s=1.0, max_workers=0)


def test_late_answer_is_discarded_and_later_calls_still_count():
    """One worker: call 0 blocks until call 1 (which only starts once call 0 is given up on)
    releases it; call 0 then answers late, while call 1 is still running."""
    release, late_done = threading.Event(), threading.Event()

    def slow():
        try:
            assert release.wait(HANG_GUARD_S), "hang guard: never released"
            return "late"
        finally:
            late_done.set()

    def after():
        release.set()
        assert late_done.wait(HANG_GUARD_S), "hang guard: the late call never returned"
        return "on time"

    out = run_concurrently([slow, after], timeout_s=5.0, max_workers=1)  # call 1 needs ms of it
    assert [o.ok for o in out] == [False, True]
    assert out[0].error == "timed out after 5.0s" and out[0].value is None
    assert out[1].value == "on time"
