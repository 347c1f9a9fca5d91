"""SQL over the lake: results, time travel, the sandbox, and the `rlake sql` / `rlake lake` CLI."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest

from buffer import Lake
from buffer.sql import SqlRefused, sql
from buffer.synth import synthetic_rows
from tests.conftest import run_cli


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    lake.append_trajectories(synthetic_rows("r", 0, 10))
    lake.append_trajectories(synthetic_rows("r", 1, 6))
    lake.upsert_run({"run_id": "r", "status": "running"})
    return lake


def test_sql_returns_arrow_with_pushed_down_filters(lake):
    t = sql(lake, "SELECT iteration, count(*) AS n FROM trajectories WHERE iteration >= 0 "
                  "GROUP BY iteration ORDER BY iteration")
    assert t.to_pylist() == [{"iteration": 0, "n": 10}, {"iteration": 1, "n": 6}]
    joined = lake.sql("SELECT r.status, count(*) AS n FROM trajectories t JOIN runs r USING (run_id) "
                      "GROUP BY 1")
    assert joined.to_pylist() == [{"status": "running", "n": 16}]
    assert sql(lake, "SELECT count(*) AS n FROM evals").column("n").to_pylist() == [0]


def test_the_catalog_lists_every_lake_table(lake):
    """``SHOW TABLES`` and the catalog's views name no lake table: they answered nothing, as if
    the lake were empty; the tables are there to list, with their columns."""
    from buffer.schema import TABLES

    assert sorted(sql(lake, "SHOW TABLES").column("name").to_pylist()) == sorted(TABLES)
    listed = sql(lake, "SELECT table_name FROM information_schema.tables ORDER BY 1")
    assert listed.column("table_name").to_pylist() == sorted(TABLES)
    columns = sql(lake, "SELECT column_name FROM information_schema.columns "
                        "WHERE table_name = 'runs'").column("column_name").to_pylist()
    assert {"run_id", "status", "config"} <= set(columns)
    assert sql(lake, "SELECT count(*) AS n FROM duckdb_views() WHERE NOT internal"
               ).column("n").to_pylist() == [len(TABLES)]


def test_sql_time_travel(lake):
    v = lake.table_version("trajectories")
    assert sql(lake, "SELECT count(*) n FROM trajectories", as_of=v - 1).column(0).to_pylist() == [10]
    assert sql(lake, "SELECT count(*) n FROM trajectories", as_of={"trajectories": v}).column(0)[0].as_py() == 16
    # a version only trajectories has: an alias or a string spelling another table's name is not
    # a read of that table (it was: "runs has no version N", review 2026-11-29)
    for query in ("SELECT count(*) AS runs FROM trajectories",
                  "SELECT count(*) FROM Trajectories WHERE kind <> 'evals'"):
        assert sql(lake, query, as_of=v).column(0).to_pylist() == [16]
    with pytest.raises(ValueError, match="runs has no version"):
        sql(lake, "SELECT count(*) FROM trajectories, runs", as_of=v)


@pytest.mark.parametrize("query, word", [
    ("COPY (SELECT * FROM trajectories) TO '/tmp/rlake-out.csv'", "COPY"),
    ("ATTACH '/tmp/rlake-other.db' AS other", "ATTACH"),
    ("INSTALL delta", "INSTALL"),
    ("LOAD httpfs", "LOAD"),
    ("DELETE FROM trajectories", "DELETE"),
    ("DROP VIEW trajectories", "DROP"),
    ("CREATE TABLE x AS SELECT 1", "CREATE"),
    ("SET enable_external_access = true", "SET"),
    ("PRAGMA version", "PRAGMA"),
    ("CALL pragma_version()", "CALL"),
    ("CREATE MACRO m(a) AS a", "CREATE"),
    # EXPLAIN ANALYZE runs the statement it explains: that one is checked
    ("EXPLAIN ANALYZE CREATE MACRO m(a) AS a", "CREATE"),
    ("/* c */ explain -- c\n analyze (FORMAT json) COPY (SELECT 1) TO '/tmp/rlake-x.csv'", "COPY"),
    ("EXPLAIN ANALYZE DELETE FROM trajectories", "DELETE"),
    ("EXPLAIN LOAD httpfs", "LOAD"),
    ("EXPLAIN SET threads = 1", "SET"),
    ("EXPLAIN ANALYZE PRAGMA version", "PRAGMA"),
    ("EXPLAIN ANALYZE CALL pragma_version()", "CALL"),
])
def test_sandbox_refuses_statements(lake, query, word):
    with pytest.raises(SqlRefused, match=rf"refused {word} statement.*read-only and sandboxed"):
        sql(lake, query)


def test_one_statement_at_a_time(lake):
    for query in ("SELECT 1; SELECT 2", "SELECT 1; DELETE FROM trajectories"):
        with pytest.raises(SqlRefused, match="^one statement at a time: got 2"):
            sql(lake, query)
    assert sql(lake, "SELECT 42 AS x;").column("x").to_pylist() == [42]  # a trailing ; is fine
    plan = sql(lake, "EXPLAIN ANALYZE SELECT count(*) FROM trajectories")
    assert plan.num_rows >= 1


def test_memory_limit_and_timeout(lake):
    with pytest.raises(ValueError, match=r"more memory than the limit of 64MB \(--memory-limit\)"):
        sql(lake, "SELECT list(range) FROM range(100000000)", memory_limit="64MB")
    with pytest.raises(ValueError, match=r"ran past the timeout of 0.5s \(--timeout\)"):
        sql(lake, "SELECT count(*) FROM range(100000000000) a WHERE a.range % 7 = 3", timeout_s=0.5)
    assert sql(lake, "SELECT count(*) AS n FROM trajectories", memory_limit="64MB",
               timeout_s=60).column("n").to_pylist() == [16]


def test_ctrl_c_stops_a_running_query(lake):
    """Ctrl-C during a query ends it at once: DuckDB held the main thread, where Python runs its
    handler, until the query's end (``--timeout``, 300 s by default: review, 2026-11-29)."""
    ctrl_c = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sql(lake, "SELECT count(*) FROM range(100000000000) a WHERE a.range % 7 = 3", timeout_s=15)
    finally:
        ctrl_c.cancel()
    assert time.monotonic() - start < 5
    assert sql(lake, "SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [16]


@pytest.mark.parametrize("query", [
    "SELECT * FROM read_parquet('{root}/trajectories/**/*.parquet')",
    "SELECT * FROM read_csv('/etc/hostname')",
    "SELECT * FROM '{root}/trajectories/_delta_log/00000000000000000000.json'",
    "SELECT * FROM glob('{root}/*')",
])
def test_sandbox_refuses_reading_files_by_path(lake, query):
    with pytest.raises(SqlRefused, match="refused: .*disabled by configuration"):
        sql(lake, query.format(root=lake.uri))


def test_sql_errors_are_one_line(lake):
    with pytest.raises(ValueError, match="^SQL error: Catalog Error") as e:
        sql(lake, "SELECT * FROM nowhere")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="syntax error"):
        sql(lake, "SELEC 1")


