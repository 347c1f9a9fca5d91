"""Async mode's rollout process, spawned early: it imports what a rollout side needs while the
run is still starting, then waits to be told what to run.

Spawning it (Python, multiprocessing's bootstrap, the main module again) and importing torch,
the model code, the lake and Prefect's client cost ~2.4 s of CPU here (2026-11-27,
docs/operations.md, Startup). Started when the run's runtime opens (``infra.runtime.open_runtime``),
that work overlaps the wait for Prefect's server instead of following it, on the path to the
first batch. What it runs comes later, by name, with its spec (``SpawnedProcess.run``): the
Prefect API's address and the weight version it starts from are known only then, and this
module stays below ``flows/`` (it never imports them).

The process dies with its parent (``PR_SET_PDEATHSIG``): after a ``kill -9`` of the run, no
orphan keeps appending while a resumed run's own rollout side starts.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from infra.affinity import children_cores
from infra.faults import ENV as FAULT_ENV

T = TypeVar("T")

PR_SET_PDEATHSIG = 1
# ``python -c`` that sets PR_SET_PDEATHSIG (which survives exec), exits if its parent is gone
# already, and becomes the command: for a program whose own start rlake cannot change
DIE_WITH_PARENT_EXEC = ("import ctypes, os, signal, sys\n"
                        "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)\n"
                        "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
                        "os.execvp(sys.argv[2], sys.argv[2:])\n")
_launcher: tuple[int, ThreadPoolExecutor] | None = None  # (pid, its thread): in_launcher
# imported while waiting: the rollout side's own modules (torch, the model code, the lake)
PRELOAD = ("infra.sides",)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc: the rollout side's parent check still ends its loop
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` started so that the kernel SIGKILLs it when this process dies (a ``kill -9`` of
    the run too). Start it with ``launch_lasting``: the signal follows the thread that started it."""
    return [sys.executable, "-c", DIE_WITH_PARENT_EXEC, str(os.getpid()), *cmd]


def in_launcher(start: Callable[[], T]) -> T:
    """``start()`` (which starts child processes) on one thread that lives as long as this
    process: PR_SET_PDEATHSIG fires when the *thread* that started a child ends, not its process
    (a reward worker started from a step's thread was killed when that thread ended: checked
    2026-11-29). A forked child has no copy of that thread: it starts its own.

    While this process is pinned (``infra.affinity.training_cores``) the thread first moves to
    the helpers' cores (``children_cores``): the children it starts inherit them, not the
    training process's own."""
    global _launcher
    if _launcher is None or _launcher[0] != os.getpid():
        _launcher = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlake-launch"))
    return _launcher[1].submit(_placed, start).result()


def _placed(start: Callable[[], T]) -> T:
    cores = children_cores()
    if cores:
        os.sched_setaffinity(0, cores)  # this thread only; training_cores puts it back
    return start()


def launch_lasting(args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)`` from the lasting launcher (``in_launcher``)."""
    return in_launcher(lambda: subprocess.Popen(args, **popen_kwargs))


class SpawnedProcess:
    """A spawned process (``spawned_main``) and its two queues: ``inbox`` (to it) and
    ``outbox`` (from it)."""

    def __init__(self, home: str, torch_threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # deltalake and torch do not survive fork
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        fault = os.environ.pop(FAULT_ENV, None)  # fault points name the training process's steps
        try:
            self.proc = ctx.Process(target=spawned_main, name="rlake-rollout", daemon=True,
                                    args=(str(home), torch_threads, os.getpid(), self.inbox,
                                          self.outbox))
            self.proc.start()
        finally:
            if fault is not None:
                os.environ[FAULT_ENV] = fault

    def run(self, target: str, spec: dict[str, Any]) -> None:
        """Have the process call ``target`` ("module:function") with ``(spec, inbox, outbox)``."""
        self.inbox.put(("run", target, spec))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask it to stop ("stop": before or while it runs its target), kill it after
        ``timeout_s``, and close the queues."""
        if self.proc.is_alive():
            self.inbox.put(("stop",))
            self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()
            q.close()


def spawned_main(home: str, torch_threads: int, parent_pid: int, inbox, outbox) -> None:
    """Entry of the spawned process: import, then run the target the first message names
    (nothing, on "stop")."""
    # before torch and Prefect: its exit handler then runs after theirs (infra/quick_exit.py)
    from infra import quick_exit

    die_with_parent(parent_pid)
    # a terminal's Ctrl-C reaches the whole foreground group: the run's process takes it and
    # stops this one ("stop", between batches); here it printed a traceback mid-generation
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from infra.env import configure_environment

    configure_environment(home, torch_threads)
    for name in PRELOAD:
        importlib.import_module(name)
    if os.environ.get("PREFECT_API_URL"):  # its settings are read at import: only with the URL
        importlib.import_module("prefect")
    message = inbox.get()
    if message[0] == "run":
        module, function = message[1].split(":")
        getattr(importlib.import_module(module), function)(message[2], inbox, outbox)
    # the training side waits for this process to end: without Python's teardown (~1.5 s), once
    # multiprocessing flushed the queues and Prefect drained its events
    quick_exit.exit_code = 0
