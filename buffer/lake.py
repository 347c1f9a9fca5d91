"""The lake: four Delta tables under one root, idempotent appends, staleness slices, time travel.

    lake = Lake("/path/to/lake")                     # or "s3://bucket/lake", storage_options={...}
    v = lake.append_trajectories(rows)               # Delta version written, None if nothing new
    batch = lake.training_slice(run_id, min_version=v - k)

Every append is one Delta commit made by an insert-only MERGE on the table's key (see
``buffer.delta``): writing the same rows twice, or from several processes at once, leaves exactly one
copy of each key. Nothing is ever deleted by this class.

One ``Lake`` object may be shared by threads (operations are serialized by a lock). Processes must
each open their own (``deltalake``'s runtime does not survive ``fork``: use the ``spawn`` start
method for process pools that touch the lake).
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset  # noqa: F401  (pa.dataset)
from deltalake import DeltaTable

from buffer import delta
from buffer.schema import (
    KEYS,
    SCHEMA_VERSION_KEY,
    TABLES,
    arrow_schema,
    columns,
    conform,
    rows_to_table,
    uid_step,
)

LAKE_VERSION_KEY = b"rlake.lake_version"
SLICE_ORDER = [("weight_version", "ascending"), ("iteration", "ascending"), ("sample_index", "ascending")]


def parse_as_of(as_of: int | str | datetime | None) -> int | datetime | None:
    """A Delta version (int, or a string of digits) or a point in time (ISO 8601; naive = UTC)."""
    if as_of is None or isinstance(as_of, int | datetime):
        if isinstance(as_of, bool):
            raise ValueError(f"as_of must be a version or an ISO timestamp, not {as_of!r}")
        if isinstance(as_of, datetime) and as_of.tzinfo is None:
            return as_of.replace(tzinfo=UTC)
        return as_of
    text = str(as_of).strip()
    if text.isdigit():
        return int(text)
    try:
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"as_of {as_of!r} is neither a Delta version nor an ISO timestamp") from None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def first_logged_version(dt: DeltaTable) -> int | None:
    """The oldest version whose commit a local table's log still holds (None: not local)."""
    if not delta.is_local(dt.table_uri):
        return None
    log = os.path.join(delta.local_path(dt.table_uri), "_delta_log")
    versions = [int(name[:20]) for name in os.listdir(log) if name[:20].isdigit()
                and name.endswith(".json")]
    return min(versions, default=None)


VACUUMED_LOG = ("vacuum removes log entries older than the table's log retention, 30 days by "
                "default")


def _first_version_after(dt: DeltaTable, when: datetime) -> int | None:
    """The version ``dt`` was loaded at, if it is the oldest its log holds and was committed
    after ``when`` (the time of its commit file, which time travel goes by): ``when`` is before
    anything the log knows. None otherwise, and for a table that is not local."""
    first = first_logged_version(dt)
    if first is None or dt.version() != first:
        return None
    commit = os.path.join(delta.local_path(dt.table_uri), "_delta_log", f"{first:020d}.json")
    committed = datetime.fromtimestamp(os.path.getmtime(commit), UTC)
    return first if committed > when else None


def slice_lake_version(table: pa.Table) -> int | None:
    """The ``trajectories`` Delta version a ``training_slice`` result was read at."""
    meta = table.schema.metadata or {}
    return int(meta[LAKE_VERSION_KEY]) if LAKE_VERSION_KEY in meta else None


def slice_of_written(table: pa.Table, min_version: int, max_version: int | None = None,
                     lake_version: int | None = None) -> pa.Table:
    """What ``Lake.training_slice(run_id, min_version, max_version)`` returns right after
    ``table`` (one run's ``trajectories`` rows, in the declared schema) was appended, when the
    lake held no other unconsumed train row of the run in that range: the rows with kind
    ``train`` and ``min_version <= weight_version <= max_version``, in the declared schema,
    oldest first (``SLICE_ORDER``), ``lake_version`` in the schema metadata. A sync run that has
    trained on everything it wrote holds none (each step consumes its whole slice)."""
    keep = (pc.field("kind") == "train") & (pc.field("weight_version") >= int(min_version))
    if max_version is not None:
        keep &= pc.field("weight_version") <= int(max_version)
    data = conform(table.filter(keep), "trajectories").sort_by(SLICE_ORDER)
    return data if lake_version is None else with_lake_version(data, lake_version)