def rlake(*args: str):
    """The `rlake` a user runs (``python -m infra.cli`` in a subprocess): exit code and output."""
    return run_cli(list(args), check=False, timeout=300)


def test_cli_formats_and_out(lake, tmp_path):
    q = "SELECT iteration, count(*) AS n FROM trajectories GROUP BY 1 ORDER BY 1"
    res = rlake("sql", q, "--lake", lake.uri)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].split() == ["iteration", "|", "n"] and "(2 rows)" in res.stdout
    res = rlake("sql", q, "--lake", lake.uri, "--format", "csv")
    assert res.stdout.splitlines() == ['"iteration","n"', "0,10", "1,6"]
    res = rlake("sql", "SELECT sample_uid, loss_mask, created_at FROM trajectories LIMIT 1",
                "--lake", lake.uri, "--format", "json")
    row = json.loads(res.stdout.splitlines()[0])
    assert row["sample_uid"].startswith("r/") and isinstance(row["loss_mask"], list) and "T" in row["created_at"]
    out = tmp_path / "o.parquet"
    res = rlake("sql", q, "--lake", lake.uri, "--format", "parquet", "--out", str(out))
    assert res.returncode == 0 and pq.read_table(out).num_rows == 2
    res = rlake("sql", q, "--lake", lake.uri, "--as-of", str(lake.table_version("trajectories") - 1))
    assert res.returncode == 0 and "(1 row)" in res.stdout
    res = rlake("sql", "SELECT sample_uid FROM trajectories", "--lake", lake.uri, "--max-rows", "3")
    assert res.returncode == 0 and "(3 of 16 rows)" in res.stdout and len(res.stdout.splitlines()) == 6


