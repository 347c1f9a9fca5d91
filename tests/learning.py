"""Is a held-out accuracy gain beyond noise? Paired per problem, from the eval rows in the lake."""

from __future__ import annotations

import math

from buffer import Lake


def paired_gain(lake: Lake, run_id: str, before: int, after: int) -> tuple[float, float, int]:
    """(gain, standard error, n) of greedy held-out accuracy between weight versions ``before``
    and ``after``, from the ``eval`` trajectories (one sample per held-out problem, ``row``):

        d_i = correct_after_i - correct_before_i      (correct: reward == 1)
        gain = mean(d),  se = sd(d) / sqrt(n)         (sd with n - 1)

    Pairing removes the between-problem variance, so se is what the data say (binomial-like
    for 0/1 outcomes), never a constant."""
    rows = lake.read("trajectories", run_id=run_id, columns=["kind", "iteration", "row", "reward"]).to_pylist()
    by_version: dict[int, dict[int, float]] = {before: {}, after: {}}
    for r in rows:
        if r["kind"] == "eval" and r["iteration"] in by_version:
            assert r["row"] not in by_version[r["iteration"]], "two eval samples of one problem"
            by_version[r["iteration"]][r["row"]] = float(r["reward"] == 1.0)
    assert by_version[before].keys() == by_version[after].keys() and by_version[before], by_version.keys()
    d = [by_version[after][k] - by_version[before][k] for k in by_version[before]]
    n = len(d)
    gain = sum(d) / n
    var = sum((x - gain) ** 2 for x in d) / (n - 1)
    return gain, math.sqrt(var / n), n


def assert_learned(lake: Lake, run_id: str, before: int, after: int, z: float = 3.0) -> float:
    """The gain is positive and at least ``z`` standard errors; returns the gain."""
    gain, se, n = paired_gain(lake, run_id, before, after)
    assert gain > 0 and gain >= z * se, (f"held-out accuracy gain {gain:+.3f} over {n} problems is "
                                         f"{gain / se if se else 0:.1f} standard errors (se {se:.4f}); "
                                         f"need >= {z}")
    return gain
