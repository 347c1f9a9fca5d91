"""MLflow tracking on a SQLite file under the state folder: runs, batched metrics, weight versions.

Off the critical path: ``log_metrics``, ``set_tags`` and ``defer``-ed calls go to one background
thread that sends what comes within a second (``LINGER_S``) as one round: its metrics in one
``log_batch``, then its calls in order. ``flush`` sends at once and waits for it; ``finish`` (every clean end, and every failure the pipeline catches) flushes first, so a
clean stop loses nothing. What a kill -9 loses is re-done from the lake on resume
(``flows.durability.recover``): metrics from the ``train_steps`` rows, model versions from the
checkpoints.
"""

from __future__ import annotations

import fcntl
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from infra import db_template
from infra.paths import write_text_atomic

if TYPE_CHECKING:  # imported where used: infra.tracker_process imports this module without them
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

EXPERIMENT = "rlake"
BATCH_LIMIT = 1000  # MLflow's log_batch takes at most 1000 metrics per call
RETRIES = 2  # as the log_metrics task had
FLUSH = "flush"  # a queue item: send what was gathered now
# how long the sender gathers metrics and calls into one round (``_Sender``): a second of
# iterations in one log_batch
LINGER_S = 1.0


def metric_count(item: tuple) -> int:
    """How many metrics a queued item carries."""
    return len(item[2]) if item[0] == "metrics" else 0


def tracking_uri(home: str | Path) -> str:
    return f"sqlite:///{tracking_db(home)}"


def tracking_db(home: str | Path) -> Path:
    return Path(home).resolve() / "mlflow" / "mlflow.db"


# the columns where MLflow's SQL store keeps an absolute path derived from the experiment's
# artifact location (``relocate_artifacts``): a run's, a logged model's and a model version's
ARTIFACT_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                    ("logged_models", "artifact_location"), ("model_versions", "source"),
                    ("model_versions", "storage_location"))


def relocate_artifacts(home: str | Path) -> str | None:
    """Point the rlake experiment of ``home``'s MLflow database, and what it recorded under it,
    at ``home``'s own ``mlflow/artifacts`` when the database names another home's (the home was
    moved or copied); returns the old location, or None when nothing changed.

    MLflow stores the experiment's artifact location, and each run's artifact URI, as absolute
    paths and has no API to change them: after ``mv OLD NEW`` a resume wrote every new model
    version's marker under OLD, re-creating it (or failed where OLD could not be written), and
    the moved versions' artifacts were looked up there. Rewritten here, in this home's database
    only, in one transaction, before an MLflow client opens it: only the values that are that
    location or start with it and ``/``; a location that is not a local path ending in
    ``mlflow/artifacts`` (not one rlake made) is left alone."""
    db = tracking_db(home)
    new_root = db.parent / "artifacts"
    if not db.exists():
        return None
    with closing(sqlite3.connect(db, timeout=60, isolation_level=None)) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "experiments" not in tables:
            return None
        found = conn.execute("SELECT artifact_location FROM experiments WHERE name = ?",
                             (EXPERIMENT,)).fetchone()
        old = found[0] if found else None
        old_root = _local_path(old)
        if old_root is None or old_root.parts[-2:] != ("mlflow", "artifacts") or old_root == new_root:
            return None
        new = new_root.as_uri() if old.startswith("file:") else str(new_root)
        conn.execute("BEGIN IMMEDIATE")  # one writer: the whole rewrite or none of it
        try:
            for table, column in ARTIFACT_COLUMNS:
                if table not in tables:
                    continue
                conn.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (new, old))
                # substr, not LIKE: a path may hold LIKE's wildcards (_ and %)
                conn.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                             f"WHERE substr({column}, 1, ?) = ?",
                             (new, len(old) + 1, len(old) + 1, old + "/"))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return old


def _local_path(location: str | None) -> Path | None:
    """The absolute local path of an artifact location (``file:`` URI or a plain path), else
    None (another scheme: an object store)."""
    if not location:
        return None
    parsed = urlparse(location)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        path = Path(unquote(parsed.path))
    elif not parsed.scheme:
        path = Path(location)
    else:
        return None
    return path if path.is_absolute() else None


