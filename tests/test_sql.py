"""SQL over the lake: results, time travel, the sandbox, and the `rlake sql` / `rlake lake` CLI."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from buffer import Lake
from buffer.sql import SqlRefused, sql
from buffer.synth import synthetic_rows
from infra.lake_cli import lake_app, sql_command


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    lake.append_trajectories(synthetic_rows("r", 0, 10))
    lake.append_trajectories(synthetic_rows("r", 1, 6))
    lake.upsert_run({"run_id": "r", "status": "running"})
    return lake


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("sql")(sql_command)
    app.add_typer(lake_app, name="lake")
    return app


def test_sql_returns_arrow_with_pushed_down_filters(lake):
    t = sql(lake, "SELECT iteration, count(*) AS n FROM trajectories WHERE iteration >= 0 "
                  "GROUP BY iteration ORDER BY iteration")
    assert t.to_pylist() == [{"iteration": 0, "n": 10}, {"iteration": 1, "n": 6}]
    joined = lake.sql("SELECT r.status, count(*) AS n FROM trajectories t JOIN runs r USING (run_id) "
                      "GROUP BY 1")
    assert joined.to_pylist() == [{"status": "running", "n": 16}]
    assert sql(lake, "SELECT count(*) AS n FROM evals").column("n").to_pylist() == [0]


def test_sql_time_travel(lake):
    v = lake.table_version("trajectories")
    assert sql(lake, "SELECT count(*) n FROM trajectories", as_of=v - 1).column(0).to_pylist() == [10]
    assert sql(lake, "SELECT count(*) n FROM trajectories", as_of={"trajectories": v}).column(0)[0].as_py() == 16


@pytest.mark.parametrize("query, word", [
    ("COPY (SELECT * FROM trajectories) TO '/tmp/rlake-out.csv'", "COPY"),
    ("ATTACH '/tmp/rlake-other.db' AS other", "ATTACH"),
    ("INSTALL delta", "INSTALL"),
    ("LOAD httpfs", "LOAD"),
    ("DELETE FROM trajectories", "DELETE"),
    ("DROP VIEW trajectories", "DROP"),
    ("CREATE TABLE x AS SELECT 1", "CREATE"),
    ("SET enable_external_access = true", "SET"),
    ("SELECT 1; DELETE FROM trajectories", "DELETE"),
])
def test_sandbox_refuses_statements(lake, query, word):
    with pytest.raises(SqlRefused, match=rf"refused {word} statement.*read-only and sandboxed"):
        sql(lake, query)


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


def test_cli_formats_and_out(lake, cli, tmp_path):
    runner = CliRunner()
    q = "SELECT iteration, count(*) AS n FROM trajectories GROUP BY 1 ORDER BY 1"
    res = runner.invoke(cli, ["sql", q, "--lake", lake.uri])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].split() == ["iteration", "|", "n"] and "(2 rows)" in res.output
    res = runner.invoke(cli, ["sql", q, "--lake", lake.uri, "--format", "csv"])
    assert res.output.splitlines() == ['"iteration","n"', "0,10", "1,6"]
    res = runner.invoke(cli, ["sql", "SELECT sample_uid, loss_mask, created_at FROM trajectories LIMIT 1",
                              "--lake", lake.uri, "--format", "json"])
    row = json.loads(res.output.splitlines()[0])
    assert row["sample_uid"].startswith("r/") and isinstance(row["loss_mask"], list) and "T" in row["created_at"]
    out = tmp_path / "o.parquet"
    res = runner.invoke(cli, ["sql", q, "--lake", lake.uri, "--format", "parquet", "--out", str(out)])
    assert res.exit_code == 0 and pq.read_table(out).num_rows == 2
    res = runner.invoke(cli, ["sql", q, "--lake", lake.uri, "--as-of", str(lake.table_version("trajectories") - 1)])
    assert "(1 row)" in res.output


def test_cli_refusals_and_bad_options(lake, cli):
    runner = CliRunner()
    res = runner.invoke(cli, ["sql", "DELETE FROM trajectories", "--lake", lake.uri])
    assert res.exit_code == 2 and "refused DELETE" in res.output
    res = runner.invoke(cli, ["sql", "SELECT 1", "--lake", lake.uri, "--format", "xml"])
    assert res.exit_code == 2 and "unknown --format 'xml'" in res.output
    res = runner.invoke(cli, ["sql", "SELECT 1", "--lake", lake.uri, "--format", "parquet"])
    assert res.exit_code == 2 and "needs --out" in res.output
    res = runner.invoke(cli, ["sql", "SELECT 1", "--lake", lake.uri, "-S", "novalue"])
    assert res.exit_code != 0 and "KEY=VALUE" in res.output
    assert lake.read("trajectories").num_rows == 16


def test_cli_lake_maintenance(lake, cli):
    runner = CliRunner()
    res = runner.invoke(cli, ["lake", "history", "--lake", lake.uri])
    assert res.exit_code == 0 and "append_trajectories" in res.output
    res = runner.invoke(cli, ["lake", "compact", "--lake", lake.uri, "--max-row-group-size", "4"])
    assert res.exit_code == 0 and json.loads(res.output)["numFilesRemoved"] == 2
    res = runner.invoke(cli, ["lake", "vacuum", "--lake", lake.uri, "--retention-hours", "0", "--dry-run"])
    assert res.exit_code == 0 and len([x for x in res.output.splitlines() if x.endswith(".parquet")]) == 2
    res = runner.invoke(cli, ["lake", "vacuum", "--lake", lake.uri, "--retention-hours", "0"])
    assert res.exit_code == 0 and "deleted 2 files" in res.output
    res = runner.invoke(cli, ["lake", "history", "--lake", lake.uri, "--json", "--limit", "1"])
    assert json.loads(res.output)["operation"] == "VACUUM END"
    assert lake.read("trajectories").num_rows == 16
    res = runner.invoke(cli, ["lake", "compact", "--lake", lake.uri, "--table", "bogus"])
    assert res.exit_code == 2 and "unknown table 'bogus'" in res.output


def test_lineage_is_one_query(lake):
    v = lake.table_version("trajectories")
    lake.append_train_step({"run_id": "r", "step": 0, "base_version": 0, "weight_version": 1,
                            "lake_version": v, "sample_uids": ["r/0/0", "r/0/1"]})
    t = sql(lake, "SELECT t.sample_uid, t.reward, s.lake_version FROM train_steps s, "
                  "unnest(s.sample_uids) AS u(uid) JOIN trajectories t ON t.sample_uid = u.uid "
                  "WHERE s.run_id = 'r' AND s.weight_version = 1 ORDER BY 1")
    assert t.column("sample_uid").to_pylist() == ["r/0/0", "r/0/1"]
    assert t.column("lake_version").to_pylist() == [v, v]
