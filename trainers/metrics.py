"""Per-iteration metrics with slime's names: rollout statistics and staleness."""

from __future__ import annotations

import statistics

from rollout.sample import Sample, Status


def _mean(values: list[float]) -> float:
    """``fmean``, which raises OverflowError ("intermediate overflow in fsum") when the sum of
    finite values passes float64's largest (rewards of 1e308, which a lake written before
    rewards were bounded can hold): the run stopped there, naming nothing. The mean itself is
    finite, so it is taken as a sum of ``v / n`` instead."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        return sum(v / len(values) for v in values)


def _pstdev(values: list[float]) -> float:
    """``pstdev`` (exact arithmetic, so finite for finite values), inf if it ever overflows: a
    metric is not worth stopping a run for."""
    try:
        return statistics.pstdev(values)
    except OverflowError:
        return float("inf")


def rollout_metrics(samples: list[Sample], generate_seconds: float) -> dict[str, float]:
    """reward mean/std, response length, truncation rate, tokens/s of generation."""
    rewards = [s.reward or 0.0 for s in samples]
    lengths = [s.response_length for s in samples]
    tokens = sum(lengths)
    return {
        "rollout/reward_mean": _mean(rewards),
        "rollout/reward_std": _pstdev(rewards),
        "rollout/response_length_mean": statistics.fmean(lengths),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/failed_ratio": sum(s.status == Status.FAILED for s in samples) / len(samples),
        "rollout/tokens": float(tokens),
        "rollout/tokens_per_s": tokens / generate_seconds if generate_seconds > 0 else 0.0,
    }


def staleness(base_version: int, sample_versions: list[int]) -> dict[str, float]:
    """Version lag of the trained samples: base_version - weight_version(sample)."""
    lags = [base_version - v for v in sample_versions] or [0]
    return {"staleness/min": float(min(lags)), "staleness/mean": statistics.fmean(lags),
            "staleness/max": float(max(lags))}