@pytest.mark.parametrize("args, code, message", [
    (["DELETE FROM trajectories"], 2, "refused DELETE statement"),
    (["EXPLAIN ANALYZE CREATE MACRO m(a) AS a"], 2, "refused CREATE statement"),
    (["SELECT 1; SELECT 2"], 2, "one statement at a time: got 2"),
    (["SELEC 1"], 2, "SQL syntax error"),
    (["SELECT * FROM nowhere"], 2, "SQL error: Catalog Error"),
    (["SELECT 1", "--format", "xml"], 2, "unknown --format 'xml'"),
    (["SELECT 1", "--format", "parquet"], 2, "needs --out"),
    (["SELECT 1", "-S", "novalue"], 2, "KEY=VALUE"),
    (["SELECT 1", "--max-rows", "0"], 2, "--max-rows"),
    (["SELECT 1", "--memory-limit", "lots"], 2, "--memory-limit 'lots' is not a size"),
    (["SELECT list(range) FROM range(100000000)", "--memory-limit", "64MB"], 2,
     "more memory than the limit of 64MB (--memory-limit)"),
    (["SELECT count(*) FROM range(100000000000) a WHERE a.range % 7 = 3", "--timeout", "1"], 2,
     "ran past the timeout of 1s (--timeout)"),
])
def test_cli_sql_failures_exit_non_zero_with_one_line(lake, args, code, message):
    res = rlake("sql", *args, "--lake", lake.uri)
    assert res.returncode == code, (res.stdout, res.stderr)
    assert message in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert lake.read("trajectories").num_rows == 16


def test_cli_missing_lake_folder_is_an_error(tmp_path):
    # status --lake said "no runs" and exited 0 (review, 2026-11-29)
    for args in (["sql", "SELECT count(*) FROM trajectories"], ["lake", "history"], ["status"]):
        res = rlake(*args, "--lake", str(tmp_path / "typo"))
        assert res.returncode == 2, res.stdout
        assert f"no lake at {tmp_path / 'typo'}" in res.stderr and "does not exist" in res.stderr


def test_cli_a_folder_that_is_not_a_lake_is_an_error(lake, tmp_path):
    """A home given for its lake read as an empty lake (count 0, exit 0): review, 2026-11-29."""
    home = tmp_path / "home"
    (home / "lake").mkdir(parents=True)
    for folder, hint in ((home, f"its lake is {home / 'lake'}"), (home / "lake", "holds none")):
        for args in (["sql", "SELECT count(*) FROM trajectories"], ["status"]):
            res = rlake(*args, "--lake", str(folder))
            assert res.returncode == 2, res.stdout
            assert f"no lake at {folder}" in res.stderr and hint in res.stderr
    assert rlake("status", "--lake", lake.uri).returncode == 0
    assert rlake("sql", "SELECT count(*) FROM trajectories", "--lake", lake.uri).returncode == 0
    res = rlake("status", "--home", str(tmp_path / "typo"))
    assert res.returncode == 1 and f"no rlake home at {tmp_path / 'typo'}" in res.stderr


