"""Read-only, sandboxed SQL over the lake with DuckDB.

Each lake table the query names is exposed as a DuckDB view over the Arrow dataset that
``deltalake`` builds from the Delta log (the DuckDB ``delta`` extension cannot be installed
offline); filters are pushed down into the dataset scan. The connection is an in-memory DuckDB with

- ``enable_external_access = false``: no file or network access of any kind from SQL (no
  ``read_parquet('path')``, ``COPY ... TO``, ``ATTACH``, ``INSTALL``, ``EXPORT``);
- ``autoinstall_known_extensions`` / ``autoload_known_extensions`` off;
- ``lock_configuration = true``: the query cannot turn any of this back on.

On top of that, exactly one statement is accepted, a ``SELECT`` (incl. ``WITH``, ``VALUES``,
``DESCRIBE``, ``SUMMARIZE``) or an ``EXPLAIN [ANALYZE]`` of one (the explained statement is
checked too: ``EXPLAIN ANALYZE`` runs it); anything else (PRAGMA, SET, CALL, COPY, ATTACH,
INSTALL/LOAD, CREATE MACRO...) is refused before it runs with ``SqlRefused``.

Each query runs under a memory limit (DuckDB's ``memory_limit``, no spilling to disk) and a
timeout (the connection is interrupted): a runaway query ends with an error naming the limit.
Ctrl-C interrupts the connection too (the query runs on a worker thread: ``interruptible``).
The Arrow result handed back is outside DuckDB's accounting; ``--max-rows``/``LIMIT`` bound it.
"""

from __future__ import annotations

import re
import threading
from datetime import datetime
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs

from buffer.names import DEFAULT_MEMORY_LIMIT, DEFAULT_TIMEOUT_S
from buffer.schema import TABLES

if TYPE_CHECKING:
    from buffer.lake import Lake

SANDBOX_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "python_enable_replacements": False,
    "threads": 2,
    "temp_directory": "",  # no spilling: the memory limit is the limit
}
REFUSED_HINT = ("the lake's SQL is read-only and sandboxed: only SELECT/EXPLAIN over the lake tables "
                f"({', '.join(TABLES)}); no file access, writes, ATTACH, INSTALL or LOAD")

AsOf = int | str | datetime | dict[str, int | str | datetime] | None


class SqlRefused(ValueError):
    """A statement the sandbox does not run (write, file access, extension, attach...)."""


def first_line(error: Exception) -> str:
    """The first line of a (multi-line) DuckDB error message."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def sandbox_connection(memory_limit: str = DEFAULT_MEMORY_LIMIT) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with external access off, ``memory_limit`` (a DuckDB size:
    ``2GB``, ``512MB``) and its configuration locked."""
    try:
        con = duckdb.connect(":memory:", config={**SANDBOX_CONFIG, "memory_limit": memory_limit})
    except duckdb.Error as e:
        raise ValueError(f"--memory-limit {memory_limit!r} is not a size like 2GB or 512MB "
                         f"({first_line(e)})") from None
    con.execute("SET lock_configuration = true")
    return con


def _parse(con: duckdb.DuckDBPyConnection, query: str) -> list:
    try:
        return con.extract_statements(query)
    except duckdb.Error as e:
        raise ValueError(f"SQL syntax error: {first_line(e)}") from None


def _refuse(query: str, kind: str) -> SqlRefused:
    text = " ".join(query.split())
    verb = text.split(" ", 1)[0].upper() if text else kind
    return SqlRefused(f"refused {verb} statement ({text[:80]!r}): {REFUSED_HINT}")


def explained(query: str) -> str:
    """The statement inside ``EXPLAIN [ANALYZE] [(options)] <statement>`` (comments skipped)."""
    tokens = [(pos, kind.name) for pos, kind in duckdb.tokenize(query) if kind.name != "comment"]
    i = 1  # tokens[0] is EXPLAIN
    if i < len(tokens) and query[tokens[i][0]:].upper().startswith(("ANALYZE", "ANALYSE")):
        i += 1
    if i < len(tokens) and query[tokens[i][0]] == "(":  # EXPLAIN (FORMAT json) ...
        depth = 0
        while i < len(tokens):
            ch = query[tokens[i][0]]
            depth += (ch == "(") - (ch == ")")
            i += 1
            if depth == 0:
                break
    return query[tokens[i][0]:] if i < len(tokens) else ""


def check_statements(con: duckdb.DuckDBPyConnection, query: str) -> str:
    """The one statement of ``query``, if it is a SELECT or an EXPLAIN of a SELECT; otherwise
    ``SqlRefused`` (or ``ValueError`` for a syntax error, no statement or several)."""
    statements = _parse(con, query)
    if not statements:
        raise ValueError("empty SQL query")
    if len(statements) > 1:
        raise SqlRefused(f"one statement at a time: got {len(statements)} "
                         f"({'; '.join(' '.join(s.query.split()).rstrip(';')[:40] for s in statements)})")
    st = statements[0]
    inner, kind = st.query, st.type.name
    while kind == "EXPLAIN":  # EXPLAIN ANALYZE runs its statement: that one must be a SELECT too
        inner = explained(inner)
        inside = _parse(con, inner)
        kind = inside[0].type.name if len(inside) == 1 else "EXPLAIN"
        if len(inside) != 1:
            raise _refuse(st.query, kind)
    if kind != "SELECT":
        raise _refuse(inner, kind)
    return st.query


