"""``rlake status``: runs and their progress, read from the lake (never from memory)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from buffer import Lake


def show_status(console: Console, lake_uri: str, run_id: str | None) -> None:
    lake = Lake(lake_uri)
    if run_id is None:
        _list_runs(console, lake)
    else:
        _show_run(console, lake, run_id)


def _list_runs(console: Console, lake: Lake) -> None:
    runs = lake.read("runs").to_pylist()
    if not runs:
        console.print(f"no runs in the lake at {lake.uri}")
        return
    steps = lake.read("train_steps", columns=["run_id", "iteration", "weight_version"]).to_pylist()
    table = Table("run_id", "status", "iterations", "weight version", "updated", title="rlake runs")
    for run in sorted(runs, key=lambda r: str(r.get("created_at"))):
        mine = [s for s in steps if s["run_id"] == run["run_id"]]
        table.add_row(run["run_id"], run["status"], str(len(mine)),
                      str(max((s["weight_version"] for s in mine), default=0)), str(run.get("updated_at")))
    console.print(table)


def _show_run(console: Console, lake: Lake, run_id: str) -> None:
    run = lake.get_run(run_id)
    if run is None:
        raise ValueError(f"no run '{run_id}' in the lake at {lake.uri}")
    steps = sorted(lake.read("train_steps", run_id=run_id).to_pylist(), key=lambda s: s["step"])
    evals = {e["weight_version"]: e["value"] for e in lake.read("evals", run_id=run_id).to_pylist()
             if e["metric"] == "accuracy"}
    console.print(f"[bold]{run_id}[/]  status: {run['status']}  MLflow run: {run.get('mlflow_run_id')}")
    if 0 in evals:
        console.print(f"held-out accuracy of weight version 0 (after SFT): {evals[0]:.3f}")
    table = Table("iteration", "version", "samples", "reward", "pg_loss", "clipfrac", "s/it", "eval acc")
    for s in steps:
        metrics = json.loads(s.get("metrics") or "{}")
        timings = json.loads(s.get("timings") or "{}")
        acc = evals.get(s["weight_version"])
        table.add_row(str(s["iteration"]), f"{s['base_version']}->{s['weight_version']}",
                      str(s["n_samples"]), f"{metrics.get('rollout/reward_mean', float('nan')):.3f}",
                      _fmt(s.get("pg_loss")), _fmt(s.get("pg_clipfrac")),
                      _fmt(sum(timings.values()) if timings else None, 2),
                      "" if acc is None else f"{acc:.3f}")
    console.print(table)


def _fmt(value, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"
