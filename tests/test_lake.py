"""Unit tests of the lake: schema, idempotent appends, reads, time travel, runs, evolution, maintenance."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from buffer import SCHEMA_VERSION, Lake, slice_lake_version
from buffer.maintenance import compact, history, vacuum
from buffer.schema import TABLES, arrow_schema, rows_to_table
from buffer.sql import sql
from buffer.synth import synthetic_rows
from rollout.sample import Sample, Status


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def uids(table: pa.Table) -> list[str]:
    return table.column("sample_uid").to_pylist()


def test_every_column_is_documented():
    for name in TABLES:
        for field in arrow_schema(name):
            assert field.metadata[b"doc"].strip(), f"{name}.{field.name} has no doc"


@pytest.mark.parametrize("form", ["{}", "file://{}"])
def test_a_local_lake_path_with_a_percent_is_refused(tmp_path, form):
    """deltalake percent-decodes local paths (``a%20b`` read as ``a b``): a home holding ``%``
    wrote the run row and failed at its first read (review, 2026-11-29). Refused up front, before
    anything is written."""
    folder = tmp_path / "a%20b"
    with pytest.raises(ValueError, match=f"lake path '{folder}/lake' contains '%'"):
        Lake(form.format(folder / "lake"))
    assert not folder.exists()


def test_sample_to_row_round_trips_through_the_lake(lake):
    s = Sample(group_index=1, index=3, prompt="1+1=", prompt_token_ids=[5, 6], label="2",
               response="2", response_token_ids=[7], rollout_log_probs=[-0.5], loss_mask=[1],
               reward=1.0, reward_detail={"ok": True}, status=Status.COMPLETED, finish_reason="stop",
               weight_version=4, metadata={"t": 1.0}, data_source="synthetic", row=9)
    before = datetime.now(UTC)
    version = lake.append_trajectories([s.to_row("run-a", 2, "torch")])
    after = datetime.now(UTC)
    assert version == lake.table_version("trajectories")
    row = lake.read("trajectories").to_pylist()[0]
    assert row["sample_uid"] == "run-a/2/3" and row["kind"] == "train"
    assert row["created_at"].tzinfo is not None
    assert before <= row["created_at"] <= after  # stamped during the append
    back = Sample.from_row(row)
    assert back.rollout_log_probs == [-0.5] and back.reward_detail == {"ok": True}
    assert back.weight_version == 4 and back.status is Status.COMPLETED


def test_same_iteration_twice_leaves_one_copy(lake):
    rows = synthetic_rows("r", 0, 64)
    v1 = lake.append_trajectories(rows)
    assert v1 is not None
    assert lake.append_trajectories(rows) is None  # nothing new: no commit
    assert lake.table_version("trajectories") == v1
    # a retry with half the old rows plus new ones writes only the new ones
    more = rows[:32] + synthetic_rows("r", 1, 16)
    assert lake.append_trajectories(more) == v1 + 1
    got = uids(lake.read("trajectories"))
    assert len(got) == len(set(got)) == 80
    assert lake.append_trajectories([]) is None and lake.append_evals([]) is None
    # duplicates inside one batch are written once
    assert lake.append_trajectories(synthetic_rows("r", 2, 4) * 2) is not None
    assert lake.read("trajectories", run_id="r").num_rows == 84


def test_commit_info_is_stored_with_the_rows_and_found_again(lake):
    assert lake.trajectory_commit_info("r", 0) is None  # no table yet
    lake.append_trajectories(synthetic_rows("r", 0, 8), commit_info={"rlake.rollout_stats": '{"a": 1}'})
    for i in range(1, 150):  # more commits than one page of the log
        lake.append_trajectories(synthetic_rows("r", i, 2))
    lake.append_trajectories(synthetic_rows("other", 0, 2), commit_info={"rlake.rollout_stats": "{}"})
    assert lake.trajectory_commit_info("r", 0)["rlake.rollout_stats"] == '{"a": 1}'
    assert lake.trajectory_commit_info("other", 0)["rlake.rollout_stats"] == "{}"
    assert "rlake.rollout_stats" not in lake.trajectory_commit_info("r", 149)
    assert lake.trajectory_commit_info("r", 150) is None
    # an append that writes nothing (rows already there) does not hide the original commit
    assert lake.append_trajectories(synthetic_rows("r", 0, 8), commit_info={"x": "y"}) is None
    assert lake.trajectory_commit_info("r", 0)["rlake.rollout_stats"] == '{"a": 1}'


def test_an_evaluation_after_its_batch_does_not_hide_the_batchs_commit_info(lake):
    """Async mode evaluates weight version b after rollout batch b is in the lake: the
    evaluation's rows (iteration b) commit under their own guard, so the batch's rollout stats
    are still found (with one guard, resume lost the data position, review of 2026-11-29)."""
    lake.append_trajectories(synthetic_rows("r", 3, 8), commit_info={"rlake.rollout_stats": '{"p": 24}'})
    lake.append_trajectories(synthetic_rows("r", 3, 4, kind="eval"))
    assert lake.trajectory_commit_info("r", 3)["rlake.rollout_stats"] == '{"p": 24}'
    assert lake.read("trajectories", run_id="r").num_rows == 12


def test_an_empty_run_id_is_refused_before_anything_is_written(lake):
    """Delta writes an empty partition value as null: once committed, every read of the table
    failed on its non-nullable ``run_id``."""
    lake.append_trajectories(synthetic_rows("r", 0, 2))
    with pytest.raises(ValueError, match="'run_id' must not be an empty string"):
        lake.append_trajectories(synthetic_rows("", 0, 2))
    lake.append_trajectories(synthetic_rows("r", 1, 2))
    assert lake.read("trajectories").num_rows == 4


def test_arrow_input_and_created_at_kept(lake):
    stamp = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    rows = [dict(r, created_at=stamp) for r in synthetic_rows("r", 0, 4)]
    lake.append_trajectories(rows_to_table("trajectories", rows))
    assert set(lake.read("trajectories", columns=["created_at"]).column(0).to_pylist()) == {stamp}


def test_bad_rows_get_a_clear_error(lake):
    rows = synthetic_rows("r", 0, 2)
    rows[1]["iteration"] = "seven"
    with pytest.raises(ValueError, match="iteration"):
        lake.append_trajectories(rows)
    del rows[1]["iteration"]
    with pytest.raises(ValueError, match="'iteration' must not be null"):
        lake.append_trajectories(rows)
    with pytest.raises(ValueError, match="unknown lake table 'nope'"):
        lake.read("nope")


def test_read_filters_and_columns(lake):
    lake.append_trajectories(synthetic_rows("a", 0, 5) + synthetic_rows("b", 0, 3))
    assert lake.read("trajectories", run_id="b").num_rows == 3
    t = lake.read("trajectories", run_id="a", columns=["iteration", "sample_uid"])
    assert t.column_names == ["iteration", "sample_uid"] and t.num_rows == 5
    assert lake.read("evals").num_rows == 0 and lake.table_version("evals") is None


def test_time_travel_by_version_and_timestamp(lake):
    v0 = lake.append_trajectories(synthetic_rows("r", 0, 8))
    # a commit's time is its log file's mtime, stamped from the kernel's coarse clock (one tick,
    # up to 10 ms, behind datetime.now): a commit within a tick after `between` read as before it
    time.sleep(0.05)
    between = datetime.now(UTC)
    time.sleep(0.05)
    v1 = lake.append_trajectories(synthetic_rows("r", 1, 8))
    assert v1 == v0 + 1
    assert lake.read("trajectories", as_of=v0).num_rows == 8
    assert lake.read("trajectories", as_of=str(v1)).num_rows == 16
    assert lake.read("trajectories", as_of=between.isoformat()).num_rows == 8
    with pytest.raises(ValueError, match="neither a Delta version"):
        lake.read("trajectories", as_of="yesterday")
    # a version past the last one: named, with the versions there are (delta-rs's own message
    # spoke of a "LogSegment end version")
    with pytest.raises(ValueError, match=rf"trajectories has no version {v1 + 1} \(its versions are 0 to {v1}\)"):
        lake.read("trajectories", as_of=v1 + 1)
    # before the table's first commit: the table as created, empty (it held no rows then)
    assert lake.read("trajectories", as_of="2020-01-01T00:00:00").num_rows == 0


def test_train_steps_evals_idempotent_and_lineage(lake):
    lake.append_trajectories(synthetic_rows("r", 0, 8))
    step = {"run_id": "r", "step": 0, "iteration": 0, "base_version": 0, "weight_version": 1,
            "lake_version": lake.table_version("trajectories"), "sample_uids": ["r/0/0", "r/0/1"],
            "n_samples": 2, "pg_loss": 0.1, "metrics": json.dumps({"x": 1}), "timings": "{}"}
    assert lake.append_train_step(step) is not None
    assert lake.append_train_step(step) is None
    assert lake.append_train_step({**step, "step": 1, "sample_uids": ["r/0/2"], "weight_version": 2})
    assert lake.read("train_steps").num_rows == 2
    assert lake.consumed_sample_uids("r") == {"r/0/0", "r/0/1", "r/0/2"}
    assert lake.samples_for_weight_version("r", 1) == ["r/0/0", "r/0/1"]
    ev = [{"run_id": "r", "weight_version": 1, "iteration": 0, "dataset": "add", "metric": m,
           "value": 0.5, "n": 10} for m in ("acc", "mean_reward")]
    assert lake.append_evals(ev) is not None
    assert lake.append_evals(ev + [dict(ev[0], weight_version=2)]) is not None
    assert lake.append_evals(ev) is None
    assert lake.read("evals").num_rows == 3


def test_runs_upsert_updates_in_place(lake):
    assert lake.get_run("x") is None
    lake.upsert_run({"run_id": "x", "status": "running", "config": "{}", "mlflow_run_id": "m1"})
    first = lake.get_run("x")
    lake.upsert_run({"run_id": "x", "status": "completed"})
    lake.upsert_run({"run_id": "y", "status": "running", "parent_run_id": "x"})
    runs = {r["run_id"]: r for r in lake.read("runs").to_pylist()}
    assert len(runs) == 2
    assert runs["x"]["status"] == "completed" and runs["x"]["mlflow_run_id"] == "m1"
    assert runs["x"]["created_at"] == first["created_at"]
    assert runs["x"]["updated_at"] >= first["updated_at"]
    with pytest.raises(ValueError, match="run_id"):
        lake.upsert_run({"status": "x"})


def test_schema_version_recorded(lake):
    lake.append_trajectories(synthetic_rows("r", 0, 2))
    assert lake.schema_version("trajectories") == SCHEMA_VERSION


def test_old_table_missing_a_column_reads_and_evolves(tmp_path):
    """A table written before `engine` and `finish_reason` existed reads them as null; new writes add them."""
    lake = Lake(str(tmp_path / "lake"))
    old = rows_to_table("trajectories", synthetic_rows("r", 0, 4)).drop(["engine", "finish_reason"])
    write_deltalake(lake.table_uri("trajectories"), old, partition_by=["run_id"])
    t = lake.read("trajectories")
    assert t.column("engine").null_count == 4 and t.schema.names == arrow_schema("trajectories").names
    assert lake.training_slice("r", 0).num_rows == 4
    lake.append_trajectories(synthetic_rows("r", 1, 4))  # schema merge adds the columns
    t = lake.read("trajectories").sort_by("iteration")
    assert t.column("engine").to_pylist() == [None] * 4 + ["torch"] * 4
    assert lake.read("trajectories", as_of=0).column("finish_reason").null_count == 4
    # extra columns written by newer code are kept, older rows read null
    lake.append_trajectories([dict(r, judge="gpt") for r in synthetic_rows("r", 2, 2)])
    assert lake.read("trajectories", columns=["judge"]).column(0).null_count == 8


def test_compact_keeps_rows_and_slices_vacuum_and_history(lake):
    versions = [lake.append_trajectories(synthetic_rows("r", i, 16)) for i in range(6)]
    before = lake.training_slice("r", 2, 4)
    files_before = len(DeltaTable(lake.table_uri("trajectories")).file_uris())
    metrics = compact(lake, max_row_group_size=8)
    assert metrics["numFilesRemoved"] == files_before and metrics["numFilesAdded"] < files_before
    after = lake.training_slice("r", 2, 4)
    assert uids(after) == uids(before) and slice_lake_version(after) == metrics["version"]
    import pyarrow.parquet as pq
    for uri in DeltaTable(lake.table_uri("trajectories")).file_uris():
        assert pq.ParquetFile(uri).metadata.row_group(0).num_rows <= 8
    ops = [h["operation"] for h in history(lake)]
    assert ops[0] == "OPTIMIZE" and ops.count("WRITE") == 6
    assert lake.read("trajectories", as_of=versions[2]).num_rows == 48
    assert vacuum(lake, retention_hours=168) == []  # everything is newer than a week
    removed = vacuum(lake, retention_hours=0)
    assert len(removed) == files_before
    assert lake.read("trajectories").num_rows == 96
    with pytest.raises(ValueError, match="vacuum"):
        lake.read("trajectories", as_of=versions[2])
    with pytest.raises(ValueError, match="does not exist"):
        compact(lake, "evals")


def test_compaction_sorts_only_partitions_with_more_than_one_file(lake):
    """A compacted partition is left alone by the next compaction: delta-rs's Z-order rewrote
    each one every time (1 file in, 1 out), so each of `rlake serve`'s compactions (every 6 h)
    kept another copy of every finished run's rows on disk until vacuum (7 days): review,
    2026-11-29. A partition with new files is sorted again, alone."""
    for run in ("a", "b"):
        for i in range(3):
            lake.append_trajectories(synthetic_rows(run, i, 8))
    first = compact(lake)
    assert (first["partitionsOptimized"], first["numFilesRemoved"]) == (2, 6)
    again = compact(lake)
    assert (again["numFilesAdded"], again["numFilesRemoved"]) == (0, 0)
    assert again["version"] == first["version"]  # no commit at all
    lake.append_trajectories(synthetic_rows("b", 3, 8))
    third = compact(lake)
    assert (third["partitionsOptimized"], third["numFilesRemoved"], third["numFilesAdded"]) == (1, 2, 1)
    assert compact(lake, "trajectories", run_id="a")["numFilesRemoved"] == 0
    with pytest.raises(ValueError, match="run 'nosuch' has no rows in trajectories"):
        compact(lake, "trajectories", run_id="nosuch")  # it printed zero metrics, exit 0
    table = lake.read("trajectories")
    assert table.num_rows == 56 and len(set(table.column("sample_uid").to_pylist())) == 56
    # still sorted: run b's one file holds its rows by weight_version
    b = [r["weight_version"] for r in lake.training_slice("b", 0, unconsumed_only=False).to_pylist()]
    assert b == sorted(b)


def test_vacuum_removes_log_entries_past_the_log_retention(lake):
    """Nothing removed the Delta log's commits and checkpoints (each checkpoint lists every file
    of the table: a long run's log grew with the square of its commits). Vacuum removes those
    older than the table's log retention (30 days) that precede a checkpoint; time travel to one
    of them then says where the log starts."""
    import os

    from buffer.delta import CHECKPOINT_INTERVAL

    versions = [lake.append_trajectories(synthetic_rows("r", i, 4)) for i in range(2 * CHECKPOINT_INTERVAL + 3)]
    log = Path(lake.table_uri("trajectories")) / "_delta_log"
    entries = sorted(log.iterdir())
    assert vacuum(lake, retention_hours=168) == [] and sorted(log.iterdir()) == entries
    checkpoints = sorted(int(e.name[:20]) for e in entries if e.name.endswith(".checkpoint.parquet"))
    assert len(checkpoints) == 2
    forty_days_ago = time.time() - 40 * 86400
    for entry in entries:  # expired: everything up to the second checkpoint
        if entry.name[:20].isdigit() and int(entry.name[:20]) <= checkpoints[1]:
            os.utime(entry, (forty_days_ago, forty_days_ago))
    deleted = vacuum(lake, retention_hours=168)
    gone = {e.name for e in entries} - {e.name for e in log.iterdir()}
    # reported among the files deleted (it said "deleted 0 files")
    assert gone and [f for f in deleted if f.startswith("_delta_log/")] == [
        f"_delta_log/{name}" for name in sorted(gone)]
    left = sorted(int(e.name[:20]) for e in log.iterdir() if e.name.endswith(".json"))
    assert left == list(range(checkpoints[1], versions[-1] + 1))  # from the last expired checkpoint
    assert lake.read("trajectories").num_rows == 4 * len(versions)
    appended_by = checkpoints[1] - versions[0] + 1
    assert lake.read("trajectories", as_of=checkpoints[1]).num_rows == 4 * appended_by
    with pytest.raises(ValueError, match=rf"trajectories has no version {versions[0]} any more: its "
                                         rf"log starts at version {checkpoints[1]}"):
        lake.read("trajectories", as_of=versions[0])
    # a time: the version then, while the log reaches back to it; before that, deltalake loaded
    # the oldest version left and the read answered with it, silently (review, 2026-11-29)
    def days_ago(days: float) -> str:
        return datetime.fromtimestamp(time.time() - days * 86400, UTC).isoformat()

    assert lake.read("trajectories", as_of=days_ago(39)).num_rows == 4 * appended_by
    with pytest.raises(ValueError, match=rf"trajectories has no version as of .* any more: its log "
                                         rf"starts at version {checkpoints[1]}, committed later"):
        lake.read("trajectories", as_of=days_ago(41))
    with pytest.raises(ValueError, match="committed later"):
        sql(lake, "SELECT count(*) FROM trajectories", as_of=days_ago(41))


def test_vacuum_leaves_a_live_writers_file_until_it_is_an_hour_old(lake):
    """A file no commit names yet may be a writer's whose commit has not landed: a vacuum with
    retention 0 beside a running append deleted it, and the commit then named a missing file."""
    import os
    import shutil

    lake.append_trajectories(synthetic_rows("r", 0, 4))
    folder = Path(lake.table_uri("trajectories")) / "run_id=r"
    written = next(folder.glob("*.parquet"))
    fresh, old = folder / "part-in-flight.parquet", folder / "part-left-by-a-crash.parquet"
    for copy in (fresh, old):
        shutil.copy(written, copy)
    two_hours_ago = time.time() - 2 * 3600
    os.utime(old, (two_hours_ago, two_hours_ago))
    assert vacuum(lake, retention_hours=0) == ["run_id=r/part-left-by-a-crash.parquet"]
    assert fresh.exists() and not old.exists()
    assert lake.read("trajectories").num_rows == 4


def test_run_ids_with_special_characters(lake):
    rid = "a b/c:d%e=f'g"
    assert lake.append_trajectories(synthetic_rows(rid, 0, 3)) is not None
    assert lake.append_trajectories(synthetic_rows(rid, 0, 3)) is None
    lake.append_trajectories(synthetic_rows("plain", 0, 2))
    assert lake.training_slice(rid, 0).num_rows == 3
    assert lake.read("trajectories", run_id=rid).num_rows == 3
    lake.upsert_run({"run_id": rid, "status": "running"})
    lake.upsert_run({"run_id": rid, "status": "done"})
    assert lake.get_run(rid)["status"] == "done" and lake.read("runs").num_rows == 1


def test_steps_without_base_version_still_exclude_their_samples(lake):
    lake.append_trajectories(synthetic_rows("r", 0, 4, weight_version=5))
    lake.append_train_step({"run_id": "r", "step": 0, "sample_uids": ["r/0/1"]})  # no base_version
    lake.append_train_step({"run_id": "r", "step": 1, "base_version": 2, "sample_uids": []})
    assert lake.training_slice("r", 5).column("sample_uid").to_pylist() == ["r/0/0", "r/0/2", "r/0/3"]
    assert lake.training_slice("other", 0).num_rows == 0


def test_object_store_code_path(tmp_path, monkeypatch):
    """The non-local path (deltalake's own filesystem handler, no local freshness shortcut),
    exercised on a local folder since no object store is reachable here."""
    from buffer import delta

    lake = Lake(str(tmp_path / "lake"))
    monkeypatch.setattr(delta, "is_local", lambda uri: False)
    assert lake.append_trajectories(synthetic_rows("r", 0, 6)) is not None
    assert lake.append_trajectories(synthetic_rows("r", 0, 6)) is None
    other = Lake(lake.uri)
    other.append_trajectories(synthetic_rows("r", 1, 6))  # seen by the first lake object
    assert lake.training_slice("r", 1).num_rows == 6
    assert lake.sql("SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [12]


def test_readme_documents_the_current_schema():
    from buffer.schema import schema_markdown

    readme = Path(__file__).resolve().parents[1] / "buffer" / "README.md"
    assert schema_markdown() in readme.read_text(), "regenerate the schema section of buffer/README.md"


def test_lineage_of_a_run_the_lake_does_not_hold_says_so(lake):
    """It said "has no train step producing weight version 1; versions: []" (review, 2026-11-29)."""
    from infra.lineage import version_lineage

    lake.append_trajectories(synthetic_rows("r", 0, 2))
    lake.upsert_run({"run_id": "r", "status": "running", "config": "{}"})
    with pytest.raises(ValueError, match="no run 'nosuch' in the lake at"):
        version_lineage(lake, "nosuch", 1)
    with pytest.raises(ValueError, match="run 'r' has no train step producing weight version 1"):
        version_lineage(lake, "r", 1)


def test_the_light_table_names_are_the_schemas_tables():
    """``buffer.names.TABLE_NAMES`` (the CLI's choices, read without pyarrow) names the tables
    ``buffer.schema.TABLES`` defines, in its order."""
    from buffer.names import TABLE_NAMES
    from buffer.schema import TABLES

    assert TABLE_NAMES == tuple(TABLES)
