"""Iteration flow runs created ahead of their iterations, off the iteration's path.

A subflow call makes Prefect send, before the flow function starts: the parent flow run's
tracking task run, a look-up of an existing subflow run, the flow, the flow run (4 round trips,
plus a CSRF token). ``IterationRuns`` sends the same records for the next iterations (i+1, and
i+2 as a spare: ``RUNS_AHEAD``) from a background thread while iteration i runs, and runs each
iteration with Prefect's own engine on the pre-created flow run
(``prefect.flow_engine.run_flow(flow, flow_run=...)``): the iteration is the same flow run, a
child of the run's flow run, with its tags, states, task runs and logs.

    with IterationRuns(rl_iteration) as runs:          # inside the rl_run flow
        for i in ...:
            runs.run({"run_id": r, "iteration": i},
                     upcoming=ahead(i, n, lambda j: {"run_id": r, "iteration": j}))

With ``nested=False`` the runs are not subflows of the calling flow run but top-level runs
carrying its tags (the first one is created here too, before it runs): Prefect's server keeps
a tracking task run in the parent for each subflow and writes each of the subflow's state
changes to it again, which doubled its CPU per iteration (~50 vs ~25 ms a flow run, 2026-11-27,
docs/operations.md). Async mode runs this way: there the server's CPU competes with the two
sides for the machine's cores.

A pre-created run waits in state Pending named ``PREFETCHED`` until its iteration takes it. One
never taken (the run stopped, failed or ended early) is deleted on exit; after a kill -9 the
resume deletes it (``infra.recovery.delete_prefetched``), so no run that never started is left
behind, nor marked Crashed. A run still Pending whose iteration the lake holds as committed,
or that has task runs, did run (its Running state was queued when the process died): resume
marks it Crashed.

An iteration on a pre-created run waits for no request either: the engine's own writes for it
(Running, then Completed or Failed) go to the same background thread, in order and ahead of
the creations queued there (``Writer``), and the engine goes on as if the server had accepted
them (``_ReportingClient``); its read of the run is answered from its own copy, its update of
the run (the values the run was created with) is dropped. A state change costs the server
~40-50 ms here (orchestration rules over SQLite): the 4 requests an iteration waited for took
~0.13-0.17 s of its ~0.5-0.6 s (2026-11-25, docs/operations.md). One thread sends all of them, so no two of rlake's writes meet at the
server's SQLite; a collision with the server's own writers (its 503 "database is locked") is
sent again within ~0.8 s (``LockRetryTransport``) instead of Prefect's 2 s client retry. A final
state that waits for its iteration's commit (run behind) is queued when that commit ends, so it
holds back none of the writes queued after it; the flow upsert Prefect's client sends before
each creation goes out once (``FlowUpsertCache``): that thread's requests are what the next
iteration may wait for.
What that gives up: the server's answer. A run cancelled from the UI while its iteration runs is
not stopped by its Running being rejected (cancel the parent ``rl_run``: its own states are
still orchestrated), and a state the server refuses or cannot take is logged, not raised (the
lake, not Prefect, is the run's record; the iteration's states land a few ms to a few hundred ms
after they happen, stamped by the server when they land).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from uuid import uuid4

import httpx
from prefect import Flow, Task, tags
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.responses import (
    OrchestrationResult,
    SetStateStatus,
    StateAcceptDetails,
)
from prefect.context import FlowRunContext, TagsContext
from prefect.flow_engine import FlowRunEngine
from prefect.states import Failed, Pending, State

from infra.interrupts import raise_noted_interrupt
from infra.recovery import PREFETCHED, delete_with_tracker

logger = logging.getLogger(__name__)


# ``send(write, after=None)``: queue ``write(client)``, once the future ``after`` has ended
Send = Callable[..., None]


def _key(parameters: dict[str, Any], tags: set[str]) -> tuple:
    return tuple(sorted(parameters.items())), tuple(sorted(tags))


# True while a flow function runs on a pre-created run (``run_reported``): its final state waits
# for the work the function leaves behind; a plain subflow call's goes out as the function returns
_FINAL_STATE_HELD: ContextVar[bool] = ContextVar("rlake_final_state_held", default=False)


def final_state_held() -> bool:
    """Whether the flow function running now is on a run whose final state waits for the work
    it leaves behind (``IterationRuns``' ``hold``): only then may it leave work behind."""
    return _FINAL_STATE_HELD.get()


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


class _ReportingClient(SyncPrefectClient):
    """The flow engine's client for one pre-created run: the run's own writes are handed to
    ``send`` (the background thread) and answered at once as accepted; reading the run gives the
    engine's own copy. Everything else is the engine's client itself (the same connection)."""

    def __init__(self, client: SyncPrefectClient, flow_run: FlowRun, send: Send,
                 hold: Callable[[], Future | None]) -> None:
        self.__dict__.update(client.__dict__)
        self._flow_run = flow_run
        self._send = send
        self._hold = hold

    def read_flow_run(self, flow_run_id):
        if flow_run_id == self._flow_run.id:
            return self._flow_run
        return super().read_flow_run(flow_run_id)

    def update_flow_run(self, flow_run_id, **fields):
        if flow_run_id == self._flow_run.id and set(fields) <= {"flow_version", "empirical_policy"}:
            # the engine re-sends what ``IterationRuns._create`` created the run with (the flow's
            # version and retry policy, no field left unset): nothing to write
            return None
        self._send(lambda client: client.update_flow_run(flow_run_id, **fields))

    def set_flow_run_state(self, flow_run_id, state: State, force: bool = False,
                           **kwargs) -> OrchestrationResult:
        # a copy: the engine goes on changing the state it proposed (its data, details)
        sent = state.model_copy(update={"state_details": state.state_details.model_copy()})
        held = self._hold() if state.is_final() else None

        def propose(client: SyncPrefectClient) -> None:
            nonlocal sent
            if held is not None:  # the run's work that went on behind it has ended by now
                err = held.exception()
                if err is not None and sent.is_completed():
                    sent = Failed(message=f"its commit, run behind, failed: {err!r}")
            result = client.set_flow_run_state(flow_run_id, sent, force=force, **kwargs)
            if result.status != SetStateStatus.ACCEPT:
                logger.warning("Prefect did not take state %s of flow run %s: %s %s", sent.name,
                               flow_run_id, result.status.value, result.details)
        self._send(propose, after=held)
        return OrchestrationResult(state=state, status=SetStateStatus.ACCEPT,
                                   details=StateAcceptDetails())


class _ReportingEngine(FlowRunEngine):
    """Prefect's flow engine with ``_ReportingClient`` as its client (set ``send`` and ``hold``
    first)."""

    send: Send
    hold: Callable[[], Future | None]
    _reporting: _ReportingClient | None = None

    @property
    def client(self) -> SyncPrefectClient:
        client = FlowRunEngine.client.fget(self)
        if self._reporting is None:
            self._reporting = _ReportingClient(client, self.flow_run, self.send, self.hold)
        return self._reporting


def run_reported(flow: Flow, flow_run: FlowRun, parameters: dict[str, Any], send: Send,
                 hold: Callable[[], Future | None] = lambda: None) -> Any:
    """``flow(**parameters)`` on ``flow_run`` with Prefect's engine (the loop of
    ``prefect.flow_engine.run_flow_sync``), its writes for the run handed to ``send``. The run's
    final state is handed over once the future ``hold()`` gives when the flow function returns
    has ended (work it left running behind it: ``flows.steps.run_behind``); Completed becomes
    Failed if that work failed."""
    engine = _ReportingEngine(flow=flow, flow_run=flow_run, parameters=parameters)
    engine.send = send
    engine.hold = hold
    with engine.start():
        while engine.is_running():
            with engine.run_context():
                engine.call_flow_fn()
    return engine.result()


class Writer:
    """One background thread that runs the calls submitted to it, ``urgent`` ones first: a
    running iteration's own states go before run creations and deletions queued earlier (a
    creation is 2 requests, ~0.1 s, longer while the server is busy), so a kill -9 a moment
    after an iteration started rarely finds its Running still queued. Each lane runs in
    submission order; one thread, so no two writes meet at the server's SQLite."""

    URGENT, LATER, STOP = 0, 1, 2

    def __init__(self, name: str) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> Future:
        """Queue ``fn(*args)``; its future holds the result or the exception."""
        future: Future = Future()
        self._queue.put((self.URGENT if urgent else self.LATER, next(self._order), fn, args, future))
        return future

    def shutdown(self) -> None:
        """Run everything queued, then stop the thread."""
        self._queue.put((self.STOP, next(self._order), None, (), None))
        self._thread.join()

    def _loop(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(exc)


class LockRetryTransport(httpx.BaseTransport):
    """HTTP transport that sends a request again after a short pause while the server answers
    503, ``LOCK_RETRY_DELAYS_S`` in turn, before handing the 503 to Prefect's client (which
    waits ~2 s, then 4, 8, ... before its own retries).

    Prefect's server answers 503 when its SQLite database is locked: in WAL mode a transaction
    that read and then writes fails at once (no busy wait) when another connection wrote
    meanwhile, which the server's own event recorders do all the time (the task runs of both
    sides are recorded from events). The request's transaction was rolled back, so sending it
    again is what Prefect's client does anyway, only 2 s later: the run created ahead for the
    next iteration then came late and the training loop stalled ~2 s in 2-3 of 100 iterations
    (async mode, 2026-11-26: `create_task_run`'s INSERT, "database is locked")."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self.inner = inner or httpx.HTTPTransport(retries=3)  # Prefect's own connect retries

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in LOCK_RETRY_DELAYS_S:
            response = self.inner.handle_request(request)
            if response.status_code != 503:
                return response
            response.read()
            response.close()
            time.sleep(delay)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


# how long closing waits for a final state to be queued after its commit (``_send``'s
# ``after``): the commits have been waited for (``flows.steps.settle_commit``) by then
DEFERRED_WRITE_WAIT_S = 60.0

# pauses before sending a request again that the server answered 503 (0.77 s in all)
LOCK_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2, 0.4)


class FlowUpsertCache(httpx.BaseTransport):
    """HTTP transport that answers Prefect's flow upsert (``POST .../flows/``) from the first
    answer to the same body: Prefect's ``create_flow_run`` sends it before every flow run it
    creates, and it gives the same flow id each time. One request fewer per iteration for the
    one thread that sends all of an iteration's writes one after another (~4 ms of the server's
    CPU, measured 2026-11-27: 24 -> 20 ms a flow run with its Running and Completed). A failed
    flow run creation (the flow deleted meanwhile) empties the cache."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self._flows: dict[bytes, tuple[int, bytes]] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method != "POST" or not path.endswith(("/flows/", "/flow_runs/")):
            return self.inner.handle_request(request)
        if path.endswith("/flows/") and (known := self._flows.get(request.content)) is not None:
            status, content = known  # the body decoded: no Content-Encoding to repeat
            return httpx.Response(status, headers={"content-type": "application/json"},
                                  content=content, request=request)
        response = self.inner.handle_request(request)
        if path.endswith("/flow_runs/"):
            if response.status_code >= 300:
                self._flows.clear()
        elif response.status_code in (200, 201):
            self._flows[request.content] = (response.status_code, response.read())
        return response

    def close(self) -> None:
        self.inner.close()


def create_flow_run_once(client: SyncPrefectClient, flow: Flow, parameters: dict[str, Any],
                         tags: set[str], parent_task_run_id: Any, state: State) -> FlowRun:
    """``client.create_flow_run`` with an idempotency key: Prefect's client sends a request again
    when its answer does not come within ``PREFECT_API_REQUEST_TIMEOUT`` (60 s; it happens: the
    embedded server has gone ~60 s without answering, docs/operations.md), and a creation that
    did land then made a second run, left Pending behind. The server answers a creation with the
    key of one it has with that run instead (its tracking task run's ``dynamic_key`` does the
    same for ``create_task_run``)."""
    from prefect.client.schemas.actions import FlowRunCreate
    from prefect.client.schemas.objects import FlowRunPolicy
    from prefect.states import to_state_create

    body = FlowRunCreate(
        flow_id=client.create_flow(flow), flow_version=flow.version, parameters=parameters,
        tags=sorted(tags), parent_task_run_id=parent_task_run_id, state=to_state_create(state),
        empirical_policy=FlowRunPolicy(retries=flow.retries,
                                       retry_delay=int(flow.retry_delay_seconds or 0)),
        idempotency_key=uuid4().hex)
    response = client.request("POST", "/flow_runs/", json=body.model_dump(mode="json", exclude_unset=True))
    return FlowRun.model_validate(response.json())


# flow runs kept created ahead: the next iteration's, and one spare, so that a slow answer of
# the server (it is busy with the other process's records in async mode) is absorbed by a
# whole iteration instead of stalling the next one (measured 2026-11-25: with one ahead, the
# async training loop waited ~10% of its time for the next run's creation)
RUNS_AHEAD = 2


def ahead(iteration: int, stop: int, parameters: Callable[[int], dict[str, Any]],
          extra_tags: Callable[[int], set[str] | None] = lambda _: None
          ) -> list[tuple[dict[str, Any], set[str] | None]]:
    """``upcoming`` for ``IterationRuns.run``: the ``RUNS_AHEAD`` iterations after
    ``iteration``, below ``stop``."""
    return [(parameters(j), extra_tags(j)) for j in range(iteration + 1, min(stop, iteration + 1 + RUNS_AHEAD))]


class IterationRuns:
    """Hands out flow runs of ``flow`` created ahead of time (see the module docstring)."""

    def __init__(self, flow: Flow, hold: Callable[[], Future | None] = lambda: None,
                 nested: bool = True) -> None:
        self.hold = hold  # run_reported's: what a run's final state waits for
        self.nested = nested  # False: top-level runs with the parent's tags (module docstring)
        # the next run is created once this one is Running (``_running``): its creation is
        # queued after this run's Running, and waits for every state queued later (``Writer``)
        self.flow = flow.with_options(on_running=[*flow.on_running_hooks, self._running])
        self._next: list[tuple[dict[str, Any], set[str] | None]] = []
        self._pool: Writer | None = None
        self._client = None
        self._pending: dict[tuple, Future] = {}
        self._parent = None
        self._tags: set[str] = set()
        self._deferred: list[threading.Event] = []  # final states queued once a commit ends

    def __enter__(self) -> IterationRuns:
        self._tags = set(TagsContext.get().current_tags)  # every run's; each adds its own
        ctx = FlowRunContext.get()
        self._parent = ctx.flow_run if ctx is not None else None
        if self._parent is not None:  # outside a flow run there is nothing to attach runs to
            self._pool = Writer("rlake-prefetch")
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
            self._pending[key] = self._pool.submit(self._create, parameters, tags)

    def run(self, parameters: dict[str, Any], extra_tags: set[str] | None = None,
            upcoming: Sequence[tuple[dict[str, Any], set[str] | None]] = ()) -> Any:
        """Run the flow for ``parameters`` (on its pre-created run if there is one, else as a
        plain subflow call) with ``extra_tags`` on it; once it is Running, the runs of
        ``upcoming`` (the next iterations' (parameters, extra tags), ``ahead``) not created
        yet are created meanwhile.

        A pre-created run has its tags already, and its task runs get none (``untagged``). A
        run made here by the plain call takes its tags from the context, and so do its task
        runs (the first iteration only)."""
        extra_tags = set(extra_tags or ())
        future = self._pending.pop(_key(parameters, self._tags | extra_tags), None)
        if future is None and not self.nested and self._pool is not None:
            future = self._pool.submit(self._create, parameters, self._tags | extra_tags)
        self._next = list(upcoming)
        flow_run = _created(future)
        try:
            if flow_run is None:
                with tags(*sorted(extra_tags)):
                    result = self.flow(**parameters)
            else:
                held = _FINAL_STATE_HELD.set(True)
                try:
                    with untagged():
                        result = run_reported(self.flow, flow_run, parameters, self._send, self.hold)
                finally:
                    _FINAL_STATE_HELD.reset(held)
        finally:
            self._prefetch_next()  # never Running (failed before): the next creation goes on
        raise_noted_interrupt()  # a Ctrl-C the flow engine swallowed once the run was final
        return result

    def _running(self, flow, flow_run, state) -> None:
        """The flow's on-running hook: its Running state is written (or queued)."""
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        upcoming, self._next = self._next, []
        for parameters, extra_tags in upcoming:
            self.prefetch(parameters, extra_tags)

    def _send(self, write: Callable[[SyncPrefectClient], Any], after: Future | None = None) -> None:
        """Queue ``write(client)`` for the background thread, after the writes queued before,
        ahead of the creations and deletions queued (``Writer``); with ``after``, once that
        future has ended. A run's final state waits for its commit behind this way: waiting on
        the thread instead held back every write queued after it (the next runs' Running and
        creations) for as long as the commit took, and the training loop then waited for its
        next run (measured 2026-11-27, async: ``outside_flow``)."""
        if after is None or after.done():
            self._pool.submit(self._write, write, urgent=True)
            return
        queued = threading.Event()
        self._deferred = [*(e for e in self._deferred if not e.is_set()), queued]

        def queue_write(_: Future) -> None:
            self._pool.submit(self._write, write, urgent=True)
            queued.set()
        after.add_done_callback(queue_write)

    def close(self) -> None:
        """Let the queued writes land; delete the runs created and never taken; stop the
        thread."""
        if self._pool is None:
            return
        for queued in self._deferred:  # final states waiting for a commit: it has ended
            queued.wait(DEFERRED_WRITE_WAIT_S)
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

            self._client = get_client(sync_client=True,
                                      httpx_settings={"transport": FlowUpsertCache(LockRetryTransport())})
            self._client.__enter__()
        return self._client

    def _write(self, write: Callable[[SyncPrefectClient], Any]) -> None:
        try:
            write(self._client_())
        except Exception as exc:  # noqa: BLE001 - a lost record must not stop the run
            logger.warning("a Prefect write for an iteration's flow run failed: %r", exc)

    def _create(self, parameters: dict[str, Any], tags: set[str]):
        """The records a subflow call creates (``prefect.flow_engine.FlowRunEngine.
        create_flow_run``): the parent's tracking task run, then the flow run under it (only
        the flow run, not ``nested``)."""
        client = self._client_()
        parent = None
        if self.nested:
            tracker = Task(name=self.flow.name, fn=self.flow.fn, version=self.flow.version)
            tracker._is_subflow_tracking_task = True
            key = uuid4().hex  # a key no counter-made one takes (Prefect's own keys are 0, 1, ...)
            parent = client.create_task_run(
                task=tracker, name=f"{self.flow.name}-{key[:8]}", flow_run_id=self._parent.id,
                dynamic_key=key, state=Pending(), task_inputs={k: [] for k in parameters},
                extra_tags=tags).id
        return create_flow_run_once(client, self.flow, self.flow.serialize_parameters(parameters),
                                    tags, parent, Pending(name=PREFETCHED))

    def _delete(self, future: Future) -> None:
        flow_run = _created(future)
        if flow_run is None:  # never created: nothing to delete
            return
        delete_with_tracker(self._client_(), flow_run)

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None
