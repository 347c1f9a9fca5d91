"""The second half of an iteration, shared by ``rl_iteration`` and ``replay_iteration``:

    read slice -> train -> publish (engine; checkpoint every save_interval, in the background)
    -> train_steps row (THE commit) -> MLflow metrics -> model version (lineage)

The commit and what follows it (``commit_step``) may run behind: on a thread of its own while the
next iteration generates (sync) or trains (async) (``run_behind``, ``settle_commit``; the next
commit, and the next checkpoint, come after it). The named fault points
(infra/faults.py) sit between the steps.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

import pyarrow as pa
from prefect.utilities.annotations import quote

from flows.durability import register_version
from flows.guards import check_rewards
from flows.prefetch import IterationRuns, ahead, final_state_held
from infra.checkpoints import checkpoint_due
from infra.faults import AFTER_APPEND_POINTS, POST_COMMIT_POINTS, fault_armed, fault_join, fault_point
from infra.runtime import Runtime
from tasks.lake import read_training_slice, record_train_step
from tasks.rebuild import RECORDED_TERMS, seed_training
from tasks.train import publish_weights, train
from trainers.metrics import staleness

STEP_METRICS = RECORDED_TERMS
LakeVersion = int | None | Callable[[], int | None]


@contextmanager
def phase(timings: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def landed(rt: Runtime, append_version: Callable[[], int | None]) -> int | None:
    """The Delta version of an iteration's trajectories append once it has landed:
    ``append_version()`` waits for it (a failed append raises there, before anything trained on
    its rows is committed); None (no new rows) reads the table's version."""
    version = append_version()
    fault_point("after_lake_append")
    return rt.lake.table_version("trajectories") if version is None else version


def train_step_row(rt: Runtime, iteration: int, base_version: int, new_version: int,
                   lake_version: int, training_slice: pa.Table, train_metrics: dict[str, float],
                   metrics: dict[str, float], timings: dict[str, float]) -> dict:
    """The ``train_steps`` row of one iteration (step = iteration)."""
    return {
        "run_id": rt.run_id, "step": iteration, "iteration": iteration,
        "base_version": base_version, "weight_version": new_version, "lake_version": lake_version,
        "sample_uids": training_slice.column("sample_uid").to_pylist(),
        "n_samples": training_slice.num_rows,
        "n_response_tokens": int(sum(len(x) for x in training_slice.column("response_token_ids").to_pylist())),
        **{k: train_metrics.get(k) for k in STEP_METRICS},
        "entropy": train_metrics.get("entropy_loss"),
        "staleness_min": metrics["staleness/min"], "staleness_mean": metrics["staleness/mean"],
        "staleness_max": metrics["staleness/max"],
        "metrics": json.dumps(metrics), "timings": json.dumps(timings)}


def train_and_commit(rt: Runtime, iteration: int, base_version: int, rollout_stats: dict[str, float],
                     timings: dict[str, float],
                     read_slice: Callable[[Runtime, int], tuple[pa.Table, LakeVersion]] = read_training_slice,
                     total: int | None = None, behind: bool = False,
                     engine_current: bool = True) -> dict[str, float]:
    """Train on the slice ``read_slice(rt, base_version)`` and commit the new version; returns
    the iteration's metrics (rollout_stats + train/* + staleness/* + weight_version). The slice
    comes with the trajectories version it was read at, or a call that gives it once the rows'
    commit has landed (a slice built from rows still being written: ``tasks.lake.written_slice``).

    The checkpoint of the new version is written when due (``infra.checkpoints.checkpoint_due``
    over ``total`` iterations, default ``num_rollout``), in the background except at the last
    iteration (the run ends with its checkpoint on disk).

    ``behind``: the commit (``commit_step``) runs on its own thread while the caller goes on
    (``run_behind``; ``rt.pending_commit`` holds it until ``settle_commit``), so a sync run's
    next iteration generates while this one commits.

    ``engine_current`` False: this process's engine is not given the new weights (async mode's
    training side, whose engine only evaluates: it is given them when it does); with no
    checkpoint due either, there is nothing to publish."""
    with phase(timings, "slice_read"):
        training_slice, lake_version = read_slice(rt, base_version)
    if callable(lake_version) and any(fault_armed(p) for p in AFTER_APPEND_POINTS):
        lake_version = lake_version()  # the kill comes after the rows' commit (infra.faults)
    seed_training(rt, iteration)
    with phase(timings, "train"):
        train_metrics = train(rt, training_slice)
    if rt.pending_commit is not None:  # async mode: the last commit ran behind this training
        with phase(timings, "commit_wait"):
            settle_commit(rt)
    fault_point("during_train")
    new_version = rt.trainer.weight_version
    total = rt.cfg.num_rollout if total is None else total
    due = checkpoint_due(iteration, total, rt.cfg.save_interval)
    with phase(timings, "publish"):
        # pruned by the commit (commit_step), which knows the committed version: here it was a
        # read of every train_steps file on the training path (~50 ms at 100-200 iterations)
        saved = None
        if due or engine_current:
            saved = publish_weights(rt, new_version, save=due, wait=iteration + 1 >= total,
                                    prune=False, to_engine=engine_current)
    fault_join("during_checkpoint_save")  # a background write holding there: die before the commit
    fault_point("after_checkpoint_save")
    versions = training_slice.column("weight_version").to_pylist()
    metrics = {**rollout_stats, **{f"train/{k}": v for k, v in train_metrics.items()},
               **staleness(base_version, versions), "weight_version": float(new_version)}
    with phase(timings, "record"):
        if callable(lake_version):  # the slice's rows committed meanwhile: wait for that first
            lake_version = lake_version()
        # copies: the caller goes on adding to both while a commit behind runs
        commit = partial(commit_step, rt, iteration, train_step_row(
            rt, iteration, base_version, new_version, lake_version, training_slice, train_metrics,
            metrics, timings), {**metrics, **{f"time/{k}": v for k, v in timings.items()}},
            saved is not None)
        if behind:
            rt.pending_commit = run_behind(commit)
        else:
            commit()
    return metrics