def seed_tracking_db(db: Path) -> bool:
    """Give a fresh home's MLflow database a copy of an empty migrated one from rlake's cache
    (``infra.db_template``), built there once per MLflow version: MLflow's own migrations take
    ~2 s of every fresh home's start (measured 2026-11-24). MLflow then adds its Default
    experiment itself, with this home's paths. True when copied; ``RLAKE_MLFLOW_DB_TEMPLATE=0``
    turns it off."""
    if os.environ.get("RLAKE_MLFLOW_DB_TEMPLATE", "1") == "0" or db.exists():
        return False
    template = db_template.template_path("mlflow-db", ("mlflow-skinny", "alembic"))
    try:
        db_template.write_once(template, _migrated_db, wait=True)
    except Exception:  # noqa: BLE001 - MLflow builds the database itself, and says what fails
        return False
    return db_template.copy_in(template, db)


def _migrated_db(path: Path) -> None:
    """An empty MLflow tracking database at ``path``: its tables at the newest migration."""
    from mlflow.store.db.utils import _initialize_tables
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()


def sqlite_commits_without_fsync() -> None:
    """Every SQLite database MLflow opens in this process from now on: write-ahead log and
    ``synchronous=NORMAL`` (what Prefect's server does with its own), instead of SQLite's
    rollback journal with an fsync of it and of the database at every commit. A commit then
    survives a crash of the process (a kill -9) and may be lost only with the machine (power,
    kernel), never leaving the file corrupt; and what MLflow holds is re-done from the lake
    on resume anyway (``flows.durability.recover``). An iteration commits 4-5 times here (its
    metrics, its model version): that was 10-15 fsyncs an iteration, on the tracker's core.
    Only a home's tracking database (``tracking_db``), not the cache's template copied into
    new homes; one another process is writing at that moment keeps its mode."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    if not event.contains(Engine, "connect", _wal_on_connect):
        event.listen(Engine, "connect", _wal_on_connect)


def _wal_on_connect(dbapi_connection, _record) -> None:
    """SQLAlchemy's connect hook of ``sqlite_commits_without_fsync``."""
    if not isinstance(dbapi_connection, sqlite3.Connection):
        return
    cursor = dbapi_connection.cursor()
    try:
        files = [row[2] for row in cursor.execute("PRAGMA database_list") if row[1] == "main"]
        if not files or not files[0].endswith(str(Path("mlflow") / "mlflow.db")):
            return
        if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.OperationalError:  # locked by another process: its mode stays
        pass
    finally:
        cursor.close()


