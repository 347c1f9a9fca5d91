"""Delta-table plumbing: create-on-first-use, idempotent inserts with conflict retry, predicates.

Idempotence and concurrency (appends): check-then-append made safe by Delta application
transactions. A writer reads the table state, drops the batch's rows whose key already exists
(reading only the files whose statistics can hold the batch's keys), and appends the rest in one
commit that carries a ``txn`` action per key scope of the batch (``trajectories/{run_id}/{iteration}``).
Two writers of the same scope conflict in delta-rs's conflict checker (``CommitFailedError``,
"Concurrent transaction"): the loser re-reads, re-checks and appends only what is still missing.
Writers of different scopes never conflict (delta-rs rebases their commits). Measured here: an
insert-only MERGE on the key gives the same guarantee but costs 1.4-1.6x as much per 512-row batch
(it is kept for the ``runs`` upsert); the guarded append costs delta-rs's plain append (~12 ms CPU
for 512 rows) plus ~1-3 ms for the key check. An interrupted writer leaves only unreferenced Parquet files (removed by
``vacuum``); its commit is all-or-nothing.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset  # noqa: F401  (pa.dataset)
import pyarrow.fs as pa_fs
from deltalake import CommitProperties, DeltaTable, Transaction, WriterProperties, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from buffer.schema import KEYS, PARTITIONS, SCHEMA_VERSION, SCHEMA_VERSION_KEY, arrow_schema
from buffer.uris import is_local, local_path
from infra.faults import fault_armed, fault_point

MAX_ATTEMPTS = 200
GUARDS_KEY = "rlake.guards"
ROW_GROUP_SIZE = 2048
# delta-rs lists files slowly from JSON commits (~1-2 ms per commit since the last checkpoint, per
# call) and fast from a checkpoint: checkpoint often, and reopen cached tables after as many commits.
CHECKPOINT_INTERVAL = 10
# Each txn action carries its ``lastUpdated`` (``guarded_append``): without it delta-rs never
# expires one, and every checkpoint listed one txn per commit the table ever had.
TXN_RETENTION = "interval 1 hour"
TABLE_PROPERTIES = {
    "delta.checkpointInterval": str(CHECKPOINT_INTERVAL),
    # txn ids only matter to commits racing each other (seconds apart; the conflict checker reads
    # the racing commits themselves, not the checkpoint): let checkpoints drop them after an hour
    "delta.setTransactionRetentionDuration": TXN_RETENTION,
}
# Delta-log statistics only on the columns whose files are pruned (``to_dataset`` conditions,
# ``scope_filter``'s key scopes, the ``runs`` MERGE predicate) and a few short ones a reader may
# filter on: every checkpoint repeats each file's statistics, and min/max of the long JSON and
# text columns (train_steps.metrics, runs.config) made a train_steps entry ~1.5 kB.
# A column left out here is never pruned on (``_keep_mask`` keeps files without statistics).
STATS_COLUMNS = {
    "trajectories": "sample_uid,run_id,iteration,weight_version,group_index,sample_index,kind,"
                    "reward,status,engine,created_at",
    "train_steps": "run_id,step,iteration,base_version,weight_version,lake_version,created_at",
    "evals": "run_id,weight_version,iteration,dataset,metric,created_at",
    "runs": "run_id,status,created_at,updated_at",
}
UPGRADE_ATTEMPTS = 10


def table_properties(name: str) -> dict[str, str]:
    """Delta properties a lake table is created with (and ``upgrade_properties`` brings to)."""
    props = dict(TABLE_PROPERTIES)
    if name in STATS_COLUMNS:
        props["delta.dataSkippingStatsColumns"] = STATS_COLUMNS[name]
    return props


def stale_properties(dt: DeltaTable, name: str) -> dict[str, str]:
    """The properties of ``table_properties(name)`` that ``dt``'s configuration lacks or differs on."""
    config = dt.metadata().configuration
    return {k: v for k, v in table_properties(name).items() if config.get(k) != v}


