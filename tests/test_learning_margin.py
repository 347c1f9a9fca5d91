"""The learning tests' bar (tests/learning.py): a paired held-out gain, its standard error from
the eval rows themselves, and a failure when the gain is inside the noise."""

from __future__ import annotations

import math

import pytest

from buffer import Lake
from rollout.sample import Sample
from tests.learning import assert_learned, paired_gain


def _evals(lake: Lake, version: int, correct: set[int], n: int = 10) -> None:
    rows = [Sample(group_index=i, index=i, prompt=f"{i}+0=", prompt_token_ids=[5], row=i,
                   reward=1.0 if i in correct else 0.0).to_row("r", version, "torch", "eval")
            for i in range(n)]
    lake.append_trajectories(rows)


def test_paired_gain_and_its_standard_error(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    _evals(lake, 0, set(range(5)))
    _evals(lake, 4, set(range(8)))  # problems 5, 6, 7 newly right
    gain, se, n = paired_gain(lake, "r", 0, 4)
    # d = 0 x7, 1 x3: mean 0.3, sample variance (3 * 0.7^2 + 7 * 0.3^2) / 9
    assert (n, gain) == (10, pytest.approx(0.3))
    assert se == pytest.approx(math.sqrt((3 * 0.49 + 7 * 0.09) / 9 / 10))
    assert assert_learned(lake, "r", 0, 4, z=1.5) == pytest.approx(0.3)
    with pytest.raises(AssertionError, match="standard errors"):
        assert_learned(lake, "r", 0, 4)  # 0.3 is ~2 standard errors here: not decisive


def test_no_change_is_not_learning(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    _evals(lake, 0, {1, 2})
    _evals(lake, 1, {1, 2})
    assert paired_gain(lake, "r", 0, 1)[:2] == (0.0, 0.0)
    with pytest.raises(AssertionError, match="gain \\+0.000"):
        assert_learned(lake, "r", 0, 1)


def test_several_late_versions_are_averaged_per_problem(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    _evals(lake, 0, set(range(5)))
    _evals(lake, 4, set(range(8)))   # 5, 6, 7 newly right
    _evals(lake, 8, set(range(6)))   # only 5
    gain, se, n = paired_gain(lake, "r", 0, (4, 8))
    # d = 0 x5, 1 (problem 5), 0.5 x2 (6, 7), 0 x2: mean 0.2
    d = [0.0] * 5 + [1.0, 0.5, 0.5, 0.0, 0.0]
    assert (n, gain) == (10, pytest.approx(0.2))
    assert se == pytest.approx(math.sqrt(sum((x - 0.2) ** 2 for x in d) / 9 / 10))
    with pytest.raises(AssertionError):
        paired_gain(lake, "r", 0, (4, 12))  # a version never evaluated