def test_cli_lake_maintenance(lake):
    res = rlake("lake", "history", "--lake", lake.uri)
    assert res.returncode == 0 and "append_trajectories" in res.stdout
    res = rlake("lake", "compact", "--lake", lake.uri, "--max-row-group-size", "4")
    assert res.returncode == 0 and json.loads(res.stdout)["numFilesRemoved"] == 2
    res = rlake("lake", "vacuum", "--lake", lake.uri, "--retention-hours", "0", "--dry-run")
    assert res.returncode == 0 and len([x for x in res.stdout.splitlines() if x.endswith(".parquet")]) == 2
    res = rlake("lake", "vacuum", "--lake", lake.uri, "--retention-hours", "0")
    assert res.returncode == 0 and "deleted 2 files" in res.stderr
    # the files are gone: a second vacuum deletes none (it said "deleted 2 files" again)
    res = rlake("lake", "vacuum", "--lake", lake.uri, "--retention-hours", "0", "--dry-run")
    assert res.returncode == 0 and "would delete 0 files" in res.stderr and not res.stdout.strip()
    res = rlake("lake", "history", "--lake", lake.uri, "--json", "--limit", "1")
    assert json.loads(res.stdout)["operation"] == "VACUUM END"
    assert lake.read("trajectories").num_rows == 16
    res = rlake("lake", "compact", "--lake", lake.uri, "--table", "bogus")
    assert res.returncode == 2 and "unknown table 'bogus'" in res.stderr
    # a run's partition exists only in trajectories: elsewhere --run-id compacted every run's files
    res = rlake("lake", "compact", "--lake", lake.uri, "--table", "runs", "--run-id", "r")
    assert res.returncode == 2 and "--run-id: only trajectories is partitioned by run" in res.stderr
    for args in (["history", "--limit", "-1"], ["compact", "--max-row-group-size", "-5"]):
        res = rlake("lake", *args, "--lake", lake.uri)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    res = rlake("lake", "history", "--lake", lake.uri, "-S", "AWS_REGION=eu-west-1", "--limit", "1")
    assert res.returncode == 0 and "VACUUM END" in res.stdout  # a local lake ignores store options
    res = rlake("lake", "history", "--lake", lake.uri, "-S", "=x")
    assert res.returncode == 2 and "'=x' is not KEY=VALUE" in res.stderr


def test_lineage_is_one_query(lake):
    v = lake.table_version("trajectories")
    lake.append_train_step({"run_id": "r", "step": 0, "base_version": 0, "weight_version": 1,
                            "lake_version": v, "sample_uids": ["r/0/0", "r/0/1"]})
    t = sql(lake, "SELECT t.sample_uid, t.reward, s.lake_version FROM train_steps s, "
                  "unnest(s.sample_uids) AS u(uid) JOIN trajectories t ON t.sample_uid = u.uid "
                  "WHERE s.run_id = 'r' AND s.weight_version = 1 ORDER BY 1")
    assert t.column("sample_uid").to_pylist() == ["r/0/0", "r/0/1"]
    assert t.column("lake_version").to_pylist() == [v, v]


def test_cli_out_into_a_missing_folder_is_refused_before_the_query(lake, tmp_path):
    res = rlake("sql", "SELECT count(*) FROM trajectories", "--lake", lake.uri, "--out",
                str(tmp_path / "nodir" / "x.csv"), "--format", "csv")
    assert res.returncode == 2 and f"the folder {tmp_path / 'nodir'} does not exist" in res.stderr
    res = rlake("sql", "SELECT 1", "--lake", lake.uri, "--out", str(tmp_path), "--format", "csv")
    assert res.returncode == 2 and "is a folder, not a file" in res.stderr


