"""Lake maintenance: compaction, vacuum, history.

Appends write one small file per batch; ``compact`` rewrites a table's small files into larger
ones whose Parquet row groups stay small (``max_row_group_size``), so slice reads keep skipping
row groups by statistics. By default it also sorts the rewritten data by the table's slice column
(``weight_version`` for trajectories; a one-column Z-order is a sort) so row-group min/max
statistics stay tight. (A Z-order over two columns interleaves them and leaves every row group
spanning most versions: measured, slices then read everything.) Compaction changes
no data (``dataChange=false``): concurrent appends and slices are unaffected.

``vacuum`` deletes files no longer referenced by versions newer than the retention period
(default 7 days) and files never committed (left by an interrupted writer) once they are an hour
old, whatever the retention (younger, one may be a live writer's whose commit has not landed).
Time travel to a version whose files were vacuumed is no longer possible. It also removes the
table's log entries (JSON commits and checkpoints) older than the table's log retention
(``delta.logRetentionDuration``, Delta's 30 days by default) that precede a checkpoint: nothing
else ever removed them, and with a checkpoint every ``CHECKPOINT_INTERVAL`` commits, each
listing every file of the table, a long run's log grew with the square of its commits.
"""

from __future__ import annotations

import fcntl
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from buffer.delta import ROW_GROUP_SIZE, is_local, local_path, upgrade_properties, writer_properties
from buffer.lake import Lake
from buffer.names import DEFAULT_RETENTION_HOURS

# an unreferenced file younger than this may be a live writer's, its commit not landed yet
ORPHAN_MIN_HOURS = 1
# Measured on 1000 iterations x 512 rows: 16 MB files keep a slice at ~20 ms after compaction; one
# 128 MB file makes every slice parse a large footer.
TARGET_FILE_SIZE = 16 * 1024 * 1024
# A train_steps row carries every consumed sample_uid: small row groups let the consumed-sample
# lookup read only recent steps.
ROW_GROUP_ROWS = {"train_steps": 64}
SORT_COLUMNS: dict[str, list[str]] = {
    "trajectories": ["weight_version"],
    "train_steps": ["base_version"],
    "evals": ["weight_version"],
}


def _partition_files(dt) -> Counter | None:
    """Files per ``run_id`` partition of ``dt``; None for an unpartitioned table."""
    actions = pa.table(dt.get_add_actions(flatten=True))
    column = "partition.run_id"
    if column not in actions.column_names:
        return None
    return Counter(actions.column(column).to_pylist())


def partitions_to_sort(dt, counts: Counter | None, run_id: str | None) -> list[str | None]:
    """The partitions (``run_id`` values; ``[None]``: the whole of an unpartitioned table) with
    more than one file (``counts``: ``_partition_files(dt)``), of those ``run_id`` names (None:
    all). One file is as a compaction left it, or one batch: delta-rs's Z-order rewrote such a
    partition at every compaction, so each of ``rlake serve``'s (every 6 h) kept another copy of
    every finished run's rows until vacuum (7 days) (review, 2026-11-29)."""
    if counts is None:  # not partitioned
        return [None] if len(dt.file_uris()) > 1 else []
    return sorted(r for r, n in counts.items() if n > 1 and (run_id is None or r == run_id))


def _sorted_compaction(dt, cols: list[str], partitions: list[str | None], target_size: int,
                       props) -> dict[str, Any]:
    """A one-column Z-order (a sort) of each of ``partitions`` (``partitions_to_sort``), one
    commit each; the metrics summed (``partitionsOptimized``: how many)."""
    totals: dict[str, Any] = {"numFilesAdded": 0, "numFilesRemoved": 0, "partitionsOptimized": 0}
    for partition in partitions:
        parts = None if partition is None else [("run_id", "=", partition)]
        metrics = dt.optimize.z_order(cols, partition_filters=parts, target_size=target_size,
                                      writer_properties=props)
        for key in ("numFilesAdded", "numFilesRemoved"):
            totals[key] += metrics[key]
        totals["partitionsOptimized"] += 1
    return totals


def _table_or_error(lake: Lake, table: str):
    dt = lake._table(table)
    if dt is None:
        raise ValueError(f"lake table {table!r} does not exist under {lake.uri}")
    return dt


