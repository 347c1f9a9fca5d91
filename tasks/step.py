"""The decorator of the pipeline's steps: a Prefect task, or a plain call where the run says so.

With ``prefect_task_runs: true`` (the default) each step an iteration calls (generate, score,
the lake write, the slice read, train, publish, record, eval) is a Prefect task run, visible in
the UI under the iteration's flow run. With ``false`` the iteration stays one flow run (its
state, parameters, tags and result) and its steps are plain calls with the same retries: a
Prefect task run costs its own engine a few ms and Prefect's server ~10-20 ms of CPU, which on
two cores is a quarter of a quickstart iteration (docs/operations.md, Async mode).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import BaseAnnotation

_POOL: ThreadPoolExecutor | None = None


def task_runs(rt: Any) -> bool:
    """Whether the run ``rt`` (a runtime or a side: anything with ``cfg``) records task runs."""
    return rt.cfg.prefect_task_runs


def _unwrapped(value: Any) -> Any:
    """``quote(x)`` -> ``x``, as Prefect does for a task's parameters."""
    return value.unwrap() if isinstance(value, BaseAnnotation) else value


class StepTask:
    """A step: ``step(rt, ...)`` and ``step.submit(rt, ...)`` run it as a Prefect task run, or,
    when ``task_runs(rt)`` is false, call ``fn`` (``submit``: on a worker thread, as Prefect's
    thread pool task runner would), retrying a raising call ``retries`` times
    ``retry_delay_seconds`` apart."""

    def __init__(self, fn: Callable[..., Any], name: str, retries: int = 0,
                 retry_delay_seconds: float = 0.0) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.retries, self.retry_delay_seconds = retries, retry_delay_seconds
        self.task = task(name=name, cache_policy=NO_CACHE, retries=retries,
                         retry_delay_seconds=retry_delay_seconds)(fn)

    def __call__(self, rt: Any, *args: Any, **kwargs: Any) -> Any:
        if task_runs(rt):
            return self.task(rt, *args, **kwargs)
        return self.call(rt, *args, **kwargs)

    def submit(self, rt: Any, *args: Any, **kwargs: Any) -> Any:
        """A future whose ``result()`` is the step's return value (or raises its error)."""
        if task_runs(rt):
            return self.task.submit(rt, *args, **kwargs)
        global _POOL
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlake-step")
        future: Future = _POOL.submit(self.call, rt, *args, **kwargs)
        return future

    def call(self, rt: Any, *args: Any, **kwargs: Any) -> Any:
        """The step without a task run: ``fn`` with its parameters unquoted, and its retries."""
        args = tuple(_unwrapped(a) for a in args)
        kwargs = {k: _unwrapped(v) for k, v in kwargs.items()}
        attempt = 0
        while True:
            try:
                return self.fn(rt, *args, **kwargs)
            except Exception:
                if attempt >= self.retries:
                    raise
                attempt += 1
                time.sleep(self.retry_delay_seconds)


def step_task(name: str, retries: int = 0, retry_delay_seconds: float = 0.0
              ) -> Callable[[Callable[..., Any]], StepTask]:
    """``@step_task(name=..., retries=...)``: the step's Prefect task (no result cache) and its
    plain form; the function's first parameter is the run (``rt``)."""
    def wrap(fn: Callable[..., Any]) -> StepTask:
        return StepTask(fn, name, retries, retry_delay_seconds)
    return wrap
