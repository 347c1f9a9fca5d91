"""Stop a run that cannot learn instead of finishing it quietly."""

from __future__ import annotations

from infra.runtime import Runtime


def check_rewards(rt: Runtime, iteration: int, metrics: dict[str, float]) -> int:
    """After an iteration: warn when every reward of it failed, and raise once
    ``rollout.max_failed_reward_iterations`` such iterations came in a row (the run exits
    non-zero; ``rlake resume`` continues it once the reward is fixed). Returns the streak."""
    if metrics.get("rollout/failed_ratio", 0.0) < 1.0:
        rt.failed_reward_streak = 0
        return 0
    streak = getattr(rt, "failed_reward_streak", 0) + 1
    rt.failed_reward_streak = streak
    limit = rt.cfg.rollout.max_failed_reward_iterations
    reward = rt.cfg.rollout.custom_rm_path or rt.cfg.rollout.rm_type
    rt.report("warning", {"message": f"iteration {iteration}: the reward failed for every sample "
                          f"({reward}); {streak} such iteration(s) in a row, the run stops at "
                          f"{limit} (rollout.max_failed_reward_iterations); the error of each "
                          "sample is in the lake (trajectories.reward_detail)"})
    if streak >= limit:
        raise RuntimeError(f"the reward failed for every sample in {streak} consecutive iterations "
                           f"(reward: {reward}; limit rollout.max_failed_reward_iterations={limit}): "
                           "fix the reward function, then `rlake resume` the run")
    return streak