def with_lake_version(table: pa.Table, version: int) -> pa.Table:
    """``table`` with the ``trajectories`` version it was read at in its schema metadata
    (``slice_lake_version`` reads it back)."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          LAKE_VERSION_KEY: str(version).encode()})


def trajectory_guard(run_id: str, iteration: int, kind: str = "train") -> str:
    """The app-transaction id of ``(run_id, iteration)``'s trajectory appends of ``kind``.

    Rows of another kind (an evaluation of weight version ``iteration``) get their own, as their
    ``sample_uid`` does: sharing the rollout batch's, the newest commit naming it could be the
    evaluation's, without the batch's ``commit_info`` (async mode evaluates version b after
    batch b is in the lake)."""
    return f"rlake/trajectories/{run_id}/{uid_step(iteration, kind)}"


def scope_pairs(data: pa.Table, part: str, num: str) -> list[tuple[str, int]]:
    """Distinct (``part``, ``num``) pairs of a batch, e.g. (run_id, iteration), sorted."""
    if data.num_rows == 0:
        return []
    return sorted(set(zip(data.column(part).to_pylist(), data.column(num).to_pylist(), strict=True)))


def scope_filter(scopes: list[tuple[str, int]], part: str, num: str) -> tuple[list, pc.Expression]:
    """(file-pruning conditions, exact row filter) for the rows whose (part, num) is in ``scopes``.

    The conditions are ``part in {...}`` and ``lo <= num <= hi`` (a superset: file statistics only
    prune on bounds); the row filter is the exact OR over the pairs.
    """
    nums = [n for _, n in scopes]
    prune = [(part, "in", sorted({p for p, _ in scopes})), (num, ">=", min(nums)), (num, "<=", max(nums))]
    exact = None
    for p_value, n_value in scopes:
        term = (pc.field(part) == p_value) & (pc.field(num) == n_value)
        exact = term if exact is None else exact | term
    return prune, exact


def without_uids(data: pa.Table, sample_uids: pa.Array) -> pa.Table:
    """``data`` less the rows whose ``sample_uid`` is in ``sample_uids``.

    Applied after the scan, not pushed into it: Arrow's row-group pruning of ``isin`` fails on
    files that deltalake's UPDATE/MERGE rewrote with ``string_view`` columns ("no kernel
    matching (string, string_view)").
    """
    return data.filter(pc.invert(pc.is_in(data.column("sample_uid"), value_set=sample_uids)))


class Lake:
    """The trajectory lake rooted at ``lake_uri`` (a folder or an object-store URI)."""

    def __init__(self, lake_uri: str, storage_options: dict | None = None) -> None:
        self.uri = delta.normalize_uri(str(lake_uri))
        self.storage_options = dict(storage_options) if storage_options else None
        self._tables: dict[str, DeltaTable] = {}
        self._loaded_at: dict[str, int] = {}
        self._upgraded: set[str] = set()  # tables whose properties this object brought up to date
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Lake({self.uri!r})"

    # -- tables ---------------------------------------------------------------------------------
    def table_uri(self, table: str) -> str:
        columns(table)  # validates the name
        return f"{self.uri}/{table}"

    def _table(self, table: str, create: bool = False) -> DeltaTable | None:
        """The cached DeltaTable of ``table`` brought up to date, created if ``create``.

        A cached table is reopened once it is ``CHECKPOINT_INTERVAL`` commits past the version it
        was loaded at: delta-rs keeps one in-memory batch per incrementally applied commit, which
        makes file listing (every slice and append) slow, while a fresh load starts from the
        latest checkpoint.

        With ``create`` (a write), a table an older rlake created gets the current Delta
        properties once per ``Lake`` object (``delta.upgrade_properties``: one metadata commit,
        only when one differs); reads never write.
        """
        dt = self._tables.get(table)
        if dt is not None:
            if self._may_have_changed(dt):
                dt.update_incremental()
            if dt.version() - self._loaded_at[table] < delta.CHECKPOINT_INTERVAL:
                return self._upgrade(table, dt) if create else dt
        uri = self.table_uri(table)
        dt = delta.create_table(uri, table, self.storage_options) if create else delta.open_table(
            uri, self.storage_options)
        if dt is not None:
            self._tables[table] = dt
            self._loaded_at[table] = dt.version()
        return self._upgrade(table, dt) if create and dt is not None else dt

    def _upgrade(self, table: str, dt: DeltaTable) -> DeltaTable:
        """``dt`` with its Delta properties brought up to date, tried once per ``Lake`` (a write's
        open; an upgrade that kept conflicting is left to the next ``Lake`` or ``compact``)."""
        if table not in self._upgraded:
            self._upgraded.add(table)
            delta.upgrade_properties(dt, table)
        return dt

    def _may_have_changed(self, dt: DeltaTable) -> bool:
        """False only when the table is local and its next commit file does not exist (O(1))."""
        if not delta.is_local(self.uri):
            return True
        nxt = f"{dt.version() + 1:020d}.json"
        return os.path.exists(os.path.join(delta.local_path(dt.table_uri), "_delta_log", nxt))

    def _snapshot(self, table: str, as_of: int | str | datetime | None) -> DeltaTable | None:
        """``table`` at its current version, or as of a Delta version / timestamp."""
        when = parse_as_of(as_of)
        if when is None:
            return self._table(table)
        dt = delta.open_table(self.table_uri(table), self.storage_options)
        if dt is None:
            return None
        if isinstance(when, int) and not 0 <= when <= dt.version():
            raise ValueError(f"{table} has no version {when} (its versions are 0 to {dt.version()})")
        try:
            dt.load_as_version(when)
        except Exception as e:  # deltalake raises several types for a missing version
            first = first_logged_version(dt)
            if isinstance(when, int) and first is not None and when < first:
                raise ValueError(f"{table} has no version {when} any more: its log starts at "
                                 f"version {first} ({VACUUMED_LOG})") from None
            raise ValueError(f"{table}: cannot read as of {as_of!r}: {e}") from None
        if isinstance(when, datetime) and (first := _first_version_after(dt, when)) is not None:
            # deltalake loads the oldest version it has for a time before it, silently
            if first == 0:
                return None  # the table did not exist yet: read as the empty table
            raise ValueError(f"{table} has no version as of {when.isoformat()} any more: its log "
                             f"starts at version {first}, committed later ({VACUUMED_LOG})")
        return dt

    def table_version(self, table: str) -> int | None:
        """Current Delta version of ``table``; None if it does not exist yet."""
        with self._lock:
            dt = self._table(table)
            return None if dt is None else dt.version()

    def schema_version(self, table: str) -> int | None:
        """The ``rlake.schemaVersion`` recorded in ``table``'s Delta configuration."""
        with self._lock:
            dt = self._table(table)
            if dt is None:
                return None
            value = dt.metadata().configuration.get(SCHEMA_VERSION_KEY)
            return None if value is None else int(value)

    # -- writes ---------------------------------------------------------------------------------
    def _append(self, table: str, data: pa.Table, guards: list[str], prune: list,
                row_filter: pc.Expression, commit_info: dict[str, str] | None = None) -> int | None:
        if data.num_rows == 0:
            return None
        data = delta.dedup_on_key(data, KEYS[table])
        with self._lock:
            return delta.guarded_append(lambda: self._table(table, create=True), table, data,
                                        guards, prune, row_filter, commit_info)

    def append_trajectories(self, rows: list[dict[str, Any]] | pa.Table,
                            commit_info: dict[str, str] | None = None) -> int | None:
        """Append trajectory rows; rows whose ``sample_uid`` is already present are skipped.

        One Delta commit; returns its version, or None when every row was already there.
        ``created_at`` is stamped (UTC now) where missing. Safe to call concurrently from several
        processes and to repeat (task retries, resumes). Duplicates are looked for among rows of
        the same (run_id, iteration), which ``sample_uid`` encodes. ``commit_info`` (string
        values) is stored in the commit itself, durable exactly when the rows are: read it back
        with ``trajectory_commit_info``.
        """
        data = rows_to_table("trajectories", rows)
        if data.num_rows == 0:
            return None
        scopes = scope_pairs(data, "run_id", "iteration")
        kinds = sorted(set(zip(*(data.column(c).to_pylist() for c in ("run_id", "iteration", "kind")),
                               strict=True)))
        return self._append("trajectories", data, [trajectory_guard(r, i, k) for r, i, k in kinds],
                            *scope_filter(scopes, "run_id", "iteration"), commit_info=commit_info)

    def trajectory_commit_info(self, run_id: str, iteration: int) -> dict[str, Any] | None:
        """The commit metadata of the append that wrote ``(run_id, iteration)``'s trajectories
        (``commit_info`` given to ``append_trajectories``, plus delta-rs's own), or None."""
        with self._lock:
            dt = self._table("trajectories")
            return None if dt is None else delta.find_commit_info(dt, trajectory_guard(run_id, iteration))

    def append_train_step(self, row: dict[str, Any]) -> int | None:
        """Record one train step; idempotent on (run_id, step). Returns the version or None."""
        data = rows_to_table("train_steps", [row])
        scopes = scope_pairs(data, "run_id", "step")
        return self._append("train_steps", data, [f"rlake/train_steps/{r}/{s}" for r, s in scopes],
                            *scope_filter(scopes, "run_id", "step"))

    def append_evals(self, rows: list[dict[str, Any]]) -> int | None:
        """Record eval metrics; idempotent on (run_id, weight_version, dataset, metric)."""
        data = rows_to_table("evals", rows)
        if data.num_rows == 0:
            return None
        scopes = scope_pairs(data, "run_id", "weight_version")
        return self._append("evals", data, [f"rlake/evals/{r}/{v}" for r, v in scopes],
                            *scope_filter(scopes, "run_id", "weight_version"))

    def upsert_run(self, row: dict[str, Any]) -> None:
        """Insert the run, or update in place the columns given in ``row`` (and ``updated_at``).

        ``created_at`` of an existing run is never changed; columns absent from ``row`` keep
        their value.
        """
        if "run_id" not in row or not row["run_id"]:
            raise ValueError("upsert_run: row needs a non-empty 'run_id'")
        now = datetime.now(UTC)
        row = {**row, "updated_at": row.get("updated_at") or now}
        data = rows_to_table("runs", [row], now=now)
        update = [c for c in row if c not in ("run_id", "created_at")]
        with self._lock:
            delta.merge_upsert(lambda: self._table("runs", create=True), "runs", data,
                               f"t.run_id = {delta.sql_literal(row['run_id'])}", update)

    # -- reads ----------------------------------------------------------------------------------
    def read(self, table: str, run_id: str | None = None, as_of: int | str | datetime | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """``table`` (optionally one run's rows, some columns) now or as of a version/timestamp.

        Columns added to the schema after the data was written read as nulls.
        """
        with self._lock:
            dt = self._snapshot(table, as_of)
            if dt is None:
                return conform(arrow_schema(table).empty_table(), table, columns)
            ds = delta.to_dataset(dt, None if run_id is None else [("run_id", "=", run_id)])
            wanted = None if columns is None else [c for c in columns if c in ds.schema.names]
            flt = None if run_id is None else pc.field("run_id") == run_id
            try:
                data = ds.to_table(columns=wanted, filter=flt)
            except FileNotFoundError as e:
                if as_of is None:
                    raise
                raise ValueError(f"{table} as of {as_of!r}: its files were removed by vacuum ({e})") from None
            return conform(data, table, columns)

    def dataset(self, table: str, as_of: int | str | datetime | None = None) -> pa.dataset.Dataset | pa.Table:
        """An Arrow dataset over ``table`` (now or as of a version/timestamp), for DuckDB & co.

        A table that does not exist yet is an empty Arrow table with the declared schema.
        """
        with self._lock:
            dt = self._snapshot(table, as_of)
            if dt is None:
                return arrow_schema(table).empty_table()
            return delta.to_dataset(dt)

    def sql(self, query: str, as_of: int | str | datetime | dict | None = None) -> pa.Table:
        """Read-only SQL over the lake tables (see ``buffer.sql.sql``)."""
        from buffer.sql import sql

        return sql(self, query, as_of=as_of)

    def training_slice(self, run_id: str, min_version: int, max_version: int | None = None,
                       unconsumed_only: bool = True, limit: int | None = None) -> pa.Table:
        """Train samples of ``run_id`` with ``min_version <= weight_version <= max_version``.

        With ``unconsumed_only``, samples named in any ``train_steps.sample_uids`` of the run are
        excluded. Rows come oldest first (weight_version, iteration, sample_index); ``limit`` keeps
        the first ``limit``. Only files whose Delta statistics can match are opened. The result's
        schema metadata holds the ``trajectories`` version read (``slice_lake_version``).
        """
        with self._lock:
            dt = self._table("trajectories")
            if dt is None:
                return conform(arrow_schema("trajectories").empty_table(), "trajectories")
            version = dt.version()
            pred = [("run_id", "=", run_id), ("kind", "=", "train"), ("weight_version", ">=", int(min_version))]
            flt = ((pc.field("run_id") == run_id) & (pc.field("kind") == "train")
                   & (pc.field("weight_version") >= int(min_version)))
            if max_version is not None:
                pred.append(("weight_version", "<=", int(max_version)))
                flt &= pc.field("weight_version") <= int(max_version)
            consumed = self._consumed(run_id, min_version) if unconsumed_only else None
            data = delta.to_dataset(dt, pred).to_table(filter=flt)
        data = conform(data, "trajectories")
        if consumed is not None and len(consumed):
            data = without_uids(data, consumed)
        data = data.sort_by(SLICE_ORDER)
        if limit is not None:
            data = data.slice(0, max(0, int(limit)))
        return with_lake_version(data, version)

    def iteration_rows(self, run_id: str, iteration: int, kind: str) -> pa.Table:
        """``run_id``'s trajectories of one ``iteration`` and ``kind``, whatever weight version
        generated them (only files whose statistics can match are opened)."""
        with self._lock:
            dt = self._table("trajectories")
            if dt is None:
                return conform(arrow_schema("trajectories").empty_table(), "trajectories")
            pred = [("run_id", "=", run_id), ("iteration", "=", int(iteration)), ("kind", "=", kind)]
            flt = ((pc.field("run_id") == run_id) & (pc.field("iteration") == int(iteration))
                   & (pc.field("kind") == kind))
            data = delta.to_dataset(dt, pred).to_table(filter=flt)
        return conform(data, "trajectories")

    def _consumed(self, run_id: str, min_version: int | None = None) -> pa.Array:
        """Distinct sample_uids consumed by ``run_id``'s train steps, as an Arrow string array.

        With ``min_version``, only steps that can have consumed a sample of version >=
        ``min_version`` are read: a sample generated by version w is trained on by a step whose
        ``base_version >= w``, so steps with ``base_version < min_version`` are skipped (steps with
        no base_version are always read).
        """
        dt = self._table("train_steps")
        if dt is None:
            return pa.array([], pa.string())
        pred = [("run_id", "=", run_id)]
        flt = pc.field("run_id") == run_id
        if min_version is not None:
            pred.append(("base_version", ">=|null", int(min_version)))
            flt &= (pc.field("base_version") >= int(min_version)) | pc.field("base_version").is_null()
        uids = delta.to_dataset(dt, pred).to_table(columns=["sample_uids"], filter=flt).column(0)
        if len(uids) == 0:
            return pa.array([], pa.string())
        return pc.unique(pc.list_flatten(uids).combine_chunks().cast(pa.string()))

    def read_samples(self, run_id: str, sample_uids: list[str],
                     max_version: int | None = None) -> pa.Table:
        """The train trajectories of ``run_id`` named in ``sample_uids``, in that order (a train
        step's recorded slice). ``max_version``: the samples are known to be generated by versions
        <= it (a step's base_version), so only files that can hold such rows are opened."""
        with self._lock:
            dt = self._table("trajectories")
            if dt is None or not sample_uids:
                return conform(arrow_schema("trajectories").empty_table(), "trajectories")
            pred = [("run_id", "=", run_id), ("kind", "=", "train")]
            flt = (pc.field("run_id") == run_id) & (pc.field("kind") == "train")
            if max_version is not None:
                pred.append(("weight_version", "<=", int(max_version)))
                flt &= pc.field("weight_version") <= int(max_version)
            data = conform(delta.to_dataset(dt, pred).to_table(filter=flt), "trajectories")
        data = data.filter(pc.is_in(data.column("sample_uid"), value_set=pa.array(sample_uids, pa.string())))
        order = {uid: i for i, uid in enumerate(sample_uids)}
        rank = pa.array([order[u] for u in data.column("sample_uid").to_pylist()], pa.int64())
        return data.take(pc.sort_indices(rank))

    def consumed_sample_uids(self, run_id: str) -> set[str]:
        """Every sample_uid consumed by a recorded train step of ``run_id``."""
        with self._lock:
            return set(self._consumed(run_id).to_pylist())

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The ``runs`` row of ``run_id`` as a dict, or None."""
        rows = self.read("runs", run_id=run_id).to_pylist()
        return rows[0] if rows else None

    def samples_for_weight_version(self, run_id: str, weight_version: int) -> list[str]:
        """Lineage: sample_uids consumed by the steps of ``run_id`` that produced ``weight_version``."""
        steps = self.read("train_steps", run_id=run_id, columns=["weight_version", "sample_uids"])
        mask = pc.equal(steps.column("weight_version"), int(weight_version))
        return pc.list_flatten(steps.filter(mask).column("sample_uids")).to_pylist()

    def tables(self) -> list[str]:
        """Names of the lake tables that exist."""
        return [t for t in TABLES if self.table_version(t) is not None]