def upgrade_properties(dt: DeltaTable, name: str) -> bool:
    """Bring an existing table's Delta properties up to ``table_properties(name)`` (a table an
    older rlake created keeps its old ones otherwise): one metadata commit, made only when one
    differs. A concurrent commit (another writer's append, or its own upgrade) fails ours with
    ``CommitFailedError``: re-read and retry; after ``UPGRADE_ATTEMPTS`` it is left for the next
    open (False). Concurrent appends fail once on the metadata change and retry. Files written
    before keep their statistics until ``compact`` rewrites them. True when the table is up to
    date. Writes: call it only where the caller writes anyway (never from a read)."""
    for attempt in range(UPGRADE_ATTEMPTS):
        stale = stale_properties(dt, name)
        if not stale:
            return True
        try:
            dt.alter.set_table_properties(stale, raise_if_not_exists=False, commit_properties=CommitProperties(
                custom_metadata={"rlake.operation": "upgrade_properties"}))
        except CommitFailedError:
            time.sleep(backoff(attempt))
            dt.update_incremental()
    return not stale_properties(dt, name)


def normalize_uri(uri: str) -> str:
    """Absolute path for local lakes (``file://`` stripped), the URI unchanged otherwise; a local
    path deltalake cannot use is refused (``check_local_path``)."""
    if not uri:
        raise ValueError("lake_uri is empty")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if is_local(uri):
        path = os.path.abspath(os.path.expanduser(uri))
        check_local_path(path)
        return path
    return uri.rstrip("/")


def check_local_path(path: str) -> None:
    """A ValueError for a local lake path holding ``%``: deltalake percent-decodes the paths it
    is given, also ``file://`` URIs with the ``%`` encoded (``a%20b`` is read and written as
    ``a b``, deltalake 1.6), so a lake there fails at its first commit or read."""
    if "%" in path:
        raise ValueError(f"lake path '{path}' contains '%', which the lake's Delta library reads "
                         "as an escape (a%20b as 'a b'): use a home or lake_uri without '%'")