class _Sender:
    """One daemon thread running queued calls in order, gathering what is queued within
    ``linger_s`` of the first item into one round: all of its metrics in one ``log_batch`` per
    run (whole steps, up to MLflow's 1000 a call), then its calls, in order. MLflow's per-call
    work (the run's row, the latest-metrics update, the commit) was most of a step's
    ``log_batch``, once per iteration on the core the rollout side shares (2026-11-28). A
    ``flush`` sends at once. An error is kept and raised by the next ``flush``."""

    def __init__(self, client: MlflowClient, linger_s: float = 0.0) -> None:
        self.client = client
        self.linger_s = linger_s
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def submit(self, item: tuple) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="rlake-mlflow", daemon=True)
            self.thread.start()
        self.queue.put(item)

    def _loop(self) -> None:
        while True:
            pending = self._gather(self.queue.get())
            try:
                self._send_with_retries(pending)  # _send skips the FLUSH item
            finally:
                for _ in pending:
                    self.queue.task_done()

    def _gather(self, first: tuple) -> list[tuple]:
        """``first`` and what comes within ``linger_s`` of it, up to a flush or
        ``BATCH_LIMIT`` metrics."""
        pending, count = [first], metric_count(first)
        deadline = time.monotonic() + self.linger_s
        while pending[-1][0] != FLUSH and count < BATCH_LIMIT:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            pending.append(item)
            count += metric_count(item)
        return pending

    def _send_with_retries(self, pending: list[tuple]) -> None:
        for attempt in range(RETRIES + 1):  # SQLite may be busy (another run on this home)
            try:
                self._send(pending)
                return
            except Exception as err:  # noqa: BLE001 - kept, raised by flush
                if attempt == RETRIES:
                    self.error = self.error or err
                else:
                    time.sleep(1.0)

    def _send(self, items: list[tuple]) -> None:
        """The round's metrics first, then its calls in order (metrics and calls write
        different records: their order does not matter; a retry after a partial round may log
        a step's metrics twice, as before, and calls are idempotent or tags)."""
        self._send_metrics([(run_id, payload) for kind, run_id, payload in items
                            if kind == "metrics"])
        for kind, _, payload in items:
            if kind == "call":
                payload()

    def _send_metrics(self, batches: list[tuple[str, list[Metric]]]) -> None:
        """One ``log_batch`` per run and up to ``BATCH_LIMIT`` metrics, each step's metrics in
        one call: a crash between two calls leaves a step all logged or not at all, which is
        what the resume's re-logging looks for (``weight_version`` at that step)."""
        calls: list[tuple[str, list[Metric]]] = []
        for run_id, batch in batches:
            if calls and calls[-1][0] == run_id and len(calls[-1][1]) + len(batch) <= BATCH_LIMIT:
                calls[-1][1].extend(batch)
            else:
                calls.append((run_id, list(batch)))
        for run_id, batch in calls:
            for i in range(0, len(batch), BATCH_LIMIT):  # a step of over 1000 metrics
                self.client.log_batch(run_id, metrics=batch[i:i + BATCH_LIMIT])

    def flush(self) -> None:
        self.submit((FLUSH, None, None))  # ends the round being gathered
        self.queue.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"MLflow logging failed: {err}") from err


