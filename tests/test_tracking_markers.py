"""A weight version's ``checkpoint.json`` marker: written straight into the run's local artifact
folder (not through MLflow's temporary-folder copy), it is the artifact MLflow itself lists,
downloads and names as the model version's source; a run whose artifacts are not local goes
through MLflow's own ``log_text``. Real MLflow on a SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

from infra.tracking import Tracker

TAGS = {"iteration": 3, "checkpoint": None}


def _marker(tracker: Tracker, version: int) -> dict:
    path = tracker.client.download_artifacts(
        tracker.run_id, f"checkpoints/v{version:06d}/checkpoint.json", dst_path=None)
    return json.loads(Path(path).read_text())


def test_the_marker_is_an_mlflow_artifact_of_the_run(tmp_path, monkeypatch):
    tracker = Tracker(tmp_path)
    tracker.start("m", params={}, tags={"rlake.run_id": "m"})
    through_mlflow = []
    monkeypatch.setattr(tracker.client, "log_text", lambda *a, **k: through_mlflow.append(a))
    number = tracker.register_weight_version("m", 4, TAGS)
    expected = {"run": "m", "weight_version": "4", "iteration": "3", "checkpoint": ""}
    assert _marker(tracker, 4) == expected
    listed = [a.path for a in tracker.client.list_artifacts(tracker.run_id, "checkpoints/v000004")]
    assert listed == ["checkpoints/v000004/checkpoint.json"]  # no partial file left beside it
    mv = tracker.client.get_model_version(tracker.model_name("m"), number)
    assert mv.source == f"runs:/{tracker.run_id}/checkpoints/v000004"
    assert mv.tags == expected
    # written where MLflow keeps the run's artifacts, under the home
    on_disk = list(tmp_path.glob("mlflow/artifacts/*/artifacts/checkpoints/v000004/checkpoint.json"))
    assert len(on_disk) == 1, on_disk
    assert through_mlflow == []  # the local folder was written directly


def test_a_run_without_a_local_artifact_folder_logs_through_mlflow(tmp_path, monkeypatch):
    tracker = Tracker(tmp_path)
    tracker.start("n", params={}, tags={"rlake.run_id": "n"})
    tracker._artifact_dirs[tracker.run_id] = None  # as _local_path answers for an object store
    through_mlflow = []
    log_text = tracker.client.log_text
    monkeypatch.setattr(tracker.client, "log_text",
                        lambda *a, **k: (through_mlflow.append(a[2]), log_text(*a, **k)))
    tracker.register_weight_version("n", 1, TAGS)
    assert through_mlflow == ["checkpoints/v000001/checkpoint.json"]
    assert _marker(tracker, 1)["weight_version"] == "1"