def sql_literal(value: Any) -> str:
    """A SQL literal for a predicate: strings quoted with ``'`` doubled, ints as ints.

    Anything else is refused so that a predicate can never be injected through a value.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"unsupported predicate literal {value!r}")
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    raise ValueError(f"unsupported predicate literal {value!r}")


Condition = tuple[str, str, Any]  # (column, op, value); op: = >= <= in; a "|null" suffix keeps nulls


def _keep_mask(actions: pa.Table, column: str, op: str, value: Any, partitions: list[str]) -> pa.Array:
    """Files that may hold a row with ``column op value`` (never drops a file that could match).

    Partition column: exact on the partition value (``in``: any of a list). Data column: ``>=`` keeps files with
    ``max >= value``, ``<=`` those with ``min <= value``, ``=`` both; missing statistics keep the
    file. ``op`` ending in ``|null`` also keeps files with nulls in ``column``.
    """
    base_op, _, nulls = op.partition("|")
    n = actions.num_rows
    if column in partitions:
        values = actions.column(f"partition.{column}")
        wanted = list(value) if base_op == "in" else [value]
        keep = pc.fill_null(pc.is_in(values, value_set=pa.array(wanted, values.type)), False)
        return pc.or_(keep, pc.is_null(values)) if nulls else keep
    if base_op == "in":  # a data column: the values' range
        return pc.and_(_keep_mask(actions, column, ">=", min(value), partitions),
                       _keep_mask(actions, column, "<=", max(value), partitions))
    lo = f"min.{column}" in actions.column_names and actions.column(f"min.{column}")
    hi = f"max.{column}" in actions.column_names and actions.column(f"max.{column}")
    keep = pa.array([True] * n)
    if base_op in (">=", "=") and hi is not False:
        keep = pc.and_(keep, pc.fill_null(pc.greater_equal(hi, pa.scalar(value, hi.type)), True))
    if base_op in ("<=", "=") and lo is not False:
        keep = pc.and_(keep, pc.fill_null(pc.less_equal(lo, pa.scalar(value, lo.type)), True))
    if nulls and f"null_count.{column}" in actions.column_names:
        keep = pc.or_(keep, pc.fill_null(pc.greater(actions.column(f"null_count.{column}"), 0), True))
    return keep


def _filesystem(dt: DeltaTable) -> pa_fs.FileSystem:
    uri = dt.table_uri
    if is_local(uri):
        return pa_fs.SubTreeFileSystem(local_path(uri), pa_fs.LocalFileSystem())
    from deltalake.fs import DeltaStorageHandler

    return pa_fs.PyFileSystem(DeltaStorageHandler.from_table(
        dt._table, dt._storage_options, dt._table.get_add_file_sizes()))


def to_dataset(dt: DeltaTable, conditions: list[Condition] | None = None) -> pa.dataset.Dataset:
    """An Arrow dataset over the files of ``dt`` whose Delta-log statistics may match ``conditions``.

    File pruning is done here on ``get_add_actions`` (vectorized, ~1 ms for 1000 files) rather than
    by deltalake's predicate pruning (~10 ms and more per call on these tables). Fragments carry
    only their partition value; Parquet row-group statistics prune further at scan time. Local
    tables are read with Arrow's native filesystem (faster than deltalake's Python-level handler,
    and it leaves no Python-backed IO threads at exit); object stores go through deltalake's
    handler and the table's storage options.
    """
    protocol = dt.protocol()
    if protocol.reader_features and {"deletionVectors", "columnMapping"} & set(protocol.reader_features):
        raise ValueError(f"{dt.table_uri}: reader features {protocol.reader_features} are not supported")
    schema = pa.schema(dt.schema().to_arrow())
    partitions = dt.metadata().partition_columns
    actions = pa.table(dt.get_add_actions(flatten=True))
    if conditions and actions.num_rows:
        mask = pa.array([True] * actions.num_rows)
        for column, op, value in conditions:
            mask = pc.and_(mask, _keep_mask(actions, column, op, value, partitions))
        actions = actions.filter(mask)
    fs = _filesystem(dt)
    fmt = pa.dataset.ParquetFileFormat(
        default_fragment_scan_options=pa.dataset.ParquetFragmentScanOptions(pre_buffer=True))
    paths = actions.column("path").to_pylist()
    part_values = {p: actions.column(f"partition.{p}").to_pylist() for p in partitions}
    fragments = []
    for i, path in enumerate(paths):
        expr = pc.scalar(True)
        for p in partitions:
            v = part_values[p][i]
            expr = expr & (pc.field(p).is_null() if v is None else pc.field(p) == pa.scalar(v, schema.field(p).type))
        fragments.append(fmt.make_fragment(unquote(path), filesystem=fs, partition_expression=expr))
    return pa.dataset.FileSystemDataset(fragments, schema, fmt, fs)


def writer_properties(max_row_group_size: int = ROW_GROUP_SIZE) -> WriterProperties:
    """Parquet settings for rewritten files: ZSTD, row groups of at most ``max_row_group_size`` rows."""
    return WriterProperties(compression="ZSTD", max_row_group_size=max_row_group_size)


def open_table(uri: str, storage_options: dict | None, version: int | None = None) -> DeltaTable | None:
    """The Delta table at ``uri`` (optionally at ``version``), or None if none exists there."""
    try:
        return DeltaTable(uri, version=version, storage_options=storage_options)
    except TableNotFoundError:
        return None


def create_table(uri: str, name: str, storage_options: dict | None) -> DeltaTable:
    """Create lake table ``name`` at ``uri`` if absent (race-safe) and return it."""
    if is_local(uri):
        os.makedirs(uri, exist_ok=True)
    for attempt in range(20):
        dt = open_table(uri, storage_options)
        if dt is not None:
            return dt
        try:
            dt = DeltaTable.create(
                uri,
                schema=arrow_schema(name),
                mode="ignore",
                partition_by=PARTITIONS.get(name),
                name=name,
                description=f"rlake {name} (schema version {SCHEMA_VERSION})",
                configuration=table_properties(name),
                storage_options=storage_options,
            )
            set_schema_version(dt)
            return dt
        except (CommitFailedError, DeltaError):
            time.sleep(0.01 * (attempt + 1))  # another process created it first: open it
    dt = open_table(uri, storage_options)
    if dt is None:
        raise RuntimeError(f"could not create lake table {name!r} at {uri}")
    return dt


def set_schema_version(dt: DeltaTable) -> None:
    """Record ``SCHEMA_VERSION`` in the table's Delta configuration (``rlake.schemaVersion``).

    delta-rs refuses unknown properties at create time, so they are set by a metadata commit.
    """
    if dt.metadata().configuration.get(SCHEMA_VERSION_KEY) != str(SCHEMA_VERSION):
        dt.alter.set_table_properties({SCHEMA_VERSION_KEY: str(SCHEMA_VERSION)}, raise_if_not_exists=False)


def dedup_on_key(data: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Keep the first row of each key within one batch."""
    seen: set[tuple] = set()
    keep = []
    cols = [data.column(k).to_pylist() for k in keys]
    for i, key in enumerate(zip(*cols, strict=True)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return data if len(keep) == data.num_rows else data.take(keep)


def backoff(attempt: int) -> float:
    """Sleep seconds before retry ``attempt``: ``min(0.5, 0.005 * 2**attempt) * U(0.5, 1.5)``."""
    return min(0.5, 0.005 * 2 ** min(attempt, 10)) * random.uniform(0.5, 1.5)


def existing_keys(dt: DeltaTable, keys: tuple[str, ...], prune: list[Condition],
                  row_filter: pc.Expression) -> set[tuple]:
    """Keys already in ``dt`` among the rows matching ``row_filter``, reading only files ``prune`` keeps."""
    ds = to_dataset(dt, prune)
    found = ds.to_table(columns=list(keys), filter=row_filter)
    return set(zip(*(found.column(k).to_pylist() for k in keys), strict=True))


def without_keys(data: pa.Table, keys: tuple[str, ...], present: set[tuple]) -> pa.Table:
    """Rows of ``data`` whose key is not in ``present``."""
    if not present:
        return data
    if len(keys) == 1:
        values = pa.array([k[0] for k in present], data.column(keys[0]).type)
        return data.filter(pc.invert(pc.is_in(data.column(keys[0]), value_set=values)))
    cols = [data.column(k).to_pylist() for k in keys]
    keep = [i for i, key in enumerate(zip(*cols, strict=True)) if key not in present]
    return data.take(pa.array(keep, pa.int64()))


def guarded_append(
    get_table: Callable[[], DeltaTable],
    name: str,
    data: pa.Table,
    guards: list[str],
    prune: list[Condition],
    row_filter: pc.Expression,
    commit_info: dict[str, str] | None = None,
) -> int | None:
    """Append the rows of ``data`` whose key is absent, exactly once, even under concurrency.

    Optimistic concurrency: read the table state, find which keys of the batch exist among the
    rows the batch could collide with (``prune``: file-pruning conditions, ``row_filter``: exact
    filter), and append the rest as one commit carrying a Delta application transaction
    (``txn`` action) for every ``guards`` id (version: a nanosecond timestamp). A concurrent commit carrying
    the same guard id makes ours fail with ``CommitFailedError``; we then re-read and re-check.
    Guards name the batch's key scope (e.g. ``trajectories/{run_id}/{iteration}``), so writers
    of different scopes never conflict. Returns the committed version, or None if nothing was new.
    The commit's custom metadata names the guards (``rlake.guards``, JSON) and adds
    ``commit_info``: what must be durable together with the rows (see ``find_commit_info``).
    """
    keys = KEYS[name]
    last: Exception | None = None
    for attempt in range(MAX_ATTEMPTS):
        dt = get_table()
        new = without_keys(data, keys, existing_keys(dt, keys, prune, row_filter))
        if new.num_rows == 0:
            return None
        # The txn version is a timestamp: conflicts are detected on the app id alone, and reading
        # the last version back (``dt.transaction_version``) costs ~4 ms and grows with the log.
        # ``last_updated`` (ms) lets checkpoints drop the txn after TXN_RETENTION (never without it)
        stamp = time.time_ns()
        txns = [Transaction(g, stamp, stamp // 1_000_000) for g in guards]
        props = CommitProperties(custom_metadata={"rlake.operation": f"append_{name}",
                                                  "rlake.rows": new.num_rows,
                                                  GUARDS_KEY: json.dumps(guards), **(commit_info or {})},
                                 app_transactions=txns)
        source = stream_with_fault(new) if name == "trajectories" and fault_armed(MID_APPEND) else new
        try:
            write_deltalake(dt, source, mode="append", schema_mode="merge", commit_properties=props)
        except CommitFailedError as e:
            last = e
            time.sleep(backoff(attempt))
            continue
        return dt.version()
    raise RuntimeError(f"{name}: gave up after {MAX_ATTEMPTS} conflicting commits: {last}")


MID_APPEND = "during_lake_append"


def stream_with_fault(data: pa.Table) -> pa.RecordBatchReader:
    """``data`` as a stream of two halves that kills the process (``MID_APPEND``) when the
    writer asks for the second half: the kill lands inside the Delta write by construction."""
    half = max(1, data.num_rows // 2)

    def batches():
        first, *rest = data.combine_chunks().to_batches(max_chunksize=half)
        yield first
        fault_point(MID_APPEND)
        yield from rest
    return pa.RecordBatchReader.from_batches(data.schema, batches())


def find_commit_info(dt: DeltaTable, guard: str, page: int = 100) -> dict | None:
    """The custom metadata of the newest commit whose ``rlake.guards`` name ``guard``, or None
    (never written, or its log entry is past the table's log retention). Reads the log newest
    first, ``page`` commits at a time: cheap when the commit is recent (a resume)."""
    newest = dt.version()
    limit = page
    while True:
        history = dt.history(limit)
        for entry in history:
            if guard in json.loads(entry.get(GUARDS_KEY) or "[]"):
                return entry
        if len(history) < limit or limit > newest:
            return None
        limit *= 4


def merge_upsert(
    get_table: Callable[[], DeltaTable],
    name: str,
    data: pa.Table,
    scope: str,
    update_columns: list[str],
) -> int | None:
    """Insert rows whose key is absent; set ``update_columns`` from the source where present.

    One Delta MERGE (``scope``: predicate on target alias ``t`` true for every row of the batch,
    used for file pruning); conflicting commits are retried. Returns the version or None.
    """
    on = " AND ".join(f"t.{k} = s.{k}" for k in KEYS[name])
    predicate = f"({scope}) AND {on}" if scope else on
    props = CommitProperties(custom_metadata={"rlake.operation": f"upsert_{name}"})
    last: Exception | None = None
    for attempt in range(MAX_ATTEMPTS):
        dt = get_table()
        try:
            merger = dt.merge(data, predicate=predicate, source_alias="s", target_alias="t",
                              merge_schema=True, streamed_exec=False, commit_properties=props)
            if update_columns:
                merger = merger.when_matched_update({c: f"s.{c}" for c in update_columns})
            metrics = merger.when_not_matched_insert_all().execute()
        except CommitFailedError as e:
            last = e
            time.sleep(backoff(attempt))
            continue
        changed = metrics.get("num_target_rows_inserted", 0) + metrics.get("num_target_rows_updated", 0)
        return dt.version() if changed else None
    raise RuntimeError(f"{name}: gave up after {MAX_ATTEMPTS} conflicting commits: {last}")
