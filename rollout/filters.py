"""Dynamic sampling filters: ``fn(cfg, group: list[Sample]) -> bool`` (keep the group?)."""

from __future__ import annotations

import statistics

from rollout.sample import Sample

MIN_REWARD_STD = 1e-6


def check_reward_nonzero_std(cfg, group: list[Sample]) -> bool:
    """Keep a group whose rewards are not all equal: population std > 1e-6 (a GRPO group with
    equal rewards has zero advantages and teaches nothing)."""
    rewards = [0.0 if s.reward is None else float(s.reward) for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > MIN_REWARD_STD
