"""The Delta log stays small over a long run (review P, bug 1): statistics only on the columns
that prune files, txn actions that expire, and tables an older rlake created brought up to date.

Each checkpoint (every ``CHECKPOINT_INTERVAL`` commits) lists every file of the table with its
statistics and every unexpired ``txn`` action: min/max of train_steps' long JSON columns made an
entry ~1.5 kB, and txns written without ``lastUpdated`` never expired (one per commit, forever).
"""

from __future__ import annotations

import glob
import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from buffer import Lake, delta
from buffer.lake import scope_filter
from buffer.maintenance import compact
from buffer.schema import PARTITIONS, arrow_schema, rows_to_table
from buffer.synth import synthetic_rows

OLD_PROPERTIES = {"delta.checkpointInterval": "10", "delta.setTransactionRetentionDuration": "interval 7 days"}
# the columns each table's reads and key checks prune files on (buffer/lake.py: scope_filter's
# key scopes, training_slice / iteration_rows / read_samples / _consumed / read, the runs MERGE)
PRUNED = {
    "trajectories": {"run_id", "iteration", "weight_version", "kind", "sample_uid"},
    "train_steps": {"run_id", "step", "base_version"},
    "evals": {"run_id", "weight_version"},
    "runs": {"run_id"},
}
LONG = {"trajectories": {"prompt", "response", "metadata", "reward_detail", "label"},
        "train_steps": {"metrics", "timings"}, "evals": set(), "runs": {"config", "notes"}}


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def step_row(step: int, run_id: str = "r") -> dict:
    return {"run_id": run_id, "step": step, "iteration": step, "base_version": step,
            "weight_version": step + 1, "lake_version": step, "sample_uids": [f"{run_id}/{step}/0"],
            "n_samples": 1, "pg_loss": 0.5, "entropy": 1.0,
            "metrics": json.dumps({f"rollout/metric_{k}": k / 7 for k in range(30)}),
            "timings": json.dumps({"generate": 0.1, "train": 0.2})}


def checkpoint_rows(lake: Lake, table: str) -> list[dict]:
    log = Path(lake.table_uri(table)) / "_delta_log"
    newest = sorted(glob.glob(str(log / "*.checkpoint.parquet")))[-1]
    return pq.read_table(newest).to_pylist()


def write_every_table(lake: Lake) -> None:
    lake.append_trajectories(synthetic_rows("r", 0, 4))
    lake.append_train_step(step_row(0))
    lake.append_evals([{"run_id": "r", "weight_version": 0, "iteration": 0, "dataset": "d",
                        "metric": "accuracy", "value": 0.5, "n": 4}])
    lake.upsert_run({"run_id": "r", "config": json.dumps({"k": "v" * 200}), "status": "running"})


def test_every_table_keeps_statistics_only_where_files_are_pruned(lake):
    """Each table is created with ``delta.dataSkippingStatsColumns``: the pruning columns are in
    it, the long text columns are not, and the txn retention is an hour (not 7 days)."""
    write_every_table(lake)
    for table in PRUNED:
        config = lake._table(table).metadata().configuration
        stats = set(config["delta.dataSkippingStatsColumns"].split(","))
        assert PRUNED[table] - set(PARTITIONS.get(table, ())) <= stats, table
        assert not LONG[table] & stats, table
        assert stats <= set(arrow_schema(table).names), table
        assert config["delta.setTransactionRetentionDuration"] == "interval 1 hour", table


def test_train_steps_checkpoint_entries_have_no_statistics_for_metrics(lake):
    """A checkpoint's add action for a train_steps file: statistics on the pruning columns, none
    on ``metrics``/``timings`` (the ~1.5 kB entries of review P); pruning still works."""
    for step in range(delta.CHECKPOINT_INTERVAL + 1):
        lake.append_train_step(step_row(step))
    adds = [r["add"] for r in checkpoint_rows(lake, "train_steps") if r["add"]]
    assert len(adds) == delta.CHECKPOINT_INTERVAL - 2  # at version 9: 0 create, 1 schema version
    for add in adds:
        stats = json.loads(add["stats"])
        for part in ("minValues", "maxValues", "nullCount"):
            assert "metrics" not in stats[part] and "timings" not in stats[part]
            assert {"run_id", "step", "base_version"} <= set(stats[part])
        assert len(add["stats"]) < 600
    dt = lake._table("train_steps")
    kept = delta.to_dataset(dt, [("run_id", "=", "r"), ("base_version", ">=|null", 8)])
    assert len(list(kept.get_fragments())) == delta.CHECKPOINT_INTERVAL + 1 - 8
    assert len(list(delta.to_dataset(dt, [("step", ">=", 3), ("step", "<=", 3)]).get_fragments())) == 1
    assert lake.consumed_sample_uids("r") == {f"r/{s}/0" for s in range(delta.CHECKPOINT_INTERVAL + 1)}


