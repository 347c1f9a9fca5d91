"""Stop a run that cannot learn instead of finishing it quietly."""

from __future__ import annotations

from infra.runtime import Runtime


def reward_name(rt: Runtime) -> str:
    """The reward the run scores with: a replay's ``--rescore`` one, else the configured one."""
    scorer = getattr(rt, "reward_fn", None)
    return (getattr(scorer, "custom_rm_path", None) or getattr(scorer, "rm_type", None)
            or rt.cfg.rollout.custom_rm_path or rt.cfg.rollout.rm_type)


def check_rewards(rt: Runtime, iteration: int, metrics: dict[str, float]) -> int:
    """After an iteration: warn when every reward of it failed, and raise once
    ``rollout.max_failed_reward_iterations`` such iterations came in a row (the run exits
    non-zero; ``rlake resume`` continues it once the reward is fixed); warn once per process
    when only some failed (they train as reward 0). Returns the streak."""
    ratio = metrics.get("rollout/failed_ratio", 0.0)
    if ratio < 1.0:
        rt.failed_reward_streak = 0
        if ratio > 0.0 and not getattr(rt, "partial_reward_failure_shown", False):
            rt.partial_reward_failure_shown = True
            rt.report("warning", {"message": f"iteration {iteration}: the reward failed for "
                                  f"{ratio:.0%} of the samples ({reward_name(rt)}); they train as "
                                  "reward 0. Each one's error is in the lake "
                                  "(trajectories.reward_detail), the count per iteration in "
                                  "train_steps' rollout/failed; shown once"})
        return 0
    streak = getattr(rt, "failed_reward_streak", 0) + 1
    rt.failed_reward_streak = streak
    limit = rt.cfg.rollout.max_failed_reward_iterations
    reward = reward_name(rt)
    rt.report("warning", {"message": f"iteration {iteration}: the reward failed for every sample "
                          f"({reward}); {streak} such iteration(s) in a row, the run stops at "
                          f"{limit} (rollout.max_failed_reward_iterations); the error of each "
                          "sample is in the lake (trajectories.reward_detail)"})
    if streak >= limit:
        raise RuntimeError(f"the reward failed for every sample in {streak} consecutive iterations "
                           f"(reward: {reward}; limit rollout.max_failed_reward_iterations={limit}): "
                           "fix the reward function, then `rlake resume` the run")
    return streak
