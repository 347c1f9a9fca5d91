"""The run's MLflow tracker in a helper process, so that the run's own process never imports
MLflow.

Importing MLflow and opening its SQL store cost the run's main process ~2.6 s of CPU before its
first iteration (~1.3 s each, py-spy, 2026-11-25: docs/operations.md, Startup), on the path of
everything else it builds (torch, transformers, the model, Prefect's client). In a process of
its own that work runs on the other core, beside Prefect's server, while the model loads.

``TrackerProcess`` has ``infra.tracking.Tracker``'s methods. Those that answer (``start``,
``flush``, ``finish``, the registry and history reads) wait for the helper; the others
(``log_metrics``, ``set_tags``, ``register_weight_version_later``) are sent and not waited for:
the helper's ``Tracker`` queues them for its background sender, in order, as it did in-process.
An error in one of those is raised by the next ``flush`` (as before; so is one such call that
failed at once in the helper). The helper exits when the run's process closes the pipe or dies
(EOF), at once, without sending what is still queued: a kill -9 loses the same as before
(``flows.durability.recover`` re-does it from the lake).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from infra.tracking import tracking_uri

SERVE = "import sys; from infra.tracker_process import serve; serve(*sys.argv[1:])"


class TrackerProcess:
    """``infra.tracking.Tracker`` for the run's home, living in a helper process (started here,
    answering once MLflow is imported and its store open)."""

    def __init__(self, home: str | Path) -> None:
        home = Path(home).resolve()
        (home / "mlflow").mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(home)
        self.run_id: str | None = None
        self.log = home / "mlflow" / "tracker.log"
        to_helper, from_parent = os.pipe()[::-1]  # (write end, read end)
        to_parent, from_helper = os.pipe()[::-1]
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", SERVE, str(home), str(from_parent), str(to_parent)],
                pass_fds=(from_parent, to_parent), env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
                # a terminal's Ctrl-C is the run's to handle (it flushes and closes the MLflow
                # run); the helper ends when its pipe from the run closes
                process_group=0)
        os.close(from_parent)
        os.close(to_parent)
        self._requests = Connection(to_helper, readable=False)
        self._replies = Connection(from_helper, writable=False)
        self._lock = threading.Lock()  # one request and its answer at a time

    def _call(self, name: str, *args: Any, answer: bool = True, **kwargs: Any) -> Any:
        with self._lock:
            try:
                self._requests.send((name, args, kwargs, answer))
                if not answer:
                    return None
                ok, value = self._replies.recv()
            except (EOFError, OSError) as err:
                raise RuntimeError(f"the MLflow tracker process ended (exit code "
                                   f"{self._proc.poll()}); its log: {self.log}") from err
        if not ok:
            raise RuntimeError(f"MLflow: {value}")
        return value

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str],
              mlflow_run_id: str | None = None) -> str:
        """``Tracker.start``: create the MLflow run, or reopen ``mlflow_run_id``."""
        self.run_id = self._call("start", run_name, params, tags, mlflow_run_id)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call("log_metrics", metrics, step, answer=False)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("set_tags", tags, answer=False)

    def register_weight_version_later(self, rlake_run_id: str, weight_version: int,
                                      tags: dict[str, str | int | None]) -> None:
        self._call("register_weight_version_later", rlake_run_id, weight_version, tags,
                   answer=False)

    def flush(self) -> None:
        self._call("flush")

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self._call("finish", status)

    def registered_weight_versions(self, rlake_run_id: str) -> set[int]:
        return self._call("registered_weight_versions", rlake_run_id)

    def register_weight_version(self, rlake_run_id: str, weight_version: int,
                                tags: dict[str, str | int | None]) -> str:
        return self._call("register_weight_version", rlake_run_id, weight_version, tags)

    def logged_steps(self, key: str) -> set[int]:
        return self._call("logged_steps", key)

    def close(self) -> None:
        """End the helper (what is queued there and not flushed is dropped: flush first)."""
        for conn in (self._requests, self._replies):
            conn.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def serve(home: str, requests_fd: str, replies_fd: str) -> None:
    """The helper's loop: a ``Tracker`` for ``home``, its methods called in the order asked."""
    requests = Connection(int(requests_fd), writable=False)
    replies = Connection(int(replies_fd), readable=False)
    try:
        from infra.env import freeze_startup_heap
        from infra.tracking import Tracker

        tracker, broken = Tracker(home), None
        freeze_startup_heap(collect=False)
    except Exception as err:  # noqa: BLE001 - every request answers with it
        tracker, broken = None, f"the tracker could not start: {type(err).__name__}: {err}"
    failed = None  # the first error of a call nobody waited for: the next flush raises it
    while True:
        try:
            name, args, kwargs, answer = requests.recv()
        except (EOFError, OSError):
            os._exit(0)  # the run's process is gone or done: drop what is queued, as it would
        try:
            if tracker is None:
                raise RuntimeError(broken)
            value, ok = getattr(tracker, name)(*args, **kwargs), True
            if name == "flush" and failed is not None:
                value, ok, failed = failed, False, None
        except Exception as err:  # noqa: BLE001 - handed to the run's process
            value, ok = f"{type(err).__name__}: {err}", False
            if not answer:
                failed = failed or value
        if answer:
            replies.send((ok, value))