class Tracker:
    """One MLflow run per rlake run; a resumed run continues the same MLflow run."""

    def __init__(self, home: str | Path):
        from mlflow.tracking import MlflowClient

        root = Path(home).resolve() / "mlflow"
        root.mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(home)
        # MLflow creates its database (and the experiment) on first use: two first runs on a
        # fresh home must not both do it (`table ... already exists`)
        with open(root / ".create.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            seed_tracking_db(tracking_db(home))
            # a moved or copied home: MLflow's absolute paths still name the old one
            relocate_artifacts(home)
            sqlite_commits_without_fsync()
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
                EXPERIMENT, artifact_location=(root / "artifacts").as_uri())
        self.run_id: str | None = None
        self._registered: dict[str, dict[int, str]] = {}  # model name -> its weight versions
        self._artifact_dirs: dict[str, Path | None] = {}  # MLflow run -> its local artifact folder
        self._sender = _Sender(self.client, LINGER_S)

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str],
              mlflow_run_id: str | None = None) -> str:
        """Create the run, or reopen ``mlflow_run_id`` (resume) and mark it running again. A run
        already tagged with ``tags`` (a process killed before it recorded the MLflow run's id)
        is reopened, not duplicated."""
        mlflow_run_id = mlflow_run_id or self._find_run(tags)
        if mlflow_run_id:
            self.run_id = mlflow_run_id
            self.client.update_run(mlflow_run_id, status="RUNNING")
            return mlflow_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        return self.run_id

    def _find_run(self, tags: dict[str, str]) -> str | None:
        if not tags:
            return None
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        found = self.client.search_runs([self.experiment_id], query, max_results=1)
        return found[0].info.run_id if found else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue all metrics of a step for one ``log_batch`` (a call per metric costs 7-16 ms;
        a batch 5-60 ms, now off the caller's path)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if batch:
            self._sender.submit(("metrics", self.run_id, batch))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        run_id = self.run_id
        self.defer(lambda: self.client.log_batch(run_id, tags=items))

    def defer(self, call: Callable[[], object]) -> None:
        """Run ``call`` on the background thread, after everything queued before it."""
        self._sender.submit(("call", self.run_id, call))

    def register_weight_version_later(self, rlake_run_id: str, weight_version: int,
                                      tags: dict[str, str | int | None]) -> None:
        """``register_weight_version`` on the background thread, after everything queued."""
        self.defer(lambda: self.register_weight_version(rlake_run_id, weight_version, tags))

    def flush(self) -> None:
        """Wait until everything queued is in MLflow; raises if a queued call failed."""
        self._sender.flush()

    def finish(self, status: str = "FINISHED") -> None:
        """Flush, then end the run with ``status``. On a failure path the run is closed even if
        the flush fails (the original error is what matters there)."""
        if not self.run_id:
            return
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status=status)

    # ---- lineage: weight versions in the model registry ----
    def model_name(self, rlake_run_id: str) -> str:
        """One registered model per rlake run; its versions are the run's weight versions."""
        return f"rlake-{rlake_run_id}"

    def registered_weight_versions(self, rlake_run_id: str) -> set[int]:
        """Weight versions of ``rlake_run_id`` already in the registry (tag ``weight_version``)."""
        self.flush()
        found = self._search_model_versions(self.model_name(rlake_run_id))
        return {int(mv.tags["weight_version"]) for mv in found if "weight_version" in mv.tags}

    def _search_model_versions(self, name: str, page_size: int | None = None) -> list:
        """Every model version of ``name``, page by page: one search returns at most 10,000, and
        a run past 10,000 weight versions then found its oldest unregistered and registered
        them again at each resume (review, 2026-11-29)."""
        kwargs = {} if page_size is None else {"max_results": page_size}
        found, token = [], None
        while True:
            page = self.client.search_model_versions(f"name='{name}'", page_token=token, **kwargs)
            found.extend(page)
            token = page.token
            if not token:
                return found

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
        registered = self._model_versions(name)
        if weight_version in registered:
            return registered[weight_version]
        folder = f"checkpoints/v{weight_version:06d}"
        self._log_text(json.dumps(tags, indent=1), f"{folder}/checkpoint.json")
        if not registered and self.client.search_registered_models(f"name='{name}'") == []:
            self.client.create_registered_model(name, tags={"run": rlake_run_id})
        mv = self.client.create_model_version(name, f"runs:/{self.run_id}/{folder}",
                                              run_id=self.run_id, tags=tags)
        registered[weight_version] = mv.version
        return mv.version

    def _log_text(self, text: str, artifact_file: str) -> None:
        """``MlflowClient.log_text`` for this run: written straight into the run's artifact
        folder when it is local (every rlake home's is), else through MLflow. MLflow's own
        writes the text to a temporary folder, copies it in and removes the folder: about a
        quarter of the tracker's CPU when it ran once per weight version (py-spy, async mode,
        2026-12-01), on the core the rollout side and Prefect's server share."""
        if self.run_id not in self._artifact_dirs:
            self._artifact_dirs[self.run_id] = _local_path(
                self.client.get_run(self.run_id).info.artifact_uri)
        root = self._artifact_dirs[self.run_id]
        if root is None:
            self.client.log_text(self.run_id, text, artifact_file)
            return
        write_text_atomic(root / artifact_file, text)  # whole or absent, as MLflow's copy-in is not

    def _model_versions(self, name: str) -> dict[int, str]:
        """Weight version -> MLflow version of model ``name``: searched once per process, then
        kept up to date by ``register_weight_version`` (one process writes a run's versions;
        the search grew with every version and cost more than the registration itself)."""
        if name not in self._registered:
            found = self._search_model_versions(name)
            self._registered[name] = {int(mv.tags["weight_version"]): mv.version
                                      for mv in found if "weight_version" in mv.tags}
        return self._registered[name]

    def logged_steps(self, key: str) -> set[int]:
        """Steps at which ``key`` was logged in this run (to re-log what a crash lost)."""
        self.flush()
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}
