"""Evaluation task: every eval set -> pass@k, mean reward (+ accuracy) to the evals table, the
eval samples to the lake (kind 'eval'), the metrics to MLflow.

The default (one greedy sample per prompt of the built-in held-out set) gives the metric
``accuracy`` on dataset ``held_out``, which the CLI summary reads.
"""

from __future__ import annotations

import torch

from infra.faults import fault_point
from infra.runtime import HELD_OUT, Runtime
from rollout.evaluation import run_eval_set
from tasks.rollout import rollout_context
from tasks.step import step_task
from trainers.algorithms import pass_at_k_metrics


def eval_metrics(rewards: list[float], n: int) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... <= n (correct = reward 1), mean reward."""
    metrics = pass_at_k_metrics(torch.tensor(rewards, dtype=torch.float64), n)
    metrics["mean_reward"] = sum(rewards) / len(rewards)
    return metrics


def mlflow_key(dataset: str, metric: str) -> str:
    """``eval/{metric}`` for the held-out set, else ``eval/{dataset}/{metric}``; MLflow refuses
    '@', so ``pass@k`` is logged as ``pass_at_k`` (the evals table keeps ``pass@k``)."""
    metric = metric.replace("@", "_at_")
    return f"eval/{metric}" if dataset == HELD_OUT else f"eval/{dataset}/{metric}"


@step_task(name="evaluate")
def evaluate(rt: Runtime, iteration: int) -> dict[str, float]:
    """Evaluate the engine's current weights on every eval set; returns ``accuracy`` (held-out
    pass@1, or the first set's when there is no held-out set) and ``{dataset}/{metric}``."""
    version = rt.engine.weight_version
    rt.seed_evaluation(version)
    ctx = rollout_context(rt)
    ctx.generate_fn = rt.rollout.generate_fn
    rows, evals, logged = [], [], {}
    offset = 0
    for eval_set in rt.eval_sets:
        groups = run_eval_set(ctx, eval_set, rt.eval_fn)
        samples = [s for g in groups for s in g]
        for i, s in enumerate(samples):
            s.index = offset + i
        offset += len(samples)
        rows += [s.to_row(rt.run_id, version, rt.engine.name, "eval") for s in samples]
        metrics = eval_metrics([s.reward or 0.0 for s in samples], eval_set.n_samples)
        if eval_set.name == HELD_OUT:
            metrics["accuracy"] = metrics["pass@1"]
        for name, value in metrics.items():
            evals.append({"run_id": rt.run_id, "weight_version": version, "iteration": iteration,
                          "dataset": eval_set.name, "metric": name, "value": value, "n": len(samples)})
            logged[mlflow_key(eval_set.name, name)] = value
    rt.lake.append_trajectories(rows)
    rt.lake.append_evals(evals)
    fault_point("during_evaluation")
    rt.tracker.log_metrics(logged, step=iteration)
    first = rt.eval_sets[0].name
    accuracy = logged.get("eval/accuracy", logged.get(mlflow_key(first, "pass@1")))
    return {"accuracy": accuracy, "weight_version": version, **logged}