def eval_due(rt: Runtime, done: int, total: int) -> bool:
    """After ``done`` of ``total`` iterations: at the start, every ``eval_interval``, at the end;
    never without an eval set (``eval.datasets: []``: async mode handed its weights to the
    evaluation engine for nothing at each point)."""
    if not rt.eval_sets:
        return False
    return done == 0 or done % rt.cfg.eval.eval_interval == 0 or done == total


def run_iterations(rt: Runtime, iteration_flow, reporter: Callable[[str, dict], None],
                   extra_tags: Callable[[int], set[str] | None] = lambda _: None,
                   nested: bool = True, stop: int | None = None,
                   parameters: Callable[[int], dict] | None = None) -> None:
    """Iterations ``rt.start_iteration .. stop - 1`` (default ``num_rollout``), one
    ``iteration_flow`` run each (parameters ``parameters(i)``, default ``run_id`` and
    ``iteration``; tagged ``extra_tags(i)``; subflows of the calling flow run, or top-level runs
    with its tags when not ``nested``), the next ones' runs created while iteration i runs
    (flows/prefetch.py). An iteration's Completed goes to Prefect once its commit (maybe
    behind) has landed; on an error, what trained is committed first."""
    stop = rt.cfg.num_rollout if stop is None else stop
    if parameters is None:
        def parameters(i: int) -> dict:
            return {"run_id": rt.run_id, "iteration": i}

    with IterationRuns(iteration_flow, hold=lambda: rt.pending_commit, nested=nested) as runs:
        try:
            for iteration in range(rt.start_iteration, stop):
                metrics = runs.run(parameters(iteration), extra_tags(iteration),
                                   upcoming=ahead(iteration, stop, parameters, extra_tags))
                reporter("iteration", {"iteration": iteration, **metrics})
                check_rewards(rt, iteration, metrics)
        except BaseException:
            settle_commit(rt, raise_error=False)  # what trained is committed, then the error
            raise
        settle_commit(rt)


def commits_behind(rt: Runtime, iteration: int, evaluating: bool) -> bool:
    """Whether iteration ``iteration`` commits behind (``run_behind``): the next iteration
    generates (sync) or trains (async) while this one's train_steps row is written. Only on a
    pre-created flow run, whose Completed ``IterationRuns`` holds until the commit landed (a
    plain subflow call's would go out before it: a process's first iteration in sync mode, or
    one whose run could not be created ahead); not one that evaluates (the evaluation follows
    the commit) or the last, nor one where a fault point after the commit is armed (the kill then
    comes inside this iteration's flow run)."""
    return (final_state_held() and iteration < rt.cfg.num_rollout - 1 and not evaluating
            and not any(fault_armed(p, iteration) for p in POST_COMMIT_POINTS))


def commit_step(rt: Runtime, iteration: int, row: dict, logged: dict[str, float],
                saved: bool) -> None:
    """THE commit of an iteration and what follows it: the ``train_steps`` row (``row``,
    ``train_step_row``), checkpoint pruning, the MLflow metrics (``logged``) and the model
    version (with its ``saved`` checkpoint or none). Fault points carry ``iteration``: behind
    (``run_behind``), the next iteration may be running."""
    if saved:
        # the MLflow work of the iterations before (sent in the background, a second's worth
        # at a time) lands before a checkpoint's commit: what a crash loses is at most
        # save_interval iterations' metrics and model versions, which resume re-does from the
        # lake (durability.recover), and a failing tracker fails the run within them. A flush
        # every commit sent each iteration alone (MLflow's per-call work, on the rollout
        # side's core in async mode)
        rt.tracker.flush()
    # quoted: Prefect would walk the row (its sample_uids list) looking for futures
    record_train_step(rt, quote(row))
    new_version = row["weight_version"]
    rt.prune_checkpoints(keep_version=new_version, committed=new_version)
    fault_join("during_background_write", iteration)  # committed, its checkpoint half-written
    fault_point("during_mlflow_log", iteration)
    # queued for the tracker's background sender (it retries): no task run around a queue put
    rt.tracker.log_metrics(logged, iteration)
    register_version(rt, new_version, iteration, row["lake_version"], row["n_samples"], saved=saved)


def run_behind(commit: Callable[[], None]) -> Future:
    """Run ``commit`` on a thread of its own, in a copy of the caller's context (its task run
    then belongs to the caller's flow run); the future holds its error. Whoever comes next
    waits for it (``settle_commit``) before anything that must follow the commit."""
    future: Future = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(commit))
        except BaseException as err:  # noqa: BLE001 - raised by settle_commit
            future.set_exception(err)
    threading.Thread(target=run, name="rlake-commit", daemon=True).start()
    return future


def settle_commit(rt: Runtime, raise_error: bool = True) -> None:
    """Wait for the commit running behind (``run_behind``), if any; raise its error (or, with
    ``raise_error`` False, when the caller is failing already, report it as a warning)."""
    pending, rt.pending_commit = rt.pending_commit, None
    if pending is None:
        return
    err = pending.exception()
    if err is None:
        return
    if raise_error:
        raise err
    rt.report("warning", {"message": f"the last iteration's commit failed too: {err!r}"})
