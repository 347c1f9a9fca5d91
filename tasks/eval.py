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
from rollout.sample import Sample, Status
from tasks.rollout import rollout_context
from tasks.step import step_task
from trainers.algorithms import pass_at_k_metrics


def eval_metrics(rewards: list[float], n: int) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... <= n (correct = reward 1), mean reward."""
    metrics = pass_at_k_metrics(torch.tensor(rewards, dtype=torch.float64), n)
    metrics["mean_reward"] = sum(rewards) / len(rewards)
    return metrics


def eval_set_metrics(samples: list[Sample], n: int) -> dict[str, float]:
    """``eval_metrics`` with a sample whose reward failed counted as reward 0, and
    ``failed_ratio`` = failed / samples. With every reward failed there is no score to give:
    ``failed_ratio`` 1.0 alone (a pass@1 of 0 read as "the model got every one wrong")."""
    failed = sum(s.status == Status.FAILED for s in samples) / len(samples)
    if failed == 1.0:
        return {"failed_ratio": 1.0}
    return {**eval_metrics([s.reward or 0.0 for s in samples], n), "failed_ratio": failed}


def first_failure(samples: list[Sample]) -> str:
    """The reason the first failed sample gives (its ``reward_detail``'s error)."""
    detail = next((s.reward_detail for s in samples if s.status == Status.FAILED), {})
    return str(detail.get("error", detail))[:200]


def failed_share(samples: list[Sample]) -> str:
    """How many samples' rewards failed, for the warning: "100%" when all did, else the count
    and a percentage with one decimal ("2/500 (0.4%)": ``:.0%`` read 2 of 500 as "0%")."""
    failed = sum(s.status == Status.FAILED for s in samples)
    if failed == len(samples):
        return "100%"
    return f"{failed}/{len(samples)} ({failed / len(samples):.1%})"


def mlflow_key(dataset: str, metric: str) -> str:
    """``eval/{metric}`` for the held-out set, else ``eval/{dataset}/{metric}``; MLflow refuses
    '@', so ``pass@k`` is logged as ``pass_at_k`` (the evals table keeps ``pass@k``)."""
    metric = metric.replace("@", "_at_")
    return f"eval/{metric}" if dataset == HELD_OUT else f"eval/{dataset}/{metric}"


@step_task(name="evaluate")
def evaluate(rt: Runtime, iteration: int) -> dict[str, float | None]:
    """Evaluate the engine's current weights on every eval set; returns ``accuracy`` (held-out
    pass@1, or the first set's when there is no held-out set) and ``{dataset}/{metric}``.
    With no eval set (``eval.datasets: []``) nothing is evaluated or written and ``accuracy``
    is None: a run on its own data may train without one, as TRL's and verl's do."""
    version = rt.engine.weight_version
    if not rt.eval_sets:
        return {"accuracy": None, "weight_version": version}
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
        metrics = eval_set_metrics(samples, eval_set.n_samples)
        shown = rt.__dict__.setdefault("eval_failures_shown", set())
        if metrics["failed_ratio"] == 1.0 or (metrics["failed_ratio"] > 0 and eval_set.name not in shown):
            shown.add(eval_set.name)  # some failed: once per set; all failed: every time
            scored = ("no score is recorded" if "pass@1" not in metrics else
                      "they count as reward 0 in its scores")
            rt.report("warning", {"message": f"eval after {iteration} iteration(s): the reward failed "
                                  f"for {failed_share(samples)} of eval set "
                                  f"'{eval_set.name}''s samples ({first_failure(samples)}); "
                                  f"{scored} (each error: trajectories.reward_detail)"})
        if eval_set.name == HELD_OUT and "pass@1" in metrics:
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
    # nan: the set's rewards all failed (a number still, for the progress line and MLflow)
    accuracy = logged.get("eval/accuracy", logged.get(mlflow_key(first, "pass@1"), float("nan")))
    return {"accuracy": accuracy, "weight_version": version, **logged}
