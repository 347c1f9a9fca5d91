"""Iteration flow runs created one iteration ahead, off the iteration's path.

A subflow call makes Prefect send, before the flow function starts: the parent flow run's
tracking task run, a look-up of an existing subflow run, the flow, the flow run (4 round trips,
plus a CSRF token). ``IterationRuns`` sends the same records for iteration i+1 from a background
thread while iteration i runs, and runs each iteration with Prefect's own engine on the
pre-created flow run (``prefect.flow_engine.run_flow(flow, flow_run=...)``): the iteration is
the same flow run, a child of the run's flow run, with its tags, states, task runs and logs.

    with IterationRuns(rl_iteration) as runs:          # inside the rl_run flow
        for i in ...:
            runs.run({"run_id": r, "iteration": i}, next_parameters={"run_id": r, "iteration": i + 1})

A pre-created run waits in state Pending named ``PREFETCHED`` until its iteration takes it. One
never taken (the run stopped, failed or ended early) is deleted on exit; after a kill -9 the
resume deletes it (``infra.recovery.delete_prefetched``), so no run that never started is left
behind, nor marked Crashed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any
from uuid import uuid4

from prefect import Flow, Task, tags
from prefect.context import FlowRunContext, TagsContext
from prefect.flow_engine import run_flow
from prefect.states import Pending

from infra.recovery import PREFETCHED, delete_with_tracker

# a run that is not Running after this long (a slow start): create the next one anyway
START_WAIT_S = 10.0


def _key(parameters: dict[str, Any], tags: set[str]) -> tuple:
    return tuple(sorted(parameters.items())), tuple(sorted(tags))


def _created(future: Future | None):
    """The flow run ``future`` created, or None (none asked for, or its creation failed: the
    iteration then creates its run itself, as a plain subflow call does)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - the fallback sends the same requests again
        return None


@contextmanager
def untagged() -> Iterator[None]:
    """Task runs started inside carry no tags (their flow run carries the run's). Prefect sends
    a tag-concurrency request to the server for every task run with tags (caching "no limit"
    per tag set for 5 s only); with a second writer on the SQLite-backed server (the prefetch
    thread, async mode's rollout process) those requests met its writes: SQLITE_BUSY -> 503 ->
    the client retries after 2 s. Async mode ran at 3.3x sync's time per iteration with a
    per-batch tag on its task runs (measured 2026-11-24, bench/async.py)."""
    with TagsContext(current_tags=set()):
        yield


class IterationRuns:
    """Hands out flow runs of ``flow`` created ahead of time (see the module docstring)."""

    def __init__(self, flow: Flow) -> None:
        # the next run is created once this one is Running (``_running``), not while this one's
        # own writes go out: two writers at once make SQLite answer busy and the client retry
        # after seconds
        self.flow = flow.with_options(on_running=[*flow.on_running_hooks, self._running])
        self._started = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._client = None
        self._pending: dict[tuple, Future] = {}
        self._parent = None
        self._tags: set[str] = set()

    def __enter__(self) -> IterationRuns:
        self._tags = set(TagsContext.get().current_tags)  # every run's; each adds its own
        ctx = FlowRunContext.get()
        self._parent = ctx.flow_run if ctx is not None else None
        if self._parent is not None:  # outside a flow run there is nothing to attach runs to
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlake-prefetch")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prefetch(self, parameters: dict[str, Any], extra_tags: set[str] | None = None) -> None:
        """Start creating the flow run for ``parameters`` (tagged with the current tags and
        ``extra_tags``) in the background."""
        if self._pool is None:
            return
        tags = self._tags | set(extra_tags or ())
        key = _key(parameters, tags)
        if key not in self._pending:
            self._pending[key] = self._pool.submit(self._create, parameters, tags, self._started)

    def run(self, parameters: dict[str, Any], next_parameters: dict[str, Any] | None = None,
            extra_tags: set[str] | None = None, next_tags: set[str] | None = None) -> Any:
        """Run the flow for ``parameters`` (on its pre-created run if there is one, else as a
        plain subflow call) with ``extra_tags`` on it, after asking for the next one's run
        (``next_parameters``, ``next_tags``) to be created meanwhile.

        A pre-created run has its tags already, and its task runs get none (``untagged``). A
        run made here by the plain call takes its tags from the context, and so do its task
        runs (the first iteration only)."""
        extra_tags = set(extra_tags or ())
        future = self._pending.pop(_key(parameters, self._tags | extra_tags), None)
        self._started = threading.Event()
        if next_parameters is not None:
            self.prefetch(next_parameters, next_tags)
        flow_run = _created(future)
        try:
            if flow_run is None:
                with tags(*sorted(extra_tags)):
                    return self.flow(**parameters)
            with untagged():
                return run_flow(self.flow, flow_run=flow_run, parameters=parameters)
        finally:
            self._started.set()  # never Running (failed before): the next creation goes on

    def _running(self, flow, flow_run, state) -> None:
        """The flow's on-running hook: its Running state is written."""
        self._started.set()

    def close(self) -> None:
        """Delete the runs created and never taken; stop the thread."""
        if self._pool is None:
            return
        pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.cancel()
        for future in pending:
            if not future.cancelled():
                self._pool.submit(self._delete, future).result()
        self._pool.submit(self._close_client).result()
        self._pool.shutdown()
        self._pool = None

    # on the background thread only

    def _client_(self):
        if self._client is None:
            from prefect import get_client

            self._client = get_client(sync_client=True)
            self._client.__enter__()
        return self._client

    def _create(self, parameters: dict[str, Any], tags: set[str], after: threading.Event):
        """The records a subflow call creates (``prefect.flow_engine.FlowRunEngine.
        create_flow_run``): the parent's tracking task run, then the flow run under it; once
        ``after`` is set (the current run is Running)."""
        after.wait(timeout=START_WAIT_S)
        client = self._client_()
        tracker = Task(name=self.flow.name, fn=self.flow.fn, version=self.flow.version)
        tracker._is_subflow_tracking_task = True
        key = uuid4().hex  # a key no counter-made one takes (Prefect's own keys are 0, 1, ...)
        task_run = client.create_task_run(
            task=tracker, name=f"{self.flow.name}-{key[:8]}", flow_run_id=self._parent.id,
            dynamic_key=key, state=Pending(), task_inputs={k: [] for k in parameters},
            extra_tags=tags)
        return client.create_flow_run(
            flow=self.flow, parameters=self.flow.serialize_parameters(parameters),
            state=Pending(name=PREFETCHED), parent_task_run_id=task_run.id, tags=tags)

    def _delete(self, future: Future) -> None:
        flow_run = _created(future)
        if flow_run is None:  # never created: nothing to delete
            return
        delete_with_tracker(self._client_(), flow_run)

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None