def test_cli_out_inside_the_lake_is_refused(lake, tmp_path):
    """A Parquet result written over a data file lost its rows; a JSON one in _delta_log
    became a commit (review, 2026-11-29)."""
    data_file = next((tmp_path / "lake" / "trajectories").rglob("*.parquet"))
    next_commit = tmp_path / "lake" / "trajectories" / "_delta_log" / "00000000000000000099.json"
    for out, fmt in ((data_file, "parquet"), (next_commit, "json")):
        res = rlake("sql", "SELECT 1 AS x", "--lake", lake.uri, "--out", str(out), "--format", fmt)
        assert res.returncode == 2 and "is inside the lake" in res.stderr, res.stderr
    assert not next_commit.exists() and lake.read("trajectories").num_rows == 16


def test_lineage_after_compaction_and_vacuum(lake):
    """Lineage read each step's samples as of its lake version, which routine maintenance
    (compact, then vacuum) makes unreadable: it failed while the rows were all still there
    (review, 2026-11-29). It reads today's table then (rows never change)."""
    from buffer.maintenance import compact, vacuum
    from infra.lineage import version_lineage

    v = lake.table_version("trajectories")
    lake.append_train_step({"run_id": "r", "step": 0, "iteration": 0, "base_version": 0,
                            "weight_version": 1, "lake_version": v, "sample_uids": ["r/0/0", "r/0/1"]})
    before = version_lineage(lake, "r", 1)
    compact(lake)
    vacuum(lake, retention_hours=0)
    with pytest.raises(ValueError, match="vacuum"):
        lake.read("trajectories", as_of=v)
    after = version_lineage(lake, "r", 1)
    assert sorted(s["sample_uid"] for s in after["samples"]) == ["r/0/0", "r/0/1"]
    def by_uid(info: dict) -> list[dict]:
        return sorted(info["samples"], key=lambda s: s["sample_uid"])

    assert by_uid(after) == by_uid(before)


def test_output_renames_duplicate_column_names(tmp_path):
    """A join's ``t.weight_version, s.weight_version``: the table showed the last column's values
    under both headers, JSON dropped one, CSV failed (review, 2026-11-29)."""
    import pyarrow as pa

    from buffer.output import render

    t = pa.table([pa.array([1, 2]), pa.array([2, 3]), pa.array([9, 9])], names=["v", "v", "v_1"])
    lines = render(t, "table").splitlines()
    assert lines[0].split(" | ") == ["v", "v_1", "v_1_1"] and lines[2].split(" | ") == ["1", "2  ", "9    "]
    assert [json.loads(x) for x in render(t, "json").splitlines()] == [
        {"v": 1, "v_1": 2, "v_1_1": 9}, {"v": 2, "v_1": 3, "v_1_1": 9}]
    assert render(t, "csv").splitlines() == ['"v","v_1","v_1_1"', "1,2,9", "2,3,9"]
    render(t, "parquet", tmp_path / "o.parquet")
    assert pq.read_table(tmp_path / "o.parquet").column_names == ["v", "v_1", "v_1_1"]


def test_output_json_writes_non_finite_floats_as_null():
    """``--format json`` wrote NaN and Infinity, which are not JSON (review, 2026-11-29)."""
    import pyarrow as pa

    from buffer.output import render

    t = pa.table({"x": [float("nan"), float("inf"), 1.5], "xs": [[float("-inf"), 2.0], None, []]})
    text = render(t, "json")
    assert [json.loads(x, parse_constant=pytest.fail) for x in text.splitlines()] == [
        {"x": None, "xs": [None, 2.0]}, {"x": None, "xs": None}, {"x": 1.5, "xs": []}]


def test_the_sandbox_configuration_is_locked():
    """A second line of defence behind the statement check: the connection itself refuses a
    SET that would open file access again (mutation review, 2026-11-29: dropping the lock
    failed no test)."""
    import duckdb

    from buffer.sql import sandbox_connection

    con = sandbox_connection()
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
    con.close()
