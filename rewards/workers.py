"""Custom reward functions in worker processes, so a call past its time limit can be killed.

A thread cannot be stopped: a ``custom_rm_path`` function that busy-loops keeps its thread
spinning (and holding the GIL) after its sample was given up on, and every later training step
slows down. Here each call runs in one of at most ``size`` spawned processes; a call still
running ``timeout_s`` after it was handed to its worker fails its sample, and that worker is
killed (SIGKILL) and replaced. A worker that dies mid-call (segfault, ``os._exit``) fails only
its sample.

Workers start on demand (fresh interpreters, ``python -m rewards.workers``: no forked copy of
the trainer's threads and locks), load the function once, report ready, then serve calls until
their stdin closes (the parent's exit, even a kill -9, closes it). A worker mid-call never reads
stdin, so each also dies with its parent (``PR_SET_PDEATHSIG``): none outlives the run, not even
one busy-looping when the run is killed. Messages are length-prefixed pickles over the worker's
stdin/stdout.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import IO, Any

from infra.spawned import die_with_parent, launch_lasting
from rewards.concurrent import Outcome

READY = "ready"
START_TIMEOUT_S = 300.0  # a worker that cannot import the function in this time is a broken setup
_HEADER = struct.Struct("<Q")


def send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    """One message; ``EOFError`` when the other side is gone."""
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))  # noqa: S301 - our own child process


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _serve() -> None:
    """Worker process (``python -m rewards.workers``): take ``(sys.path, path, cfg)``, load the
    function once, then answer ``(i, sample)`` with ``(i, ok, value)`` until stdin closes.

    A plain interpreter, not multiprocessing's spawn, which would first import the parent's
    ``__main__`` (for ``rlake``: the whole CLI, 6 s and 170 MB per worker, measured here)."""
    die_with_parent(int(sys.argv[1]))  # a kill -9 of the run: stdin's EOF is never read mid-call
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to stderr, never into the reply pipe
    try:
        sys.path[:], path, cfg = receive(inp)
        from rollout.functions import call, load_configured

        fn = load_configured("custom_rm_path", path)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        send(out, (None, False, f"{type(err).__name__}: {err}"))
        return
    send(out, READY)
    while True:
        try:
            i, sample = receive(inp)
        except EOFError:  # the parent is gone
            return
        try:
            reply = (i, True, call(fn, cfg, sample))
        except BaseException as err:  # noqa: BLE001 - any user error is an outcome
            reply = (i, False, f"{type(err).__name__}: {err}")
        try:
            send(out, reply)
        except Exception as err:  # noqa: BLE001 - an unpicklable return value
            send(out, (i, False, f"reward value cannot be sent back: {type(err).__name__}: {err}"))


@dataclass
class _Worker:
    process: subprocess.Popen
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
    # Scorers share a pool (rewards.registry.shared_workers): one batch at a time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def map(self, samples: list, timeout_s: float) -> list[Outcome]:
        """One ``Outcome`` per sample, in order: the value, ``Type: message`` of what the
        function raised, or ``timed out after {timeout_s}s`` (from the call's hand-over)."""
        with self._lock:
            return self._map(samples, timeout_s)

    def _map(self, samples: list, timeout_s: float) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(samples)
        todo = deque(range(len(samples)))
        try:
            while todo or any(w.call is not None for w in self.workers):
                self._start(min(self.size, len(todo) + self._busy()))
                for w in self.workers:
                    if w.ready and w.call is None and todo:
                        w.call, w.call_start = todo.popleft(), time.monotonic()
                        try:
                            send(w.process.stdin, (w.call, samples[w.call]))
                        except OSError:  # it died since: _collect sees the closed pipe
                            pass
                self._collect(results, timeout_s)
        except BaseException:
            self.close()  # a Ctrl-C mid-batch: no worker keeps running a call nobody waits for
            raise
        return [r if r is not None else Outcome(False, error="not run") for r in results]

    def _busy(self) -> int:
        return sum(w.call is not None for w in self.workers)

    def _start(self, wanted: int) -> None:
        while len(self.workers) < wanted:
            # from one lasting thread: each worker dies with this process (``_serve``)
            process = launch_lasting([sys.executable, "-m", "rewards.workers", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            send(process.stdin, (list(sys.path), self.path, self.cfg))
            self.workers.append(_Worker(process, time.monotonic()))

    def _collect(self, results: list[Outcome | None], timeout_s: float) -> None:
        """Wait for a reply, a death, a worker ready, or the next deadline; settle what happened."""
        now = time.monotonic()
        deadlines = [w.call_start + timeout_s for w in self.workers if w.call is not None]
        deadlines += [w.started + START_TIMEOUT_S for w in self.workers if not w.ready]
        wait_s = max(min(deadlines, default=now + 1.0) - now, 0.0)
        readable = wait([w.process.stdout for w in self.workers], wait_s)
        for w in list(self.workers):
            if w.process.stdout in readable:
                try:
                    message = receive(w.process.stdout)
                except (EOFError, OSError):  # it died: the pipe's end is what woke us
                    w.process.wait()
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
            if w.process.poll() is not None:
                if w.call is not None:
                    results[w.call] = Outcome(False, error=f"reward worker died (exit code "
                                                           f"{w.process.returncode})")
                elif not w.ready:
                    self._drop(w)
                    raise RuntimeError(f"a reward worker for '{self.path}' exited at start "
                                       f"(exit code {w.process.returncode})")
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
        if w.process.poll() is None:
            w.process.kill()
        w.process.wait()
        for pipe in (w.process.stdin, w.process.stdout):
            pipe.close()
        self.workers.remove(w)
        self.replaced += replaced

    def close(self) -> None:
        """Stop every worker (safe to call twice; the next ``map`` starts fresh ones)."""
        for w in list(self.workers):
            self._drop(w, replaced=False)


if __name__ == "__main__":
    _serve()
