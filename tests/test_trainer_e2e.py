"""End-to-end: one non-default estimator through the real pipeline (the CLI: SFT warm-up, then
RL iterations as Prefect flows, the lake, MLflow) improves held-out accuracy on the quickstart
task. The other estimators' measurements are in docs/algorithms.md (bench/estimators.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from buffer import Lake

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 20


@pytest.mark.slow
def test_reinforce_plus_plus_baseline_improves_held_out_accuracy(tmp_path):
    home = tmp_path / "home"
    sets = [f"home={home}", "run_id=e2e", f"num_rollout={ITERATIONS}",
            f"eval.eval_interval={ITERATIONS}",
            "trainer.advantage_estimator=reinforce_plus_plus_baseline"]
    cmd = [sys.executable, "-m", "infra.cli", "run", str(ROOT / "configs" / "quickstart.yaml")]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = Lake(str(home / "lake")).read("evals", run_id="e2e").to_pylist()
    acc = {e["weight_version"]: e["value"] for e in evals if e["metric"] == "accuracy"}
    assert set(acc) == {0, ITERATIONS}, acc
    assert acc[ITERATIONS] > acc[0] + 0.01, acc
    steps = Lake(str(home / "lake")).read("train_steps", run_id="e2e").to_pylist()
    assert len(steps) == ITERATIONS
    assert all(s["pg_loss"] is not None and s["grad_norm"] > 0 for s in steps)
