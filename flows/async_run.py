"""Async mode (``mode: async``): the training side of the run; the rollout side runs in a second
process (flows/rollout_side.py) and the two share only the lake and the weight hand-off.

    rl_iteration(i)   (a Prefect flow run, tagged with the run and rlake-batch:i)
      wait until the rollout side sent batch i's rows    (usually already: rollout runs ahead)
      batch i's slice (version >= v - k), from the rows sent (from the lake after a resume)
      train -> v+1 -> hand v+1 to the rollout side       (in memory, at once)
      train_steps row                                    (after batch i's lake commit landed;
                                                          behind, while i + 1 trains)
      -> tell the rollout side "v+1 committed"           (it appends rows made with v+1 only
                                                          then: the lake never holds rows of a
                                                          version a crash could take back)
      evaluate (every eval_interval)

Why a process and not a thread: the tiny model's generation and training are both dominated by
Python-level per-op overhead, which holds the GIL, so a thread would mostly take turns with the
trainer; a process uses the second core. The hand-off is the state dict's raw bytes
(``infra.sides.pack_weights``) through a multiprocessing queue (its feeder thread sends while
training goes on). This side's own engine only evaluates: it takes the weights when it does.

Iteration ``i`` trains on batch ``i``: one batch per iteration, oldest first, so batch b is
trained at version b and the rollout side's wait (b - w <= k) is exactly the staleness bound.
So the slice built from the rows sent is what the lake would give once they landed (every older
batch is consumed whole; ``tasks.async_batches.batch_slice``), and the rows' append overlaps
training as in sync mode; a rollout side that dies before its commit fails the iteration before
the iteration's own commit.
On a resume the rollout side starts after the newest batch in the lake, at the data position
committed with it, with the committed weights; batches appended but not trained are trained,
never regenerated.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

import pyarrow as pa
from prefect import flow

from flows.rollout_side import batch_tag
from flows.steps import (
    commits_behind,
    eval_due,
    landed,
    phase,
    run_iterations,
    settle_commit,
    train_and_commit,
)
from infra.faults import fault_point, set_iteration
from infra.recovery import run_tag
from infra.runtime import Runtime
from infra.sides import batches_in_lake, pack_weights
from infra.spawned import SpawnedProcess
from rollout.context import rollout_stats_from_commit
from tasks.async_batches import batch_slice, read_rollout_batch
from tasks.eval import evaluate
from tasks.train import in_process_weights

# no message from a live rollout side for this long means it hangs: fail rather than wait forever
SILENCE_LIMIT_S = 900.0


def current_api_url() -> str | None:
    """The Prefect API this process talks to (the embedded server's when none is configured),
    for the rollout side to record its runs in the same place."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()  # already running inside a flow: a no-op
    return server.api_url


class RolloutProcess:
    """The training side's handle on the rollout side's process: the batches it sent (their
    rows and stats, as they are being appended) and the Delta versions their commits landed at."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.in_lake = set(batches_in_lake(rt.lake, rt.run_id))  # a resume finds some
        self.sent: dict[int, tuple[dict[str, float], pa.Table]] = {}
        self.landed: dict[int, int | None] = {}
        self.spawned: SpawnedProcess | None = None  # the rollout process, once started

    def start(self, api_url: str | None) -> RolloutProcess:
        """Run the rollout side in the process spawned when the runtime opened (it has
        imported torch and the lake meanwhile: infra/spawned.py), or in one spawned now."""
        spawned = self.rt.spawned or SpawnedProcess(self.rt.cfg.home, self.rt.cfg.torch_threads)
        self.rt.spawned, self.spawned = None, spawned  # this handle stops it from now on
        spawned.run("flows.rollout_side:rollout_process_main", {
            "config": self.rt.cfg.model_dump(), "run_id": self.rt.run_id,
            "version": self.rt.trainer.weight_version, "parent_pid": os.getpid(),
            "api_url": api_url, "run_tag": run_tag(self.rt.run_id)})
        return self

    def hand_off(self, version: int, after: Future | None = None) -> None:
        """Send the trainer's weights as ``version`` (returns at once; a feeder thread sends),
        then "``version`` committed": at once, or with ``after`` (the commit of ``version``,
        running behind) once it succeeded, from the thread that ran it (never, if it failed:
        the run fails). The rollout side generates with the weights meanwhile; it appends what
        it generated with them only once they are committed (flows/rollout_side.py).

        Sending the weights only after the commit (until 2026-11-27) left the rollout side
        idle for the commit's ~20 ms (measured in async mode: it shares the training core), and
        the training side then waited for the batch made with them."""
        self.spawned.inbox.put(("weights", version, pack_weights(in_process_weights_of(self.rt))))
        committed = ("committed", version)
        if after is None:
            self.spawned.inbox.put(committed)
        else:
            after.add_done_callback(
                lambda done: self.spawned.inbox.put(committed) if done.exception() is None else None)

    def _receive(self, timeout: float, awaited: bool = True) -> None:
        """Take one message (waiting up to ``timeout``). A rollout process gone with nothing
        left to read is an error only while something is ``awaited`` from it: one that has
        appended the run's last batch ends, and a resume may find every batch in the lake."""
        try:
            message = self.spawned.outbox.get(timeout=timeout)
        except queue.Empty:
            if awaited and not self.spawned.proc.is_alive():
                from infra.startup import resume_command  # the command with its --home/--lake

                raise RuntimeError(f"run {self.rt.run_id}: the rollout process exited "
                                   f"(code {self.spawned.proc.exitcode}); "
                                   f"`{resume_command(self.rt.run_id, self.rt.cfg)}` continues") from None
            return
        if message[0] == "error":
            raise RuntimeError(f"run {self.rt.run_id}: the rollout side failed:\n{message[1]}")
        if message[0] == "rows":
            self.sent[message[1]] = (message[2], message[3])
        elif message[0] == "appended":
            self.landed[message[1]] = message[2]
        self.last_message = time.monotonic()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Read messages as they come until ``ready()``."""
        self.last_message = time.monotonic()
        while True:
            waiting = not ready()
            self._receive(timeout=0.5 if waiting else 0.0, awaited=waiting)
            if ready():
                return
            if time.monotonic() - self.last_message > SILENCE_LIMIT_S:
                raise RuntimeError(f"run {self.rt.run_id}: no word from the rollout side for "
                                   f"{SILENCE_LIMIT_S:.0f} s while waiting for {what}")

    def wait_for_batch(self, batch: int) -> None:
        """Block until rollout batch ``batch``'s rows were sent (or it was in the lake before)."""
        self._wait(lambda: batch in self.sent or batch in self.in_lake, f"batch {batch}")

    def wait_landed(self, batch: int) -> int | None:
        """Block until batch ``batch``'s lake commit landed; its Delta version (None: no new
        rows). A rollout side that died before it raises here."""
        self._wait(lambda: batch in self.landed, f"batch {batch}'s lake commit")
        return self.landed.pop(batch)

    def batch_stats(self, batch: int) -> dict[str, float]:
        """The rollout stats of a batch appended before this process (from the lake commit that
        holds its rows)."""
        info = self.rt.lake.trajectory_commit_info(self.rt.run_id, batch)
        return rollout_stats_from_commit(info) or {}

    def stop(self) -> None:
        if self.spawned is not None:
            self.spawned.stop()
            self.spawned = None


def in_process_weights_of(rt: Runtime) -> dict:
    weights = in_process_weights(rt)
    if weights is None:
        raise RuntimeError("mode 'async' needs a trainer whose weights this process holds")
    return weights


def train_iteration(rt: Runtime, producer: RolloutProcess, iteration: int) -> dict[str, float]:
    """The training side's iteration (see the module docstring)."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    base_version = rt.trainer.weight_version
    set_iteration(iteration)
    rt.seed_iteration(iteration)
    with phase(timings, "wait_rollout"):
        producer.wait_for_batch(iteration)
    if iteration in producer.sent:  # sent by this process's rollout side, still committing
        stats, rows = producer.sent.pop(iteration)
        reader = partial(_slice_of_sent, rows=rows, batch=iteration, producer=producer)
    else:  # appended before this process started (a resume): the lake has it
        fault_point("after_lake_append")
        stats = producer.batch_stats(iteration)
        reader = partial(_read_batch, batch=iteration)
    # the rollout side's own phase times, kept apart from the training side's time/*
    stats = {k.replace("time/", "rollout/time_"): v for k, v in stats.items()}
    evaluating = eval_due(rt, iteration + 1, rt.cfg.num_rollout)
    # the engine here only evaluates: it takes the weights when it does (the rollout side's
    # are handed off below), not a copy every iteration
    metrics = train_and_commit(rt, iteration, base_version, stats, timings, read_slice=reader,
                               behind=commits_behind(rt, iteration, evaluating),
                               engine_current=evaluating)
    if iteration + 1 < rt.cfg.num_rollout:  # the rollout side has no batch left after
        # "committed" follows the commit (behind): what the rollout side generates with these
        # weights reaches the lake only then, never with a version a crash takes back
        producer.hand_off(rt.trainer.weight_version, after=rt.pending_commit)
    timings["total"] = time.perf_counter() - start
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    if evaluating:
        metrics["eval/accuracy"] = evaluate(rt, iteration + 1)["accuracy"]
    return metrics


def _read_batch(rt: Runtime, weight_version: int, batch: int):
    settle_commit(rt)  # the lake's unconsumed rows: the last step's row must be in
    return read_rollout_batch(rt, weight_version, batch)


def _slice_of_sent(rt: Runtime, weight_version: int, rows: pa.Table, batch: int,
                   producer: RolloutProcess) -> tuple[pa.Table, Callable[[], int | None]]:
    """Batch ``batch``'s slice from the rows the rollout side sent (``batch_slice``); the commit
    version comes once their append landed, which the step's own commit waits for."""
    k = rt.cfg.trainer.max_staleness
    return (batch_slice(rows, weight_version, k, batch, rt.run_id),
            partial(landed, rt, partial(producer.wait_landed, batch)))


@contextmanager
def rollout_process(rt: Runtime) -> Iterator[RolloutProcess | None]:
    """Async mode: the rollout side's process, started now (it loads while the training side
    warms up; it generates nothing before the first hand-off) and stopped on exit. Sync: None."""
    if rt.cfg.mode != "async":
        yield None
        return
    producer = RolloutProcess(rt).start(current_api_url())
    try:
        yield producer
    finally:
        producer.stop()


def run_async(rt: Runtime, reporter: Callable[[str, dict], None], producer: RolloutProcess) -> None:
    """Iterations ``rt.start_iteration .. num_rollout - 1`` with the rollout side running ahead.
    The runtime is passed to the iteration flow by closure (a flow's parameters go to the
    Prefect API, so only the run id and iteration are parameters)."""

    @flow(name="rl_iteration", validate_parameters=False)  # as flows.rl's: rlake calls it
    def rl_iteration(run_id: str, iteration: int) -> dict[str, float]:
        return train_iteration(rt, producer, iteration)

    producer.hand_off(rt.trainer.weight_version)

    def batch_tags(i: int) -> set[str]:  # links the iteration to the batch it trains on
        return {batch_tag(i)}

    # top-level runs with the run's tags, beside the rollout side's: a subflow doubles the
    # server's CPU per iteration, taken from the two sides (flows/prefetch.py)
    run_iterations(rt, rl_iteration, reporter, batch_tags, nested=False)
