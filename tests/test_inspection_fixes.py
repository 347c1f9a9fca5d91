"""Fixes from the 2026-11-29 inspection: `rlake ui` stopped by SIGTERM, `rlake sql` output of
INTERVAL/DECIMAL/BLOB values and of a vacuumed version, `rlake status` in a shared lake and its
resume hint, `rlake report`'s status and image links. Real lakes, DuckDB and subprocesses."""

from __future__ import annotations

import csv
import html.parser
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from buffer import Lake
from buffer.maintenance import compact, vacuum
from buffer.output import render
from buffer.sql import sql
from buffer.synth import synthetic_rows
from infra.ports import free_port
from infra.status import UNKNOWN, show_status
from infra.ui_cli import answers
from tests.conftest import REPO, run_cli
from tests.test_cli_entry import _alive, _children, _wait_for_line

RUN = "20261129-101716-b51b89"


def _running_run(lake: Lake, run_id: str = RUN, steps: int = 0) -> None:
    """``run_id`` as a killed run leaves the lake: status "running", with ``steps`` iterations."""
    lake.upsert_run({"run_id": run_id, "status": "running"})
    for i in range(steps):
        lake.append_trajectories(synthetic_rows(run_id, i, 4, weight_version=i))
        lake.append_train_step({"run_id": run_id, "step": i, "iteration": i, "base_version": i,
                                "weight_version": i + 1, "lake_version": i, "n_samples": 4,
                                "sample_uids": [f"{run_id}/{i}/{k}" for k in range(4)],
                                "ppo_kl": 0.01, "entropy": 2.0, "timings": json.dumps({"train": 1.0})})


def _killed_in(home: Path, run_id: str = RUN) -> None:
    """The run folder a killed run leaves under its home: no live owner holds its lock."""
    (home / "runs" / run_id).mkdir(parents=True)


def _status_text(lake: Lake, run_id: str | None, home: Path | None) -> str:
    out = io.StringIO()
    show_status(Console(file=out, width=80), lake.uri, run_id, None if home is None else str(home))
    return out.getvalue()


# ---- 1. rlake ui: SIGTERM ----------------------------------------------------------------------

def test_ui_stops_its_server_on_sigterm(tmp_path):
    """A SIGTERM ended `rlake ui` at once and left its server (in its own session) answering."""
    from infra.tracking import Tracker

    home = tmp_path / "home"
    Tracker(home)  # the MLflow store a run leaves
    port = free_port()
    log = tmp_path / "ui.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "ui", "mlflow", "--home", str(home),
                                 "--port", str(port)], cwd=REPO, env=env, stdout=out, stderr=out)
    everything = [proc.pid]
    try:
        _wait_for_line(proc, log, f"mlflow UI: http://127.0.0.1:{port}", 300)
        everything += _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in everything if _alive(p)], "UI processes left behind"
        assert not answers(f"http://127.0.0.1:{port}/health"), "the UI server still answers"
    finally:
        for pid in everything:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- 2. rlake sql: INTERVAL, DECIMAL, BLOB -----------------------------------------------------

INTERVALS = ["INTERVAL '69.75671 seconds'", "INTERVAL '1 month 2 days 03:04:05'",
             "INTERVAL '-13 months'", "INTERVAL '1 day -1 second'", "INTERVAL '100 hours 5 minutes'",
             "INTERVAL '0 seconds'", "INTERVAL '-1.5 seconds'", "INTERVAL '1 microsecond'"]


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    lake.append_trajectories(synthetic_rows("r", 0, 3))
    return lake


def test_sql_intervals_print_as_duckdb_prints_them_in_every_format(lake, tmp_path):
    """csv and parquet failed ("Unsupported cast from month_day_nano_interval to utf8"), the
    table showed ``MonthDayNano(...)`` and JSON ``[0, 0, n]``."""
    columns = ", ".join(f"{x} AS i{k}" for k, x in enumerate(INTERVALS))
    expected = list(duckdb.sql(f"SELECT {', '.join(f'({x})::VARCHAR' for x in INTERVALS)}").fetchall()[0])
    assert expected[0] == "00:01:09.75671"
    t = sql(lake, f"SELECT {columns}, NULL::INTERVAL AS none FROM trajectories LIMIT 1")
    names = [f"i{k}" for k in range(len(INTERVALS))]
    row = next(csv.DictReader(io.StringIO(render(t, "csv"))))
    assert [row[n] for n in names] == expected and row["none"] == ""
    row = json.loads(render(t, "json"))
    assert [row[n] for n in names] == expected and row["none"] is None
    line = render(t, "table").splitlines()[2]
    assert [c.strip() for c in line.split(" | ")] == [*expected, "NULL"]
    render(t, "parquet", tmp_path / "out.parquet")
    back = pq.read_table(tmp_path / "out.parquet")
    assert str(back.schema.field("i0").type) == "string"
    assert [back.column(n)[0].as_py() for n in names] == expected