def test_checkpoint_drops_txn_actions_past_the_retention(lake, monkeypatch):
    """A checkpoint holds no txn action older than the table's txn retention (an hour): every
    append's txn carries ``lastUpdated``, without which delta-rs keeps each one for ever (a
    checkpoint then listed one txn per commit the table ever had). Steps 0-3 are appended with
    the clock two hours back (a 1 s retention and a sleep flaked on a loaded machine)."""
    real_time_ns = time.time_ns
    monkeypatch.setattr(delta.time, "time_ns", lambda: real_time_ns() - 2 * 3600 * 10**9)
    lake.append_train_step(step_row(0))  # version 2
    stale = DeltaTable(lake.table_uri("train_steps"))  # a writer that read the table then stalled
    for step in range(1, 4):  # versions 3..5
        lake.append_train_step(step_row(step))
    monkeypatch.setattr(delta.time, "time_ns", real_time_ns)
    versions = [lake.append_train_step(step_row(step)) for step in range(4, delta.CHECKPOINT_INTERVAL + 1)]
    rows = checkpoint_rows(lake, "train_steps")
    txns = sorted(r["txn"]["appId"] for r in rows if r["txn"])
    checkpoint = delta.CHECKPOINT_INTERVAL - 1
    fresh = [step for step, v in zip(range(4, delta.CHECKPOINT_INTERVAL + 1), versions, strict=True)
             if v <= checkpoint]
    assert txns == sorted(f"rlake/train_steps/r/{s}" for s in fresh)
    assert all(r["txn"]["lastUpdated"] for r in rows if r["txn"])
    assert lake.append_train_step(step_row(0)) is None  # still written exactly once
    # the stalled writer appends step 1 (its snapshot has none) under step 1's guard, which the
    # checkpoint dropped: the conflict checker reads the commits since its snapshot, so it still
    # conflicts, re-reads and finds step 1 there
    opened = []

    def get_table() -> DeltaTable:
        opened.append(1)
        return stale if len(opened) == 1 else lake._table("train_steps", create=True)

    prune, row_filter = scope_filter([("r", 1)], "run_id", "step")
    assert delta.guarded_append(get_table, "train_steps", rows_to_table("train_steps", [step_row(1)]),
                                ["rlake/train_steps/r/1"], prune, row_filter) is None
    assert len(opened) == 2
    assert sorted(lake.read("train_steps").column("step").to_pylist()) == list(range(delta.CHECKPOINT_INTERVAL + 1))


def create_old_style(lake: Lake, table: str) -> DeltaTable:
    """``table`` as rlake created it before: no stats restriction, txns kept 7 days."""
    uri = lake.table_uri(table)
    Path(uri).mkdir(parents=True, exist_ok=True)
    dt = DeltaTable.create(uri, schema=arrow_schema(table), partition_by=PARTITIONS.get(table),
                           name=table, configuration=OLD_PROPERTIES)
    delta.set_schema_version(dt)
    return dt