# a query over DuckDB's catalog (``SHOW TABLES``, ``information_schema``, ``duckdb_tables()``)
# names no lake table, and listed none: it sees them all
CATALOG_QUERY = re.compile(r"\bSHOW\s+(ALL\s+)?TABLES\b|\binformation_schema\b|"
                           r"\bduckdb_(tables|views|columns)\b", re.IGNORECASE)


def referenced_tables(query: str) -> list[str]:
    """The lake tables ``query`` reads, as DuckDB's parser finds them (case-insensitive): not a
    column alias or a string that spells a table's name (``count(*) AS runs`` had ``--as-of``
    applied to the runs table, and failed on its versions: review, 2026-11-29). A query the
    parser refuses: the tables named as words (its error comes when it runs). A query over the
    catalog (``CATALOG_QUERY``): every table (``SHOW TABLES`` answered nothing)."""
    if CATALOG_QUERY.search(query):
        return list(TABLES)
    try:
        names = {name.split(".")[-1].lower() for name in duckdb.get_table_names(query)}
    except duckdb.Error:
        return [t for t in TABLES if re.search(rf"\b{t}\b", query, flags=re.IGNORECASE)]
    return [t for t in TABLES if t in names]


def _as_of_for(as_of: AsOf, table: str) -> int | str | datetime | None:
    return as_of.get(table) if isinstance(as_of, dict) else as_of


def interruptible(con: duckdb.DuckDBPyConnection, statement: str) -> pa.Table:
    """``statement``'s result, run on a worker thread while this one waits: DuckDB holds its
    calling thread until the query ends, and Python runs its Ctrl-C handler on the main thread
    only, so Ctrl-C waited for the query (up to ``--timeout``: review, 2026-11-29). A
    KeyboardInterrupt while waiting interrupts the connection, as the timeout does, and is raised
    once the query has stopped (the connection cannot close before)."""
    done: dict[str, object] = {}
    finished = threading.Event()  # not Thread.join: on 3.11 an interrupted join marks it ended

    def run() -> None:
        try:
            done["table"] = con.sql(statement).to_arrow_table()
        except BaseException as e:  # noqa: BLE001 - raised again on the waiting thread
            done["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, name="rlake-sql", daemon=True).start()
    try:
        finished.wait()  # a lock wait: a signal interrupts it
    except KeyboardInterrupt:
        _stop_query(con, finished)
        raise
    if "error" in done:
        raise done["error"]
    return done["table"]


def _stop_query(con: duckdb.DuckDBPyConnection, finished: threading.Event) -> None:
    """Interrupt ``con`` until its query has stopped (``finished``): an interrupt sent before the
    query began is lost, so it is sent again; another Ctrl-C meanwhile changes nothing."""
    while True:
        con.interrupt()
        try:
            if finished.wait(0.05):
                return
        except KeyboardInterrupt:
            pass


def vacuumed(snapshots: dict[str, tuple[object, object]]) -> str | None:
    """The message for the first ``{table: (as_of, dataset)}`` snapshot that names a file that
    is gone (vacuum removed it), or None. Asked only once a query has failed: the check costs a
    look-up per file (a request each on an object store), and a query its filters keep off the
    missing files still runs, as ``Lake.read`` does."""
    for table, (as_of, ds) in snapshots.items():
        files = list(getattr(ds, "files", None) or [])
        gone = [info.path for info in ds.filesystem.get_file_info(files)
                if info.type == pafs.FileType.NotFound] if files else []
        if gone:
            return (f"{table} as of {as_of!r}: its files were removed by vacuum ({len(gone)} of "
                    f"{len(files)} gone, e.g. {gone[0]})")
    return None


def sql(lake: Lake, query: str, as_of: AsOf = None, memory_limit: str = DEFAULT_MEMORY_LIMIT,
        timeout_s: float = DEFAULT_TIMEOUT_S) -> pa.Table:
    """Run a read-only ``query`` over the lake's tables; the result as an Arrow table.

    ``as_of``: a Delta version (applied to every table the query names), an ISO timestamp, or a
    dict ``{table: version_or_timestamp}``. Tables that do not exist yet read as empty tables with
    the declared schema. Refused statements raise ``SqlRefused``; other errors (syntax, the
    ``memory_limit`` or ``timeout_s`` reached) ``ValueError``.
    """
    if timeout_s <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout_s}")
    con = sandbox_connection(memory_limit)
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        con.interrupt()
    timer = threading.Timer(timeout_s, stop)
    past: dict[str, tuple[object, object]] = {}  # tables read as of a version: vacuum may have struck
    try:
        statement = check_statements(con, query)
        for table in referenced_tables(query):
            when = _as_of_for(as_of, table)
            con.register(table, ds := lake.dataset(table, as_of=when))
            if when is not None:
                past[table] = (when, ds)
        timer.start()
        try:
            return interruptible(con, statement)
        except duckdb.PermissionException as e:
            raise SqlRefused(f"refused: {first_line(e)}; {REFUSED_HINT}") from None
        except duckdb.OutOfMemoryException:
            raise ValueError(f"query stopped: it needs more memory than the limit of {memory_limit} "
                             "(--memory-limit)") from None
        except duckdb.InterruptException:
            if not timed_out.is_set():
                raise KeyboardInterrupt from None
            raise ValueError(f"query stopped: it ran past the timeout of {timeout_s:g}s "
                             "(--timeout)") from None
        except duckdb.Error as e:
            # a raw "IOError: Failed to open local file ..." where Lake.read says what happened
            raise ValueError(vacuumed(past) or f"SQL error: {first_line(e)}") from None
    finally:
        timer.cancel()
        con.close()
