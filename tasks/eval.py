"""Evaluation task: greedy accuracy on the held-out set, to the evals table, lake and MLflow."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.runtime import HELD_OUT, Runtime
from rewards.registry import score_samples
from rollout.rollout import generate_samples, make_samples


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(rt: Runtime, iteration: int) -> dict[str, float]:
    """Held-out accuracy of the engine's current weights (greedy when ``eval.greedy``)."""
    version = rt.engine.weight_version
    prompts = list(enumerate(rt.held_out))
    samples = make_samples(prompts, rt.tokenizer, 1, f"{rt.dataset.source}:{HELD_OUT}")
    generate_samples(rt.engine, rt.tokenizer, samples, rt.sampling(greedy=rt.cfg.eval.greedy))
    score_samples(samples, rt.reward_fn)
    accuracy = sum(s.reward == 1.0 for s in samples) / len(samples)
    rt.lake.append_trajectories([s.to_row(rt.run_id, version, rt.engine.name, "eval") for s in samples])
    rt.lake.append_evals([{"run_id": rt.run_id, "weight_version": version, "iteration": iteration,
                           "dataset": HELD_OUT, "metric": "accuracy", "value": accuracy,
                           "n": len(samples)}])
    rt.tracker.log_metrics({"eval/accuracy": accuracy}, step=iteration)
    return {"accuracy": accuracy, "weight_version": version}
