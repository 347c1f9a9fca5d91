"""The run's MLflow tracker in a helper process (infra/tracker_process.py), against a real
MLflow SQLite store: what it writes is what the in-process ``Tracker`` reads back, errors come
back as errors, the run's process never imports MLflow, and the helper ends with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

PARENT = """
import sys
from infra.tracker_process import TrackerProcess
tracker = TrackerProcess(sys.argv[1])
run_id = tracker.start("p", params={"a": "1"}, tags={"rlake.run_id": "p"})
tracker.log_metrics({"x": 1.0}, 0)
tracker.flush()
print(tracker._proc.pid, "mlflow" in sys.modules, flush=True)
sys.stdin.read()  # killed here
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its dead parent's reaper) counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_the_helper_writes_what_mlflow_reads_back_and_raises_its_errors(tmp_path):
    from infra.tracker_process import TrackerProcess
    from infra.tracking import Tracker

    tracker = TrackerProcess(tmp_path)
    run_id = tracker.start("t", params={"a": "1"}, tags={"rlake.run_id": "t"})
    for step in range(20):
        tracker.log_metrics({"x": float(step), "none": None}, step)
    tracker.set_tags({"rlake.note": "hello"})
    tracker.register_weight_version_later("t", 0, {"iteration": "sft", "checkpoint": ""})
    tracker.flush()
    assert tracker.logged_steps("x") == set(range(20))
    assert tracker.registered_weight_versions("t") == {0}
    # one sent without waiting fails there: the next flush raises it, then the helper goes on
    tracker.log_metrics({"x": "not a number"}, 99)
    with pytest.raises(RuntimeError, match="MLflow: ValueError"):
        tracker.flush()
    tracker.log_metrics({"x": 20.0}, 20)
    tracker.finish("FINISHED")
    tracker.close()
    assert tracker._proc.returncode == 0

    reader = Tracker(tmp_path)
    run = reader.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlake.note"] == "hello"
    assert run.data.params == {"a": "1"}
    history = reader.client.get_metric_history(run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(21)]
    # resume: the same MLflow run is reopened through the helper too
    again = TrackerProcess(tmp_path)
    assert again.start("t", params={}, tags={"rlake.run_id": "t"}) == run_id
    # a call the helper cannot do comes back as MLflow's error
    with pytest.raises(RuntimeError, match="MLflow: MlflowException: .*0123"):
        again.start("t", params={}, tags={}, mlflow_run_id="0123" * 8)
    again.close()


def test_the_helper_ends_when_the_run_process_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        helper, imported = parent.stdout.readline().split()
        assert imported == "False", "the run's process imported MLflow"
        assert _alive(int(helper))
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while _alive(int(helper)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(int(helper)), "the helper outlived the run's process"
    finally:
        parent.kill()


def test_a_flushed_metric_survives_a_kill9_of_the_helper_without_fsync_per_commit(tmp_path):
    """The home's MLflow database runs with a write-ahead log and ``synchronous=NORMAL``
    (``infra.tracking.sqlite_commits_without_fsync``): what a flush returned for is in the
    database after the helper dies by kill -9, which a resume's ``recover`` then reads."""
    import sqlite3

    from infra.tracker_process import TrackerProcess
    from infra.tracking import tracking_db

    tracker = TrackerProcess(tmp_path)
    run_id = tracker.start("k", params={}, tags={"rlake.run_id": "k"})
    for step in range(5):
        tracker.log_metrics({"x": float(step)}, step)
    tracker.register_weight_version_later("k", 1, {"iteration": "0", "checkpoint": ""})
    tracker.flush()
    with sqlite3.connect(tracking_db(tmp_path)) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    os.kill(tracker._proc.pid, signal.SIGKILL)
    tracker._proc.wait(timeout=30)
    with sqlite3.connect(tracking_db(tmp_path)) as con:
        steps = {s for (s,) in con.execute(
            "SELECT step FROM metrics WHERE run_uuid = ? AND key = 'x'", (run_id,))}
        versions = con.execute("SELECT count(*) FROM model_versions").fetchone()[0]
    assert (steps, versions) == (set(range(5)), 1)
