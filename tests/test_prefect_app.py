"""The embedded Prefect server's SQLite fixes (infra/prefect_app.py), on real SQLite and aiosqlite;
and its start-up heap taken out of the garbage collector's full collections.

The ~60 s stall (docs/async-log.md): an INSERT that fails "database is locked" leaves its
aiosqlite cursor unclosed; freed later on the event loop's thread while that connection's own
thread waits in SQLite's busy handler, the free blocks until the wait ends, and the lock it waits
for belongs to a transaction the (blocked) event loop drives. Seen with Python 3.11's ``sqlite3``
(3.11.7, SQLite 3.40.1: what rlake runs on); with 3.12.3 and SQLite 3.45.1 (a GPU machine,
2026-11-27) freeing the errored cursor does not wait, and the script ends either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

# The deadlock, small: a second connection ("holder") keeps the write lock until the event loop
# says it has freed the errored cursor (or, deadlocked, until HOLD_LIMIT_S); meanwhile the
# cursor's connection waits for that lock in SQLite's busy handler. Prints what happened.
DEADLOCK = r"""
import asyncio, gc, json, os, shutil, sqlite3, sys, tempfile, threading, time
import aiosqlite
from infra.prefect_app import close_dropped_cursors_on_their_thread
if sys.argv[1] == "fixed":
    close_dropped_cursors_on_their_thread()
HOLD_LIMIT_S = 10.0
folder = tempfile.mkdtemp()
db = os.path.join(folder, "t.db")
setup = sqlite3.connect(db)
setup.execute("PRAGMA journal_mode=WAL")
setup.execute("CREATE TABLE t (v INTEGER PRIMARY KEY, w)")
setup.executemany("INSERT INTO t (w) VALUES (?)", [(i,) for i in range(3)])
setup.commit()
setup.close()

def write_elsewhere():
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("INSERT INTO t (w) VALUES (0)")
    other.close()

async def main():
    conn = await aiosqlite.connect(db, isolation_level=None, timeout=2 * HOLD_LIMIT_S)
    # Prefect's pattern: a read, someone else writes, then this transaction's INSERT fails at once
    errored = await conn.cursor()
    await errored.execute("BEGIN")
    await errored.execute("SELECT * FROM t")
    await errored.fetchone()
    write_elsewhere()
    try:
        await errored.execute("INSERT INTO t (w) VALUES (1)")
        raise SystemExit("the INSERT did not fail")
    except sqlite3.OperationalError as err:
        assert "locked" in str(err), err
    await conn.execute("ROLLBACK")

    freed, released = threading.Event(), {}
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t (w) VALUES (2)")
    def hold():
        released["by"] = "the freed cursor" if freed.wait(HOLD_LIMIT_S) else "the time limit"
        holder.execute("COMMIT")
    threading.Thread(target=hold).start()
    waiting = asyncio.ensure_future(conn.execute("INSERT INTO t (w) VALUES (3)"))  # busy handler
    await asyncio.sleep(0.5)  # its thread is in the busy handler by now
    del errored
    gc.collect()
    freed.set()
    await waiting
    rows = await (await conn.execute("SELECT count(*) FROM t")).fetchone()
    await conn.close()
    print(json.dumps({"released_by": released["by"], "rows": rows[0]}))

asyncio.run(main())
shutil.rmtree(folder)
"""


def _script_result(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh Python; the JSON its last line prints."""
    # the caller's path after the repository's: a GPU machine brings aiosqlite on PYTHONPATH
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _deadlock(mode: str) -> dict:
    return _script_result(DEADLOCK, mode)


def test_a_dropped_errored_cursor_is_closed_on_its_connections_thread_not_the_event_loops():
    """With the fix, freeing the cursor on the event loop returns at once: the lock's holder is
    released by it, and the waiting INSERT lands (3 rows, then one each from the other writer,
    the holder and the waiter)."""
    assert _deadlock("fixed") == {"released_by": "the freed cursor", "rows": 6}


FROZEN = r"""
import gc, json, sys, weakref
import infra.env
from infra.env import freeze_startup_heap
from infra.prefect_app import create_app
gc.disable()  # no collection of the collector's own in between
before = gc.get_freeze_count()
create_app()
after_app = gc.get_freeze_count()
counted = []  # gc.get_freeze_count walks every frozen object (CPython 3.11): once is enough
real_count = gc.get_freeze_count
gc.get_freeze_count = lambda: counted.append(1) or real_count()
freeze_startup_heap()  # a second start-up in the process (another run) freezes nothing more
freeze_startup_heap()  # as async mode's rollout side calls it after every batch
gc.get_freeze_count = real_count
again = gc.get_freeze_count()
gc.unfreeze()
infra.env._HEAP_FROZEN = False  # as in a new process
class Node:
    pass
garbage = Node()
garbage.self = garbage  # a cycle only the collector frees
garbage = weakref.ref(garbage)
freeze_startup_heap()  # a process with a model: collect first
print(json.dumps({"before": before, "after_app": after_app, "again": again, "counted": len(counted),
                  "garbage_freed": garbage() is None, "frozen": gc.get_freeze_count()}))
"""


def test_the_embedded_servers_start_up_heap_is_frozen_once():
    """The server's app factory takes what Prefect's server made while starting out of the full
    garbage collections (infra.env.freeze_startup_heap: ~10% of its CPU in async mode); a second
    start-up in the same process freezes nothing more; a process holding a model collects its
    garbage first (a frozen cycle is never freed)."""
    counts = _script_result(FROZEN)
    assert counts["before"] == 0
    assert counts["after_app"] > 100_000  # Prefect's server, its models and routes
    assert counts["again"] == counts["after_app"]
    assert counts["counted"] == 0, "a call after the first walked the frozen heap again"
    assert counts["garbage_freed"], "garbage made before the freeze would stay forever"
    assert counts["frozen"] > 100_000
