"""Custom reward functions in worker processes, so a call past its time limit can be killed.

A thread cannot be stopped: a ``custom_rm_path`` function that busy-loops keeps its thread
spinning (and holding the GIL) after its sample was given up on, and every later training step
slows down. Here each call runs in one of at most ``size`` spawned processes; a call still
running ``timeout_s`` after it was handed to its worker fails its sample, and that worker is
killed (SIGKILL) and replaced. A worker that dies mid-call (segfault, ``os._exit``) fails only
its sample.

Workers start on demand (``spawn``: no forked copy of the trainer's threads and locks), load the
function once, report ready, then serve calls until their pipe closes (the parent's exit, even a
kill -9, closes it), so none outlives the run.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rewards.concurrent import Outcome

READY = "ready"
START_TIMEOUT_S = 300.0  # a worker that cannot import the function in this time is a broken setup


def _serve(conn: Connection, path: str, cfg: Any) -> None:
    """Worker process: load ``path`` once, then answer ``(i, sample)`` with ``(i, ok, value)``."""
    from rollout.functions import call, load_configured

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn = load_configured("custom_rm_path", path)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails the call
        conn.send((None, False, f"{type(err).__name__}: {err}"))
        return
    conn.send(READY)
    while True:
        try:
            i, sample = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            out = (i, True, call(fn, cfg, sample))
        except BaseException as err:  # noqa: BLE001 - any user error is an outcome
            out = (i, False, f"{type(err).__name__}: {err}")
        try:
            conn.send(out)
        except Exception as err:  # noqa: BLE001 - an unpicklable return value
            conn.send((i, False, f"reward value cannot be sent back: {type(err).__name__}: {err}"))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    started: float
    ready: bool = False
    call: int | None = None  # index of the call it runs
    call_start: float = 0.0


@dataclass
class RewardWorkers:
    """At most ``size`` processes running the ``custom_rm_path`` function ``path(cfg, sample)``."""

    path: str
    cfg: Any = None
    size: int = 4
    workers: list[_Worker] = field(default_factory=list)
    replaced: int = 0  # workers killed after a timeout or found dead

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def map(self, samples: list, timeout_s: float) -> list[Outcome]:
        """One ``Outcome`` per sample, in order: the value, ``Type: message`` of what the
        function raised, or ``timed out after {timeout_s}s`` (from the call's hand-over)."""
        results: list[Outcome | None] = [None] * len(samples)
        todo = deque(range(len(samples)))
        try:
            while todo or any(w.call is not None for w in self.workers):
                self._start(min(self.size, len(todo) + self._busy()))
                for w in self.workers:
                    if w.ready and w.call is None and todo:
                        w.call, w.call_start = todo.popleft(), time.monotonic()
                        w.conn.send((w.call, samples[w.call]))
                self._collect(results, timeout_s)
        except BaseException:
            self.close()  # a Ctrl-C mid-batch: no worker keeps running a call nobody waits for
            raise
        return [r if r is not None else Outcome(False, error="not run") for r in results]

    def _busy(self) -> int:
        return sum(w.call is not None for w in self.workers)

    def _start(self, wanted: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        while len(self.workers) < wanted:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, self.path, self.cfg), daemon=True,
                                  name="rlake-reward")
            process.start()
            child.close()
            self.workers.append(_Worker(process, parent, time.monotonic()))

    def _collect(self, results: list[Outcome | None], timeout_s: float) -> None:
        """Wait for a reply, a death, a worker ready, or the next deadline; settle what happened."""
        now = time.monotonic()
        deadlines = [w.call_start + timeout_s for w in self.workers if w.call is not None]
        deadlines += [w.started + START_TIMEOUT_S for w in self.workers if not w.ready]
        wait_s = max(min(deadlines, default=now + 1.0) - now, 0.0)
        wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], wait_s)
        for w in list(self.workers):
            if w.conn.poll():
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    message = None
                if message == READY:
                    w.ready = True
                    continue
                if message is not None and message[0] is None:  # the function did not load
                    self._drop(w)
                    raise RuntimeError(f"custom_rm_path '{self.path}' cannot be loaded in a reward "
                                       f"worker: {message[2]}")
                if message is not None:
                    i, ok, value = message
                    results[i] = Outcome(True, value) if ok else Outcome(False, error=value)
                    w.call = None
                    continue
            if not w.process.is_alive():
                if w.call is not None:
                    results[w.call] = Outcome(False, error=f"reward worker died (exit code "
                                                           f"{w.process.exitcode})")
                elif not w.ready:
                    self._drop(w)
                    raise RuntimeError(f"a reward worker for '{self.path}' exited at start "
                                       f"(exit code {w.process.exitcode})")
                self._drop(w)
            elif w.call is not None and time.monotonic() - w.call_start >= timeout_s:
                results[w.call] = Outcome(False, error=f"timed out after {timeout_s}s")
                self._drop(w)
            elif not w.ready and time.monotonic() - w.started >= START_TIMEOUT_S:
                self._drop(w)
                raise RuntimeError(f"a reward worker for '{self.path}' did not start in "
                                   f"{START_TIMEOUT_S:.0f}s")

    def _drop(self, w: _Worker, replaced: bool = True) -> None:
        """Kill and reap one worker; the next dispatch starts a fresh one if it is needed."""
        if w.process.is_alive():
            w.process.kill()
        w.process.join()
        w.conn.close()
        self.workers.remove(w)
        self.replaced += replaced

    def close(self) -> None:
        """Stop every worker (safe to call twice; the next ``map`` starts fresh ones)."""
        for w in list(self.workers):
            self._drop(w, replaced=False)