@contextmanager
def compaction_lock(lake: Lake, table: str) -> Iterator[None]:
    """Hold ``table``'s compaction lock (``{lake}/.{table}.compaction.lock``, a lock across
    processes), waiting for one another process holds. Two compactions of one table at once
    both landed (delta-rs takes the second rewrite of the same files as a commit of its own):
    every row twice, and a resume then trained on each sample twice or refused to continue
    (review, 2026-11-29). An object-store lake has no such lock: run one compaction at a time."""
    if not is_local(lake.uri):
        yield
        return
    root = local_path(lake.uri)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{table}.compaction.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def compact(lake: Lake, table: str = "trajectories", run_id: str | None = None,
            max_row_group_size: int | None = None, target_size: int = TARGET_FILE_SIZE,
            sort: bool = True, checkpoint: bool = True) -> dict[str, Any]:
    """Rewrite ``table``'s small files (one run's partition if ``run_id``); return the metrics.

    ``max_row_group_size`` defaults to ``ROW_GROUP_ROWS`` for the table, else ``ROW_GROUP_SIZE``.
    ``sort`` orders rewritten rows by ``SORT_COLUMNS[table]`` (a one-column Z-order, i.e. a sort)
    in each partition with more than one file (``partitions_to_sort``: one commit each, and none
    when every partition is one file); otherwise files are bin-packed as they are.
    ``checkpoint`` writes a Delta checkpoint after, so opening the table reads one Parquet file
    instead of every JSON commit. A table an older
    rlake created gets the current Delta properties first (``delta.upgrade_properties``).
    """
    with lake._lock, compaction_lock(lake, table):
        dt = _table_or_error(lake, table)  # as it is now: another compaction may have ended
        # a table an older rlake created: current properties first, so the rewritten files carry
        # statistics only on STATS_COLUMNS (the checkpoint after lists them, smaller)
        upgrade_properties(dt, table)
        props = writer_properties(max_row_group_size or ROW_GROUP_ROWS.get(table, ROW_GROUP_SIZE))
        parts = [("run_id", "=", run_id)] if run_id is not None and table == "trajectories" else None
        counts = _partition_files(dt)
        if parts and run_id not in (counts or {}):  # it said nothing, exit 0
            raise ValueError(f"run {run_id!r} has no rows in {table}: nothing to compact")
        cols = SORT_COLUMNS.get(table) if sort else None
        if cols:
            metrics = _sorted_compaction(dt, cols, partitions_to_sort(dt, counts, run_id),
                                         target_size, props)
        else:
            metrics = dt.optimize.compact(partition_filters=parts, target_size=target_size,
                                          writer_properties=props)
        if checkpoint:
            dt.create_checkpoint()
        return {"table": table, "version": dt.version(), **metrics}


def vacuum(lake: Lake, table: str = "trajectories", retention_hours: int = DEFAULT_RETENTION_HOURS,
           dry_run: bool = False) -> list[str]:
    """Delete files removed from the table more than ``retention_hours`` ago, and files no
    commit names older than ``max(retention_hours, ORPHAN_MIN_HOURS)``, then the log's entries
    past its retention (``_clean_log``); returns the files (to be) deleted, the log's
    (``_delta_log/...``) last (a dry run lists data files only).

    A retention under the table's ``delta.deletedFileRetentionDuration`` (7 days by default) is
    accepted: the caller chose it explicitly.
    """
    if retention_hours < 0:
        raise ValueError(f"retention_hours must be >= 0, got {retention_hours}")
    with lake._lock:
        dt = _table_or_error(lake, table)

        def expired(dry: bool) -> list[str]:
            removed = dt.vacuum(retention_hours=retention_hours, dry_run=dry,
                                enforce_retention_duration=False, full=False)
            # files no commit names: a writer's file is one until its commit lands (a run
            # appending beside this), so only those older than ORPHAN_MIN_HOURS go
            orphans = dt.vacuum(retention_hours=max(retention_hours, ORPHAN_MIN_HOURS),
                                dry_run=dry, enforce_retention_duration=False, full=True)
            return list(dict.fromkeys([*removed, *orphans]))

        # delta-rs names every expired tombstone, also one an earlier vacuum deleted: a local
        # table's list is the files still there (each vacuum said "deleted 32 files" again)
        files = _still_there(lake, table, expired(dry=True)) if is_local(lake.uri) else None
        if dry_run:
            return files if files is not None else expired(dry=True)
        deleted = expired(dry=False)
        return (files if files is not None else deleted) + _clean_log(lake, table, dt)


def _clean_log(lake: Lake, table: str, dt) -> list[str]:
    """Remove the log's entries past its retention (``cleanup_metadata``); the ones removed
    (``_delta_log/...``: vacuum said "deleted 0 files" when it removed only those), known for a
    local table only."""
    log = os.path.join(local_path(lake.table_uri(table)), "_delta_log") if is_local(lake.uri) else None
    before = set(os.listdir(log)) if log else set()
    dt.cleanup_metadata()
    return [f"_delta_log/{name}" for name in sorted(before - set(os.listdir(log)))] if log else []


def _still_there(lake: Lake, table: str, files: list[str]) -> list[str]:
    """The files of ``files`` (relative to the table, maybe %-encoded) that exist."""
    root = local_path(lake.table_uri(table))
    return [f for f in files
            if os.path.exists(os.path.join(root, f)) or os.path.exists(os.path.join(root, unquote(f)))]


def history(lake: Lake, table: str = "trajectories", limit: int | None = None) -> list[dict[str, Any]]:
    """The table's commits, newest first: version, timestamp (UTC ISO), operation, parameters, metrics."""
    with lake._lock:
        dt = _table_or_error(lake, table)
        out = []
        for entry in dt.history(limit):
            ts = entry.get("timestamp")
            out.append({
                "version": entry.get("version"),
                "timestamp": datetime.fromtimestamp(ts / 1000, UTC).isoformat() if ts else None,
                "operation": entry.get("operation"),
                **{k: v for k, v in entry.items() if k not in ("version", "timestamp", "operation")},
            })
        return out