def logged_add_stats(lake: Lake, table: str) -> list[dict]:
    """The statistics of every add action in ``table``'s JSON commits."""
    out = []
    for entry in sorted((Path(lake.table_uri(table)) / "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                out.append(json.loads(action["add"]["stats"]))
    return out


def current(dt: DeltaTable) -> bool:
    """The table's properties are the current ones (stats restricted, txns kept an hour)."""
    config = dt.metadata().configuration
    retention = delta.TABLE_PROPERTIES["delta.setTransactionRetentionDuration"]  # an hour but where a test sets it
    return (config.get("delta.setTransactionRetentionDuration") == retention
            and "metrics" not in config.get("delta.dataSkippingStatsColumns", "metrics")
            and "prompt" not in config.get("delta.dataSkippingStatsColumns", "prompt"))


def operations(dt: DeltaTable) -> list[str]:
    return [h.get("operation") for h in dt.history()]


def test_old_style_table_is_upgraded_once_by_a_writer_never_by_a_reader(lake):
    """A table created with the old properties: reads (``read``, ``dataset``, a slice) commit
    nothing; the first write brings its properties up to date with one SET TBLPROPERTIES commit
    (a second ``Lake`` finds nothing to do), and the files written after carry no ``metrics``
    statistics."""
    old = create_old_style(lake, "train_steps")
    create_old_style(lake, "trajectories")
    version = old.version()
    reader = Lake(lake.uri)
    reader.read("train_steps")
    reader.dataset("train_steps")
    reader.training_slice("r", min_version=0)
    reader.consumed_sample_uids("r")
    assert DeltaTable(lake.table_uri("train_steps")).version() == version
    lake.append_train_step(step_row(0))
    Lake(lake.uri).append_train_step(step_row(1))
    dt = DeltaTable(lake.table_uri("train_steps"))
    assert operations(dt).count("SET TBLPROPERTIES") == 2  # the schema version's, and the upgrade
    assert dt.version() == version + 3
    assert current(dt) and delta.stale_properties(dt, "train_steps") == {}
    assert dt.metadata().configuration["delta.setTransactionRetentionDuration"] == "interval 1 hour"
    added = logged_add_stats(lake, "train_steps")
    assert len(added) == 2 and not any("metrics" in s["minValues"] for s in added)
    assert sorted(lake.read("train_steps").column("step").to_pylist()) == [0, 1]


def test_compact_upgrades_an_old_style_table_and_rewrites_its_statistics(lake):
    """``compact`` (maintenance) brings an old table's properties up to date before rewriting,
    so the compacted files, and the checkpoint after, carry no ``metrics`` statistics."""
    old = create_old_style(lake, "train_steps")
    from deltalake import write_deltalake

    for step in range(5):  # appended as an older rlake did: statistics on every column
        write_deltalake(old, rows_to_table("train_steps", [step_row(step)]), mode="append")
    before = logged_add_stats(lake, "train_steps")
    assert len(before) == 5 and all("metrics" in s["minValues"] for s in before)
    reader = Lake(lake.uri)
    compact(reader, "train_steps")
    dt = DeltaTable(lake.table_uri("train_steps"))
    assert current(dt) and delta.stale_properties(dt, "train_steps") == {}
    adds = [r["add"] for r in checkpoint_rows(lake, "train_steps") if r["add"]]
    assert len(adds) == 1 and "metrics" not in json.loads(adds[0]["stats"])["minValues"]
    assert sorted(reader.read("train_steps").column("step").to_pylist()) == list(range(5))


@pytest.mark.parametrize("retention", [None, "interval 1 second"])
def test_racing_writers_on_an_old_style_table_upgrade_it_and_write_exactly_once(lake, monkeypatch, retention):
    """Four writers (own ``Lake`` each) start on an old-style table at once, each appending the
    same train steps and trajectories: the upgrades and appends conflict and retry; every key
    is written exactly once and the properties end up current. Also with txns expiring after a
    second: the conflict checker reads the racing commits' txns, not the checkpoint's."""
    if retention:
        monkeypatch.setitem(delta.TABLE_PROPERTIES, "delta.setTransactionRetentionDuration", retention)
    create_old_style(lake, "train_steps")
    create_old_style(lake, "trajectories")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            mine = Lake(lake.uri)
            barrier.wait()
            for k in range(12 if retention else 4):  # past a checkpoint that drops txns
                mine.append_train_step(step_row(k))
                mine.append_trajectories(synthetic_rows("r", k, 4))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    n = 12 if retention else 4
    steps = lake.read("train_steps").column("step").to_pylist()
    assert sorted(steps) == list(range(n))
    uids = lake.read("trajectories").column("sample_uid").to_pylist()
    assert len(uids) == 4 * n and len(set(uids)) == 4 * n
    for table in ("train_steps", "trajectories"):
        dt = DeltaTable(lake.table_uri(table))
        assert current(dt) and delta.stale_properties(dt, table) == {}
        assert operations(dt).count("SET TBLPROPERTIES") == 2, table


def test_an_upgrade_that_loses_a_race_retries_and_reports_the_table_current(lake):
    """Writer A read the old-style table; B upgraded it meanwhile: A's property commit conflicts
    (``CommitFailedError``), and A re-reads, finds the table current and says so (True), with
    one upgrade in the table's history. (The racing-writers test above passes whoever wins.)"""
    create_old_style(lake, "train_steps")
    uri = lake.table_uri("train_steps")
    late = DeltaTable(uri)  # A: read before B's upgrade
    assert delta.stale_properties(late, "train_steps")
    assert delta.upgrade_properties(DeltaTable(uri), "train_steps")  # B
    assert delta.upgrade_properties(late, "train_steps") is True
    dt = DeltaTable(uri)
    assert current(dt) and operations(dt).count("SET TBLPROPERTIES") == 2  # creation's + B's
