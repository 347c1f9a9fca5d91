"""A moved or copied home: MLflow stored absolute artifact paths (the experiment's location, each
run's artifact URI) under the old home, so a resume there wrote every new model version's
``checkpoint.json`` marker under the old path, re-creating it, or failed where it could not be
written. ``infra.tracking.relocate_artifacts`` points them at the home the tracker opens."""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

from mlflow.tracking import MlflowClient

from infra.tracker_process import TrackerProcess
from infra.tracking import EXPERIMENT, tracking_db, tracking_uri
from tests.opshelp import TINY, cli_env, rlake, tail

TAGS = {"iteration": 0, "lake_version": 1, "sample_count": 16, "checkpoint": None}


def _marker(home: Path, mlflow_run: str, version: int) -> Path:
    return (home / "mlflow" / "artifacts" / mlflow_run / "artifacts" / "checkpoints"
            / f"v{version:06d}" / "checkpoint.json")


def _locations(home: Path) -> list[str]:
    """The rlake experiment's artifact location and its runs' artifact URIs, as stored."""
    with closing(sqlite3.connect(tracking_db(home))) as conn:
        exp = conn.execute("SELECT experiment_id, artifact_location FROM experiments WHERE name = ?",
                           (EXPERIMENT,)).fetchone()
        runs = conn.execute("SELECT artifact_uri FROM runs WHERE experiment_id = ?", (exp[0],))
        return [exp[1], *(row[0] for row in runs)]


def _under(home: Path) -> bool:
    """Whether every stored location of the home's database is its own artifacts folder or in it."""
    root = (home / "mlflow" / "artifacts").as_uri()
    return all(loc == root or loc.startswith(root + "/") for loc in _locations(home))


def _session(home: Path, weight_version: int, mlflow_run: str | None = None) -> str:
    """Open the home's tracker as a run does, in its helper process (a process of its own, as
    every run and resume has: MLflow keeps a run's artifact repository per process), reopen
    ``mlflow_run`` (a resume), register ``weight_version``, close the run; returns the MLflow
    run id."""
    tracker = TrackerProcess(home)
    try:
        run = tracker.start("r", {"seed": "1"}, {"rlake.run_id": "r"}, mlflow_run_id=mlflow_run)
        tracker.register_weight_version("r", weight_version, {**TAGS, "iteration": weight_version})
        tracker.finish()
    finally:
        tracker.close()
    return run


def test_moved_and_copied_home_write_mlflow_artifacts_only_under_themselves(tmp_path):
    old, new, copy = tmp_path / "old", tmp_path / "new", tmp_path / "copy"
    run = _session(old, 0)
    shutil.move(old, new)
    # the old path can no longer be written (a folder of another user, a removed disk): before
    # the fix the marker's write there failed the registration
    old.write_text("not a folder")

    _session(new, 1, run)
    assert _marker(new, run, 1).is_file()
    assert old.is_file()
    assert _under(new)

    # versions registered before the move are read from the new home
    client = MlflowClient(tracking_uri=tracking_uri(new))
    first = client.get_model_version("rlake-r", "1")  # source runs:/RUN/checkpoints/v000000
    assert client.get_run(first.run_id).info.artifact_uri.startswith(
        (new / "mlflow" / "artifacts").as_uri() + "/")
    marker = client.download_artifacts(first.run_id, "checkpoints/v000000/checkpoint.json",
                                       str(tmp_path))
    assert json.loads(Path(marker).read_text())["weight_version"] == "0"
    assert {mv.tags["weight_version"] for mv in client.search_model_versions("name='rlake-r'")} \
        == {"0", "1"}

    # a copy, the original still in place: each writes under itself, the original untouched
    shutil.copytree(new, copy)
    before = _locations(new)
    _session(copy, 2, run)
    assert _marker(copy, run, 2).is_file()
    assert not _marker(new, run, 2).exists()
    assert _locations(new) == before
    assert _under(copy)


def test_resume_of_a_moved_home_writes_its_model_versions_there(tmp_path):
    """A real run killed at iteration 2, its home moved, resumed at the new path."""
    old, new = tmp_path / "h1", tmp_path / "h2"
    args = ["run", "--set", f"home={old}", "--set", "run_id=mv", "--set", "num_rollout=4",
            "--set", "eval.eval_interval=4", *TINY]
    proc = rlake(args, cli_env(None, RLAKE_FAULT="after_lake_append:2"), tmp_path / "run.log")
    assert proc.returncode == -9, tail(tmp_path / "run.log")
    shutil.move(old, new)

    proc = rlake(["resume", "mv", "--home", str(new)], cli_env(None), tmp_path / "resume.log")
    assert proc.returncode == 0, tail(tmp_path / "resume.log")
    assert not old.exists()  # nothing re-created the old home
    markers = sorted(p.parent.name for p in new.glob("mlflow/artifacts/*/artifacts/checkpoints/*/checkpoint.json"))
    assert markers == [f"v{v:06d}" for v in range(5)]
