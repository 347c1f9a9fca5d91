"""CLI fixes of 2026-11-29: output into a closed pipe, MAP columns in CSV, Rust backtraces in error
lines, `status --lake` without a home, and `--lake` on lineage and report. Each test runs the
command as a user does (``python -m infra.cli`` in a subprocess) on a real Delta lake."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from buffer import Lake
from buffer.synth import synthetic_rows
from infra.recovery import claim_run, release_run
from tests.conftest import REPO, run_cli

QUERY = "SELECT map(['a', 'b'], [1, 2]) AS m, {'k': [1, 2]} AS s, [[1], [2, 3]] AS l"


def rlake(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_cli(list(args), env=env, check=False, timeout=300)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home whose run "r" the lake says is running, its lake elsewhere (``home.parent/lake``)."""
    from infra.config import RunConfig

    home = tmp_path_factory.mktemp("leftovers") / "home"
    lake = Lake(str(home.parent / "lake"))
    lake.upsert_run({"run_id": "r", "status": "running", "config": RunConfig().model_dump_json()})
    lake.append_trajectories(synthetic_rows("r", 0, 8, weight_version=0))
    lake.append_train_step({"run_id": "r", "step": 0, "iteration": 0, "base_version": 0,
                            "weight_version": 1, "lake_version": 0, "n_samples": 8,
                            "sample_uids": [f"r/0/{k}" for k in range(8)], "ppo_kl": 0.01,
                            "entropy": 2.0, "timings": json.dumps({"train": 1.0})})
    (home / "runs" / "r").mkdir(parents=True)
    return home


@pytest.mark.parametrize("args", [
    ["status", "--home", "{home}", "--lake", "{lake}"],
    ["status", "r", "--home", "{home}", "--lake", "{lake}"],
    ["sql", "SELECT * FROM trajectories", "--lake", "{lake}"],
    ["sql", "SELECT * FROM trajectories", "--lake", "{lake}", "--format", "csv"],
    ["lake", "history", "--lake", "{lake}"],
    ["--help"],
])
def test_output_into_a_closed_pipe_stops_quietly(home, args):
    """`rlake status r | head -1` exited 1 (rich and typer end a command whose stdout pipe closed
    with a silent exit 1). Here the pipe's reader is gone before the command starts: its first
    write meets the closed pipe, whatever its size, as with a `head` that already exited."""
    args = [a.format(home=home, lake=home.parent / "lake") for a in args]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.close(write_end)
    assert (res.returncode, res.stderr) == (141, ""), args


def test_csv_writes_map_columns_as_json_text_as_the_json_format_shows_them(home):
    """A MAP column failed the CSV writer ("Unsupported Type:map<string, int32>"); LIST and
    STRUCT columns were already JSON text."""
    lake = str(home.parent / "lake")
    res = rlake("sql", QUERY, "--lake", lake, "--format", "csv")
    assert res.returncode == 0, res.stderr
    header, row = list(csv.reader(io.StringIO(res.stdout)))
    res = rlake("sql", QUERY, "--lake", lake, "--format", "json")
    shown = json.loads(res.stdout)
    assert header == ["m", "s", "l"]
    assert [json.loads(cell) for cell in row] == [shown[name] for name in header]
    assert shown["m"] == [["a", 1], ["b", 2]]


def test_a_rust_backtrace_stays_out_of_the_error_line(home, tmp_path):
    """With RUST_BACKTRACE=1, a deltalake error's text carries its backtrace: the one-line error
    became 15 lines of numbered frames. ``--debug`` still shows everything."""
    import shutil

    lake = tmp_path / "lake"
    shutil.copytree(home.parent / "lake", lake)
    (lake / "runs" / "_delta_log" / "00000000000000000000.json").write_text("garbage\n")
    env = {"RUST_BACKTRACE": "1"}
    for args in (["status", "--lake", str(lake)], ["sql", "SELECT * FROM runs", "--lake", str(lake)]):
        res = rlake(*args, env=env)
        assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("error: Kernel error: Json error: ") and " 0: " not in res.stderr
    res = rlake("--debug", "status", "--lake", str(lake), env=env)
    assert res.returncode == 1 and "Traceback" in res.stderr and " 0: " in res.stderr
    # the other form a Rust error's backtrace takes (anyhow's), kept out the same way
    from infra.lake_cli import without_backtrace

    assert without_backtrace("Generic error: no such table\n\nStack backtrace:\n   0: <unknown>\n"
                             "   1: start_thread") == "Generic error: no such table"


def test_status_with_only_the_lake_cannot_tell_running_from_interrupted(home):
    """`status --lake` without `--home` showed a killed run as "running": only the run folder's
    lock under the home tells, and there was no home to look in."""
    lake = str(home.parent / "lake")
    res = rlake("status", "r", "--home", str(home), "--lake", lake)
    assert "status: interrupted" in res.stdout, res.stdout  # no process holds the run's lock
    claim_run(home / "runs" / "r")  # this process owns the run: it is running
    try:
        res = rlake("status", "r", "--home", str(home), "--lake", lake)
        assert "status: running  " in res.stdout, res.stdout
    finally:
        release_run(home / "runs" / "r")
    for args in (["status", "r"], ["status"]):
        res = rlake(*args, "--lake", lake)
        assert res.returncode == 0, res.stderr
        assert "running or interrupted" in res.stdout and "no --home given" in res.stdout, res.stdout
    assert "status: running or interrupted  " in rlake("status", "r", "--lake", lake).stdout


def test_lineage_and_report_take_lake_and_still_the_old_lake_uri(home, tmp_path):
    """They took `--lake-uri` where every other command takes `--lake`."""
    lake = str(home.parent / "lake")
    for option in ("--lake", "--lake-uri"):
        res = rlake("lineage", "r", "--version", "1", "--home", str(home), option, lake, "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["version"] == 1
    res = rlake("report", "r", "--home", str(home), "--lake", lake, "--out", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r.html").exists()
    res = rlake("lineage", "r", "--version", "1", "--lake", lake, "--lake-uri", str(tmp_path))
    assert res.returncode == 2 and "give one" in res.stderr
    for command in ("lineage", "report"):
        shown = rlake(command, "--help").stdout
        assert "--lake " in shown and "--lake-uri" not in shown, shown


def test_the_printed_next_commands_name_a_lake_of_its_own(tmp_path, monkeypatch):
    """The end-of-run summary's status and report commands read HOME/lake unless told: a run with
    a lake elsewhere gets ``--lake`` on them; one in HOME/lake (given relative) does not."""
    from infra.progress import next_commands

    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared lake"
    elsewhere = next_commands({"run_id": "r1", "home": "h", "lake_uri": str(shared)})
    status, _sql, report = elsewhere[:3]
    assert status.endswith(f"--home {tmp_path / 'h'} --lake '{shared}'")
    assert f"--lake '{shared}' --out report.html" in report
    in_home = next_commands({"run_id": "r1", "home": "h", "lake_uri": "h/lake"})
    assert "--lake" not in in_home[0] and "--lake" not in in_home[2]
    assert f"--lake {tmp_path / 'h' / 'lake'}" in in_home[1]
    assert "WHERE run_id = 'r1' AND kind = 'train'" in in_home[1]  # this run's rows only
    assert shlex.split(in_home[1])[2].startswith("SELECT iteration")  # one argument to the shell
