"""Run calls concurrently with a per-call time limit, never waiting on a hung one.

``concurrent.futures.ThreadPoolExecutor`` cannot give up on a call: leaving its ``with`` block
(and the interpreter's exit) joins every worker, so one reward function stuck in a loop or a
socket hangs the run forever. Here every call runs in its own daemon thread, at most
``max_workers`` at once; a call still running ``timeout_s`` after it started is reported as timed
out, its slot is freed, and its thread is abandoned (a daemon: it cannot block exit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    ok: bool
    value: Any = None
    error: str | None = None


def run_concurrently(calls: list[Callable[[], Any]], timeout_s: float,
                     max_workers: int = 8) -> list[Outcome]:
    """``[Outcome]`` in the order of ``calls``: the value, the exception (``Type: message``) or
    ``timed out after {timeout_s}s`` (measured from the call's own start)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    results: list[Outcome | None] = [None] * len(calls)
    cond = threading.Condition()
    started: dict[int, float] = {}
    next_call = 0

    def runner(i: int) -> None:
        try:
            out = Outcome(True, calls[i]())
        except BaseException as err:  # noqa: BLE001 - any user error is an outcome
            out = Outcome(False, error=f"{type(err).__name__}: {err}")
        with cond:
            if results[i] is None:
                results[i] = out
            started.pop(i, None)
            cond.notify_all()

    with cond:
        while True:
            while next_call < len(calls) and len(started) < max_workers:
                started[next_call] = time.monotonic()
                threading.Thread(target=runner, args=(next_call,), daemon=True,
                                 name=f"rlake-call-{next_call}").start()
                next_call += 1
            if not started and next_call >= len(calls):
                break
            now = time.monotonic()
            for i, t0 in list(started.items()):
                if now - t0 >= timeout_s:
                    results[i] = Outcome(False, error=f"timed out after {timeout_s}s")
                    del started[i]
            if started:
                wait = min(t0 + timeout_s for t0 in started.values()) - time.monotonic()
                cond.wait(timeout=max(wait, 0.0) + 1e-3)
    return [r if r is not None else Outcome(False, error="not run") for r in results]
