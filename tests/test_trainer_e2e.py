"""End-to-end: one non-default estimator through the real pipeline (the CLI, RL iterations as
Prefect flows, the lake, MLflow) improves held-out accuracy on the quickstart task, starting from
the session's shared SFT warm-up. The other estimators' measurements are in docs/algorithms.md
(bench/estimators.py)."""

from __future__ import annotations

import pytest

from buffer import Lake
from tests.learning import EVAL_INTERVAL, LATE_VERSIONS, assert_learned, paired_gain
from tests.learning import LEARN_ITERATIONS as ITERATIONS


@pytest.mark.slow
def test_reinforce_plus_plus_baseline_improves_held_out_accuracy(tmp_path, cli, warm_model):
    home = tmp_path / "home"
    args = ["run", "configs/quickstart.yaml"]
    for s in [f"home={home}", "run_id=e2e", f"num_rollout={ITERATIONS}", f"eval.eval_interval={EVAL_INTERVAL}",
              f"model.path={warm_model['checkpoint']}", "sft.enabled=false",
              "trainer.advantage_estimator=reinforce_plus_plus_baseline",
              "prefect_task_runs=false"]:  # learning is the subject (tests/test_task_runs.py)
        args += ["--set", s]
    cli(args, env={"PREFECT_HOME": str(home / "prefect")})
    lake = Lake(str(home / "lake"))
    evals = lake.read("evals", run_id="e2e").to_pylist()
    acc = {e["weight_version"]: e["value"] for e in evals if e["metric"] == "accuracy"}
    assert set(acc) == set(range(0, ITERATIONS + 1, EVAL_INTERVAL)), acc
    # decisive: the paired per-problem gain of the late versions (averaged) is >= 3 of its
    # standard errors (from the data); tests/learning.py says why not one version at 40
    assert_learned(lake, "e2e", 0, LATE_VERSIONS)
    one = paired_gain(lake, "e2e", 0, ITERATIONS)[0]
    assert one == pytest.approx(acc[ITERATIONS] - acc[0])  # the eval rows are the evals' data
    steps = lake.read("train_steps", run_id="e2e").to_pylist()
    assert len(steps) == ITERATIONS
    assert all(s["pg_loss"] is not None and s["grad_norm"] > 0 for s in steps)