def test_sql_cli_csv_of_a_duration(lake):
    """The reviewer's query: a run's duration, as `rlake sql --format csv` writes it."""
    time.sleep(0.05)
    lake.append_trajectories(synthetic_rows("r", 1, 3))  # a later created_at: a duration > 0
    query = ("SELECT run_id, max(created_at) - min(created_at) AS duration FROM trajectories "
             "GROUP BY 1")
    res = run_cli(["sql", query, "--lake", lake.uri, "--format", "csv"], check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    want = duckdb.sql("SELECT (max(t) - min(t))::VARCHAR FROM (SELECT unnest(?) AS t)",
                      params=[lake.read("trajectories").column("created_at").to_pylist()]).fetchall()[0][0]
    assert want.startswith("00:00:") and want != "00:00:00"
    assert list(csv.reader(io.StringIO(res.stdout))) == [["run_id", "duration"], ["r", want]]


def test_sql_decimal_is_a_json_number_and_a_blob_is_hex(lake):
    t = sql(lake, "SELECT 1.50::DECIMAL(5,2) AS price, sum(iteration + 2) AS total, "
                  "'ab\\x01'::BLOB AS raw, [1.25::DECIMAL(4,2)] AS prices FROM trajectories")
    assert json.loads(render(t, "json")) == {"price": 1.5, "total": 6, "raw": "616201", "prices": [1.25]}
    assert '"total": 6,' in render(t, "json")  # an integer, not 6.0 (sum gives a DECIMAL(38,0))
    row = next(csv.DictReader(io.StringIO(render(t, "csv"))))
    assert (row["price"], row["raw"]) == ("1.50", "616201")
    assert "616201" in render(t, "table") and "b'" not in render(t, "table")


# ---- 3, 4. rlake status: a shared lake ----------------------------------------------------------

def test_status_resume_hint_names_a_lake_outside_the_home(tmp_path):
    """The hint left out --lake: the printed command looked for the run in HOME/lake."""
    home = tmp_path / "home"
    lake = Lake(str(tmp_path / "shared lake"))
    _running_run(lake)
    _killed_in(home)
    text = _status_text(lake, RUN, home)
    hint = next(x for x in text.splitlines() if "no live process owns it" in x)
    assert shlex.split(hint.split("(killed?): ")[1]) == [
        "rlake", "resume", RUN, "--home", str(home), "--lake", lake.uri]


def test_status_of_another_homes_run_in_a_shared_lake_is_uncertain(tmp_path):
    """Its run folder is under another home: this one cannot tell running from killed (it said
    "running")."""
    lake = Lake(str(tmp_path / "shared"))
    _running_run(lake)
    _killed_in(tmp_path / "theirs")
    mine = tmp_path / "mine"
    mine.mkdir()
    for run_id in (None, RUN):
        text = _status_text(lake, run_id, mine)
        assert UNKNOWN in text, text
        assert f"not under --home {mine}" in " ".join(text.split()), text
    assert "interrupted" in _status_text(lake, RUN, tmp_path / "theirs")


# ---- 5, 6. rlake report ---------------------------------------------------------------------------

class _Images(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def test_report_of_a_killed_run_says_interrupted(tmp_path):
    """`rlake report` printed the lake's raw "running" where `rlake status` says interrupted."""
    home = tmp_path / "home"
    _running_run(Lake(str(home / "lake")), steps=2)
    _killed_in(home)
    out = tmp_path / "report.html"
    res = run_cli(["report", RUN, "--home", str(home), "--out", str(out)], check=False, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "<li>status: interrupted</li>" in out.read_text()


def test_report_images_load_whatever_the_out_name(tmp_path):
    """``<img src>`` held the PNG's name as it is: ``#``, ``%``, ``?`` and ``"`` broke it."""
    from infra.report import write_report

    lake = Lake(str(tmp_path / "lake"))
    _running_run(lake, steps=2)
    out = tmp_path / 'run #1 100% "a?b".html'
    written = write_report(lake, RUN, out)
    parser = _Images()
    parser.feed(out.read_text())
    assert len(parser.srcs) == len(written) - 1 > 0
    for src in parser.srcs:
        resolved = urllib.parse.urljoin(out.as_uri(), src)  # as a browser resolves it
        assert Path(urllib.parse.unquote(urllib.parse.urlparse(resolved).path)).is_file(), src


# ---- 7. rlake sql --as-of a vacuumed version ------------------------------------------------------

def test_sql_as_of_a_vacuumed_version_says_so(lake):
    """A raw DuckDB "IOError: Failed to open local file" where Lake.read says vacuum removed it."""
    old = lake.table_version("trajectories")
    lake.append_trajectories(synthetic_rows("r", 1, 3))
    compact(lake)
    vacuum(lake, retention_hours=0)
    with pytest.raises(ValueError, match="trajectories as of") as err:
        sql(lake, "SELECT count(*) FROM trajectories", as_of=old)
    assert "its files were removed by vacuum" in str(err.value) and "\n" not in str(err.value)
    assert sql(lake, "SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [6]
    res = run_cli(["sql", "SELECT count(*) FROM trajectories", "--lake", lake.uri, "--as-of", str(old)],
                  check=False, timeout=300)
    assert res.returncode != 0 and "its files were removed by vacuum" in res.stderr, res.stderr
    assert "IOError" not in res.stderr
