"""The CLI's process ends without Python's teardown once its command is done.

After every exit handler ran (threads joined, Prefect's events drained, Ray, SGLang servers and
child processes stopped, logs flushed), Python's teardown still runs full garbage collections
over the millions of objects torch, Prefect and pydantic made and frees them one by one: 1.3-1.7
s of CPU at every ``rlake`` command's exit here, and the OS frees that memory anyway. DuckDB's
bindings also print "leaked instance" warnings when the collections are skipped any other way.

Imported first by ``infra.cli`` (and by async mode's rollout process, ``flows.rollout_side``),
so its handler is registered before any other and runs after them all; it does nothing unless
the exit code was set (by ``main``, or the rollout process on success: an import, e.g. by a
test, leaves the process alone).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

exit_code: int | None = None


def _exit_now() -> None:
    if exit_code is None:
        return
    logging.shutdown()  # registered before this module (typer imports logging): flush it here
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to flush
            pass
    os._exit(exit_code)


def release_named_semaphores() -> None:
    """Before an ``os._exit`` that skips the exit handlers (``infra.startup.server_lost``): unlink
    the named semaphores this process's multiprocessing queues hold (async mode's rollout
    process), as multiprocessing's own exit handler would. Otherwise its resource tracker, which
    outlives the process, prints "There appear to be 6 leaked semaphore objects" under the
    run's last line (it then unlinks them itself: nothing leaks, but the user reads a warning).
    Runs multiprocessing's finalizers of exit priority >= 0 only: the semaphores' unlink (0) and
    the queues' close (10), neither of which waits."""
    if "multiprocessing.util" in sys.modules:
        sys.modules["multiprocessing.util"]._run_finalizers(0)


atexit.register(_exit_now)
