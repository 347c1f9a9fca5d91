"""Read-only, sandboxed SQL over the lake with DuckDB.

Each lake table the query names is exposed as a DuckDB view over the Arrow dataset that
``deltalake`` builds from the Delta log (the DuckDB ``delta`` extension cannot be installed
offline); filters are pushed down into the dataset scan. The connection is an in-memory DuckDB with

- ``enable_external_access = false``: no file or network access of any kind from SQL (no
  ``read_parquet('path')``, ``COPY ... TO``, ``ATTACH``, ``INSTALL``, ``EXPORT``);
- ``autoinstall_known_extensions`` / ``autoload_known_extensions`` off;
- ``lock_configuration = true``: the query cannot turn any of this back on.

On top of that, only ``SELECT`` (incl. ``WITH``, ``VALUES``, ``DESCRIBE``, ``SUMMARIZE``) and
``EXPLAIN`` statements are accepted; anything else is refused before it runs with ``SqlRefused``.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from buffer.schema import TABLES

if TYPE_CHECKING:
    from buffer.lake import Lake

ALLOWED = {"SELECT", "EXPLAIN"}
SANDBOX_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "python_enable_replacements": False,
    "threads": 2,
}
REFUSED_HINT = ("the lake's SQL is read-only and sandboxed: only SELECT/EXPLAIN over the lake tables "
                f"({', '.join(TABLES)}); no file access, writes, ATTACH, INSTALL or LOAD")

AsOf = int | str | datetime | dict[str, int | str | datetime] | None


class SqlRefused(ValueError):
    """A statement the sandbox does not run (write, file access, extension, attach...)."""


def first_line(error: Exception) -> str:
    """The first line of a (multi-line) DuckDB error message."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def sandbox_connection() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with external access off and its configuration locked."""
    con = duckdb.connect(":memory:", config=dict(SANDBOX_CONFIG))
    con.execute("SET lock_configuration = true")
    return con


def check_statements(con: duckdb.DuckDBPyConnection, query: str) -> list:
    """Parse ``query`` and refuse any statement that is not SELECT/EXPLAIN."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as e:
        raise ValueError(f"SQL syntax error: {first_line(e)}") from None
    if not statements:
        raise ValueError("empty SQL query")
    for st in statements:
        kind = st.type.name
        if kind not in ALLOWED:
            text = " ".join(st.query.split())
            verb = text.split(" ", 1)[0].upper() if text else kind
            raise SqlRefused(f"refused {verb} statement ({text[:80]!r}): {REFUSED_HINT}")
    return statements


def referenced_tables(query: str) -> list[str]:
    """Lake table names that appear as words in ``query`` (case-insensitive)."""
    return [t for t in TABLES if re.search(rf"\b{t}\b", query, flags=re.IGNORECASE)]


def _as_of_for(as_of: AsOf, table: str) -> int | str | datetime | None:
    return as_of.get(table) if isinstance(as_of, dict) else as_of


def sql(lake: Lake, query: str, as_of: AsOf = None) -> pa.Table:
    """Run a read-only ``query`` over the lake's tables; the result as an Arrow table.

    ``as_of``: a Delta version (applied to every table the query names), an ISO timestamp, or a
    dict ``{table: version_or_timestamp}``. Tables that do not exist yet read as empty tables with
    the declared schema. Refused statements raise ``SqlRefused``; other errors ``ValueError``.
    """
    con = sandbox_connection()
    try:
        statements = check_statements(con, query)
        for table in referenced_tables(query):
            con.register(table, lake.dataset(table, as_of=_as_of_for(as_of, table)))
        # Every statement is a SELECT/EXPLAIN (no side effects): only the last one's rows matter.
        try:
            return con.sql(statements[-1].query).to_arrow_table()
        except duckdb.PermissionException as e:
            raise SqlRefused(f"refused: {first_line(e)}; {REFUSED_HINT}") from None
        except duckdb.Error as e:
            raise ValueError(f"SQL error: {first_line(e)}") from None
    finally:
        con.close()
