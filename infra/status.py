"""``rlake status``: runs and their progress, read from the lake (never from memory)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from buffer import Lake
from infra.paths import place_options
from infra.recovery import run_owner

# a "running" run read from the lake alone (`--lake` without `--home`): only the run folder's lock
# under its home tells a live run from a killed one
UNKNOWN = "running or interrupted"
NO_HOME = ("no --home given: only the run's home tells whether a live process still owns it "
           "(rlake status --home HOME --lake LAKE)")
# the same uncertainty with a --home the run's folder is not under (another home's run, in a
# shared lake): it was shown "running", killed or not (review, 2026-11-29)
ELSEWHERE = ("its run folder is not under --home {home}: only the home it runs in tells whether a "
             "live process still owns it (rlake status --home HOME --lake LAKE)")


def unknown_hint(home: str | None) -> str:
    """Why a run is shown ``UNKNOWN``: no home given, or not the run's home."""
    return NO_HOME if home is None else ELSEWHERE.format(home=home)


def show_status(console: Console, lake_uri: str, run_id: str | None, home: str | None = None) -> None:
    """Runs (or one run) from the lake; with ``home``, a run marked running that no live process
    owns is shown as interrupted (a kill -9 leaves the lake saying "running"); without, or for a
    run whose folder is not under ``home``, as ``UNKNOWN``."""
    lake = Lake(lake_uri)
    if run_id is None:
        _list_runs(console, lake, home)
    else:
        _show_run(console, lake, run_id, home)


def shown_status(run: dict, home: str | None) -> str:
    """The run's status, "interrupted" for a "running" run whose owner process is gone, and
    ``UNKNOWN`` for a "running" run when no home tells: none given, or one without the run's
    folder (another home's run in a shared lake: only that home's lock knows)."""
    if run["status"] != "running":
        return run["status"]
    if home is None:
        return UNKNOWN
    run_dir = Path(home) / "runs" / run["run_id"]
    if not run_dir.exists():
        return UNKNOWN
    return "interrupted" if run_owner(run_dir) is None else run["status"]


def resume_hint(run_id: str, home: str, lake_uri: str) -> str:
    """``rlake resume RUN_ID --home HOME``, with ``--lake`` when the lake is not HOME/lake;
    shell-quoted (a home with a space)."""
    return shlex.join(["rlake", "resume", run_id, *place_options(home, lake_uri)])


def _list_runs(console: Console, lake: Lake, home: str | None) -> None:
    runs = lake.read("runs").to_pylist()
    if not runs:
        console.print(f"no runs in the lake at {lake.uri}")
        return
    steps = lake.read("train_steps", columns=["run_id", "iteration", "weight_version"]).to_pylist()
    # the id is what a user copies (status RUN_ID, resume RUN_ID): never cut to "20261129-1017…"
    # in 80 columns or a pipe (review, 2026-11-29); the other columns wrap instead
    table = Table(Column("run_id", no_wrap=True, min_width=max(len(r["run_id"]) for r in runs)),
                  "status", "iterations", "weight version", "updated", title="rlake runs")
    shown = {run["run_id"]: shown_status(run, home) for run in runs}
    for run in sorted(runs, key=lambda r: str(r.get("created_at"))):
        mine = [s for s in steps if s["run_id"] == run["run_id"]]
        table.add_row(run["run_id"], shown[run["run_id"]], str(len(mine)),
                      str(max((s["weight_version"] for s in mine), default=0)), str(run.get("updated_at")))
    console.print(table)
    if UNKNOWN in shown.values():
        console.print(f"{UNKNOWN}: {escape(unknown_hint(home))}", highlight=False, soft_wrap=True)


STEP_COLUMNS = ("step", "iteration", "base_version", "weight_version", "n_samples", "metrics",
                "timings", "pg_loss", "pg_clipfrac")


def _show_run(console: Console, lake: Lake, run_id: str, home: str | None) -> None:
    run = lake.get_run(run_id)
    if run is None:
        raise ValueError(f"no run '{run_id}' in the lake at {lake.uri}")
    # the columns shown, not the consumed sample_uids (most of a long run's train_steps bytes)
    steps = sorted(lake.read("train_steps", run_id=run_id, columns=list(STEP_COLUMNS)).to_pylist(),
                   key=lambda s: s["step"])
    evals = {e["weight_version"]: e["value"] for e in
             lake.read("evals", run_id=run_id, columns=["weight_version", "metric", "value"]).to_pylist()
             if e["metric"] == "accuracy"}
    status = shown_status(run, home)
    console.print(f"[bold]{run_id}[/]  status: {status}  MLflow run: {run.get('mlflow_run_id')}")
    if status == "interrupted":
        resume = resume_hint(run_id, str(home), lake.uri)
        # soft_wrap: one line, to be copied as it is
        console.print(f"  no live process owns it (killed?): {escape(resume)}", highlight=False,
                      soft_wrap=True)
    if status == UNKNOWN:
        console.print(f"  {escape(unknown_hint(home))}", highlight=False, soft_wrap=True)
    start = "after SFT"
    if run.get("replay_of"):
        asked = json.loads(run.get("notes") or "{}")
        rescored = f", rescored with {asked['rescore']}" if asked.get("rescore") else ""
        console.print(f"replay of {run['replay_of']} (iterations {asked.get('iterations') or 'all'}"
                      f"{rescored}): its recorded trajectories, no generation")
        start = "the replay's starting policy"
    if 0 in evals:
        console.print(f"held-out accuracy of weight version 0 ({start}): {evals[0]:.3f}")
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
