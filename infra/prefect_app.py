"""The embedded Prefect server's app (``infra.prefect_server.EmbeddedServer`` runs it): Prefect's
own ``create_app`` with SQLite's busy timeout at ``SQLITE_BUSY_TIMEOUT_MS`` instead of Prefect's
60 s, and unclosed SQLite cursors closed on their own connection's thread (the cause of the
stall, below).

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

What got the event loop stuck (found the next session, 2026-11-27): an aiosqlite cursor left
unclosed, dropped on the event loop's thread. SQLAlchemy's aiosqlite adapter closes its cursor
after a statement, but not when the statement raises: an INSERT of a task or flow run that
fails "database is locked" at once (SQLite's answer, without waiting, to a read transaction
that wants to write after another connection wrote) leaves its cursor in a reference cycle
(the error's traceback holds the frame that holds the cursor), which the garbage collector frees
later on whichever thread allocates: the event loop, compiling SQL, where every stall's dump
found it. Freeing a ``sqlite3`` cursor that still holds a statement resets the statement, which
takes its connection's mutex; if that connection's own thread is meanwhile inside SQLite's busy
handler waiting for a lock, the mutex is held for the whole wait, and the lock's holder is
driven by the event loop now blocked: the deadlock. ``close_dropped_cursors_on_their_thread``
makes a dropped, unclosed aiosqlite cursor hand its ``sqlite3`` cursor to its connection's own
thread to close, so the event loop never touches SQLite. Counted with a probe (150-iteration
sync runs, `bench/stalls.py`): 4-8 such cursors a run, every one freed on the event loop's
thread. (Python 3.11's ``sqlite3``, rlake's; with 3.12 and SQLite 3.45 such a free does not
wait, and the fix changes nothing there.)
"""

from __future__ import annotations

import logging
from typing import Any

from infra.env import freeze_startup_heap

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


def close_dropped_cursors_on_their_thread() -> None:
    """An ``aiosqlite`` cursor freed without having been closed hands its ``sqlite3`` cursor to
    its connection's thread, which closes it there (in order after what that thread runs
    already), instead of resetting its statement on the freeing thread (module docstring)."""
    from aiosqlite.cursor import Cursor

    if getattr(Cursor, "_closes_on_its_thread", False):
        return
    close = Cursor.close

    async def close_and_mark(self) -> None:
        await close(self)
        self._closed = True  # nothing left for __del__ to hand over

    def __del__(self) -> None:
        if self.__dict__.get("_closed"):
            return
        cursor, conn = self.__dict__.pop("_cursor", None), self.__dict__.get("_conn")
        try:
            if cursor is not None and conn is not None and conn._running:
                conn._tx.put_nowait((None, cursor.close))  # no future: nobody waits for it
        except Exception:  # noqa: BLE001 - interpreter shutdown: the cursor is freed here
            pass

    Cursor.close = close_and_mark
    Cursor.__del__ = __del__
    Cursor._closes_on_its_thread = True


def create_app() -> Any:
    """uvicorn's ``--factory``: Prefect's server app, its SQLite busy timeout shortened, its
    dropped cursors closed on their connection's thread, and what it made while starting kept
    out of the garbage collector's full collections (``infra.env.freeze_startup_heap``).

    uvicorn's own errors are logged (to ``embedded-server.log``): Prefect's logging setup gives
    uvicorn's loggers ``PREFECT_SERVER_LOGGING_LEVEL``, CRITICAL under rlake (infra/env.py), so
    a server that could not bind its port exited with an empty log."""
    shorten_busy_timeout()
    close_dropped_cursors_on_their_thread()
    from prefect.server.api.server import create_app as prefects_create_app

    app = prefects_create_app()
    logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
    freeze_startup_heap(collect=False)  # on the path of the server's start
    return app
