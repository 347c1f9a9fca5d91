"""MLflow tracking on a SQLite file under the state folder: runs, batched metrics, weight versions."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

EXPERIMENT = "rlake"


def tracking_uri(home: str | Path) -> str:
    return f"sqlite:///{(Path(home).resolve() / 'mlflow' / 'mlflow.db')}"


class Tracker:
    """One MLflow run per rlake run; a resumed run continues the same MLflow run."""

    def __init__(self, home: str | Path):
        root = Path(home).resolve() / "mlflow"
        root.mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(home)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
        self.run_id: str | None = None

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str],
              mlflow_run_id: str | None = None) -> str:
        """Create the run, or reopen ``mlflow_run_id`` (resume) and mark it running again."""
        if mlflow_run_id:
            self.run_id = mlflow_run_id
            self.client.update_run(mlflow_run_id, status="RUNNING")
            return mlflow_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One ``log_batch`` call for all metrics of a step (a call per metric costs 7-16 ms)."""
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status=status)

    # ---- lineage: weight versions in the model registry ----
    def model_name(self, rlake_run_id: str) -> str:
        """One registered model per rlake run; its versions are the run's weight versions."""
        return f"rlake-{rlake_run_id}"

    def registered_weight_versions(self, rlake_run_id: str) -> set[int]:
        """Weight versions of ``rlake_run_id`` already in the registry (tag ``weight_version``)."""
        found = self.client.search_model_versions(f"name='{self.model_name(rlake_run_id)}'")
        return {int(mv.tags["weight_version"]) for mv in found if "weight_version" in mv.tags}

    def register_weight_version(self, rlake_run_id: str, weight_version: int,
                                tags: dict[str, str | int | None]) -> str:
        """Register weight version ``v`` as a model version; returns the MLflow version number.

        The source is ``runs:/<mlflow run>/checkpoints/vNNNNNN`` (a server refuses a bare local
        path), where a small ``checkpoint.json`` marker artifact records the tags; the checkpoint
        folder itself is named in the ``checkpoint`` tag. Idempotent: an already registered
        version is returned, not registered twice (a resume re-registers what a crash missed).
        """
        import json

        name = self.model_name(rlake_run_id)
        tags = {k: "" if v is None else str(v) for k, v in
                {"run": rlake_run_id, "weight_version": weight_version, **tags}.items()}
        for mv in self.client.search_model_versions(f"name='{name}'"):
            if mv.tags.get("weight_version") == str(weight_version):
                return mv.version
        folder = f"checkpoints/v{weight_version:06d}"
        self.client.log_text(self.run_id, json.dumps(tags, indent=1), f"{folder}/checkpoint.json")
        if self.client.search_registered_models(f"name='{name}'") == []:
            self.client.create_registered_model(name, tags={"run": rlake_run_id})
        mv = self.client.create_model_version(name, f"runs:/{self.run_id}/{folder}",
                                              run_id=self.run_id, tags=tags)
        return mv.version

    def logged_steps(self, key: str) -> set[int]:
        """Steps at which ``key`` was logged in this run (to re-log what a crash lost)."""
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}
