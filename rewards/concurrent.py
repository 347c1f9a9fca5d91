"""Run calls concurrently with a per-call time limit, never waiting on a hung one.

``concurrent.futures.ThreadPoolExecutor`` cannot give up on a call: leaving its ``with`` block
(and the interpreter's exit) joins every worker, so one reward function stuck in a loop or a
socket hangs the run forever. Here ``max_workers`` daemon threads take calls from a shared
counter; a call still running ``timeout_s`` after it started is reported as timed out, its
worker is abandoned (a daemon: it cannot block exit) and a fresh worker takes its place.
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


def run_call(call: Callable[[], Any]) -> Outcome:
    """``call()`` as an ``Outcome``: its value, or its exception as ``Type: message``."""
    try:
        return Outcome(True, call())
    except BaseException as err:  # noqa: BLE001 - any user error is an outcome
        return Outcome(False, error=f"{type(err).__name__}: {err}")


def run_concurrently(calls: list[Callable[[], Any]], timeout_s: float,
                     max_workers: int = 8) -> list[Outcome]:
    """``[Outcome]`` in the order of ``calls``: the value, the exception (``Type: message``) or
    ``timed out after {timeout_s}s`` (measured from the call's own start)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    n = len(calls)
    results: list[Outcome | None] = [None] * n
    cond = threading.Condition()
    running: dict[int, tuple[float, int]] = {}  # call -> (start time, worker id)
    abandoned: set[int] = set()
    state = {"next": 0, "done": 0, "workers": 0}

    def worker(wid: int) -> None:
        while True:
            with cond:
                if wid in abandoned or state["next"] >= n:
                    return
                i = state["next"]
                state["next"] += 1
                running[i] = (time.monotonic(), wid)
            out = run_call(calls[i])
            with cond:
                if results[i] is None:
                    results[i] = out
                    state["done"] += 1
                running.pop(i, None)
                cond.notify_all()

    def spawn() -> None:
        state["workers"] += 1
        threading.Thread(target=worker, args=(state["workers"],), daemon=True,
                         name=f"rlake-reward-{state['workers']}").start()

    with cond:
        for _ in range(min(max_workers, n)):
            spawn()
        while state["done"] < n:
            now = time.monotonic()
            for i, (t0, wid) in list(running.items()):
                if now - t0 >= timeout_s:
                    results[i] = Outcome(False, error=f"timed out after {timeout_s}s")
                    state["done"] += 1
                    del running[i]
                    abandoned.add(wid)
                    spawn()
            deadline = min((t0 + timeout_s for t0, _ in running.values()), default=now + timeout_s)
            if state["done"] < n:
                cond.wait(timeout=max(deadline - time.monotonic(), 0.0) + 1e-3)
    return [r if r is not None else Outcome(False, error="not run") for r in results]
