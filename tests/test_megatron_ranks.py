"""``gather_answers``: how the Megatron launchers (spawned processes, Ray actors) collect one
answer per rank; the launchers themselves are exercised in test_megatron_ray.py."""

from __future__ import annotations

import time

import pytest

from trainers.megatron.ranks import RankDied, RankFailed, gather_answers


def scripted(events: list[tuple[float, int, object]]):
    """A ``receive`` giving ``(rank, answer)`` once ``at`` seconds have passed since the first
    call; a ``RankDied`` answer is raised (a dead rank found while waiting)."""
    start: list[float] = []
    waits: list[float] = []

    def receive(wait_s: float, answered: set[int]):
        start or start.append(time.monotonic())
        waits.append(wait_s)
        now = time.monotonic() - start[0]
        for i, (at, rank, answer) in enumerate(events):
            if at <= now + wait_s and rank not in answered:
                time.sleep(max(0.0, at - now))
                del events[i]
                if isinstance(answer, RankDied):
                    raise answer
                return rank, answer
        time.sleep(wait_s)
        return None

    receive.waits = waits
    return receive


def test_answers_come_back_in_rank_order():
    receive = scripted([(0.0, 2, ("ok", None)), (0.05, 0, ("ok", "result")), (0.1, 1, ("ok", None))])
    assert gather_answers(3, receive, timeout_s=5) == [("ok", "result"), ("ok", None), ("ok", None)]


def test_after_an_error_the_others_get_the_settle_time_then_count_as_silent():
    receive = scripted([(0.0, 1, ("err", "Traceback: boom")), (0.1, 0, ("ok", None))])
    answers = gather_answers(3, receive, timeout_s=60, settle_s=0.5)
    assert answers == [("ok", None), ("err", "Traceback: boom"), ("ok", None)]
    assert max(receive.waits[1:]) <= 0.5  # once the error came, never waited past the settle time


def test_a_death_found_while_settling_is_the_cause():
    receive = scripted([(0.0, 1, ("err", "gloo: connection reset")), (0.2, 0, RankDied(0, "exit -9"))])
    with pytest.raises(RankDied) as err:
        gather_answers(2, receive, timeout_s=60, settle_s=2)
    assert err.value.rank == 0


def test_silent_ranks_past_the_timeout_fail_the_call_by_name():
    receive = scripted([(0.0, 0, ("ok", None))])
    with pytest.raises(RankFailed, match=r"ranks \[1, 2\] gave no answer within 0.3s"):
        gather_answers(3, receive, timeout_s=0.3)
