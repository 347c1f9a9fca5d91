"""The embedded Prefect server's app (``infra.prefect_server.EmbeddedServer`` runs it): Prefect's
own ``create_app`` with SQLite's busy timeout at ``SQLITE_BUSY_TIMEOUT_MS`` instead of Prefect's
60 s.

Why (2026-11-27, docs/operations.md, "the 60 s stall"): about one iteration in ~1000 waited
~60 s for a server that answered nothing. Sampled from the kernel during those stalls: every
thread of the server asleep and none using CPU; its event loop's thread blocked on a futex at a
plain Python line of SQLAlchemy (so it waited for the GIL or for a C lock taken under it), and
one aiosqlite connection thread asleep in ``nanosleep`` inside a SQLite call, which is SQLite's
busy handler waiting for another connection's write lock. The writer holding that lock is driven
by the event loop, which is stuck: nothing moves until the busy handler gives up, after
Prefect's ``PRAGMA busy_timeout = 60000``. A shorter busy timeout ends such a wait sooner; the
waiting statement then fails "database is locked" and is retried (an API request answers 503,
which Prefect's client and ``flows.prefetch.LockRetryTransport`` send again; the task-run
recorder puts its batch back). A write lock is otherwise held for milliseconds to ~1 s (the
task-run recorder's largest flush on a loaded machine), well inside it.
"""

from __future__ import annotations

from typing import Any

# how long a SQLite statement of the embedded server waits for another connection's write lock
SQLITE_BUSY_TIMEOUT_MS = 5000


def shorten_busy_timeout(busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> None:
    """Make every SQLite connection Prefect's server opens from now on wait ``busy_timeout_ms``
    for a lock (set after Prefect's own PRAGMAs on connect)."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    current = AioSqliteConfiguration.setup_sqlite
    prefects = getattr(current, "__wrapped__", current)  # called again: wrap Prefect's, not ours

    def setup_sqlite(self, conn: Any, record: Any) -> None:
        prefects(self, conn, record)
        cursor = conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)};")
        cursor.close()

    setup_sqlite.__wrapped__ = prefects
    AioSqliteConfiguration.setup_sqlite = setup_sqlite


def create_app() -> Any:
    """uvicorn's ``--factory``: Prefect's server app, its SQLite busy timeout shortened."""
    shorten_busy_timeout()
    from prefect.server.api.server import create_app as prefects_create_app

    return prefects_create_app()
