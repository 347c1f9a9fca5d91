"""Is a held-out accuracy gain beyond noise? Paired per problem, from the eval rows in the lake."""

from __future__ import annotations

import math
from collections.abc import Sequence

from buffer import Lake

# The learning tests' shape: the greedy accuracy of one weight version moves by +-0.04 from one
# version to the next (the policy, not the 500 problems), and the SFT warm-up lands at another
# accuracy on another CPU (0.588 on the Intel hosts, 0.632 on one AMD EPYC host, 0.382 on another
# with AVX2 and no AVX-512, 2026-11-25; the suite passed on the last two). Measured on
# AMD from 0.632: 40 iterations gained +0.006 (async), -0.008 (Ray, two engines) to +0.06
# (sync, reinforce++ baseline); one version at 100 iterations (Ray) +0.054, at 80 +0.092; the
# mean of 60, 80, 100 +0.069 (Ray, 3.4 SE), +0.104 (5.1), +0.113 (async, 5.8). So the tests run
# LEARN_ITERATIONS and compare the start with the mean of the versions in LATE_VERSIONS.
LEARN_ITERATIONS = 100
EVAL_INTERVAL = 10
LATE_VERSIONS = tuple(range(60, LEARN_ITERATIONS + 1, EVAL_INTERVAL))


def paired_gain(lake: Lake, run_id: str, before: int, after: int | Sequence[int]
                ) -> tuple[float, float, int]:
    """(gain, standard error, n) of greedy held-out accuracy from weight version ``before`` to
    ``after`` (one version, or several averaged), from the ``eval`` trajectories (one sample
    per held-out problem, ``row``):

        c_v(i) = 1 if version v answers problem i right, else 0
        d_i = mean_{v in after} c_v(i) - c_before(i)
        gain = mean(d),  se = sd(d) / sqrt(n)         (sd with n - 1)

    Pairing removes the between-problem variance, so se is what the data say (binomial-like
    for 0/1 outcomes), never a constant; averaging versions removes part of the version-to-
    version wobble of one greedy policy."""
    after = (after,) if isinstance(after, int) else tuple(after)
    rows = lake.read("trajectories", run_id=run_id, columns=["kind", "iteration", "row", "reward"]).to_pylist()
    by_version: dict[int, dict[int, float]] = {v: {} for v in (before, *after)}
    for r in rows:
        if r["kind"] == "eval" and r["iteration"] in by_version:
            assert r["row"] not in by_version[r["iteration"]], "two eval samples of one problem"
            by_version[r["iteration"]][r["row"]] = float(r["reward"] == 1.0)
    problems = by_version[before].keys()
    assert problems and all(by_version[v].keys() == problems for v in after), \
        {v: len(c) for v, c in by_version.items()}
    d = [sum(by_version[v][k] for v in after) / len(after) - by_version[before][k] for k in problems]
    n = len(d)
    gain = sum(d) / n
    var = sum((x - gain) ** 2 for x in d) / (n - 1)
    return gain, math.sqrt(var / n), n


def assert_learned(lake: Lake, run_id: str, before: int, after: int | Sequence[int],
                   z: float = 3.0) -> float:
    """The gain is positive and at least ``z`` standard errors; returns the gain."""
    gain, se, n = paired_gain(lake, run_id, before, after)
    assert gain > 0 and gain >= z * se, (f"held-out accuracy gain {gain:+.3f} over {n} problems is "
                                         f"{gain / se if se else 0:.1f} standard errors (se {se:.4f}); "
                                         f"need >= {z}")
    return gain
