"""Async mode's tasks: the rollout side appends one batch; the training side reads one batch."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE

from buffer.lake import slice_lake_version, slice_of_written
from infra.runtime import Runtime
from infra.sides import RolloutSide
from tasks.rollout import generate_rollouts, rollout_table, score, write_rollout
from tasks.step import step_task
from trainers.metrics import rollout_metrics

# each batch's task run is named after it (formatted by Prefect from the call's ``batch``): one
# task, not a ``with_options`` copy per batch (a new Task reads its function's source, ~3 ms)
BATCH_RUN_NAME = "rollout_batch-{batch}"


@task(name="rollout_batch", task_run_name=BATCH_RUN_NAME, cache_policy=NO_CACHE)
def rollout_batch(side: RolloutSide, batch: int,
                  send_rows: Callable[[dict[str, float], pa.Table], None] | None = None,
                  may_append: Callable[[], bool] | None = None
                  ) -> tuple[dict[str, float], int | None]:
    """Batch ``batch`` with the engine's current weights: generate -> score -> one lake commit.
    ``send_rows(stats, rows)`` gets the rows just before they are appended (the training side
    trains on them while they commit); ``may_append()`` then waits until the weights' version
    is committed, and False skips the append (the run stopped first). Returns (stats, the
    commit's Delta version); the commit holds the stats too (a resumed trainer reads them from
    there)."""
    start = time.perf_counter()
    out = generate_rollouts.fn(side, batch)
    generated = time.perf_counter()
    failed = score.fn(side, out.samples)
    scored = time.perf_counter()
    out.stats.update(rollout_metrics(out.samples, generated - start))
    out.stats.update({"rollout/failed": float(failed), "rollout/weight_version":
                      float(side.engine.weight_version), "time/generate": generated - start,
                      "time/score": scored - generated})
    rows = rollout_table(side, out, batch)
    if send_rows is not None:
        send_rows(out.stats, rows)
    if may_append is not None and not may_append():
        return out.stats, None
    appending = time.perf_counter()
    lake_version = write_rollout.fn(side, rows, out.commit_info())
    return {**out.stats, "time/commit_wait": appending - scored,
            "time/lake_write": time.perf_counter() - appending}, lake_version


@step_task(name="read_rollout_batch", retries=2, retry_delay_seconds=1)
def read_rollout_batch(rt: Runtime, weight_version: int, batch: int) -> tuple[pa.Table, int]:
    """The unconsumed samples of rollout batch ``batch`` (the oldest: iteration ``batch`` trains
    on it) with version in [v - max_staleness, ...], and the lake version read. Refuses when
    they are not the oldest unconsumed ones, when none is within the bound, or when some of the
    batch's are outside it (never silently skips data)."""
    k = rt.cfg.trainer.max_staleness
    table = rt.lake.training_slice(rt.run_id, weight_version - k)
    iterations = table.column("iteration")
    chosen = table.filter(pc.equal(iterations, batch))
    if chosen.num_rows == 0 or pc.min(iterations).as_py() != batch:
        found = sorted(set(iterations.to_pylist()))
        raise RuntimeError(f"run {rt.run_id}: iteration {batch} at weight version {weight_version} "
                           f"expects rollout batch {batch} unconsumed within trainer.max_staleness="
                           f"{k}; unconsumed batches found: {found[:10]}")
    # the batch's rows outside the bound (none is consumed: only iteration ``batch`` trains on
    # them): refused, as batch_slice does; read by the batch's own files, not every older one
    versions = rt.lake.iteration_rows(rt.run_id, batch, "train").column("weight_version")
    stale = pc.sum(pc.less(versions, weight_version - k)).as_py() or 0
    if stale:
        raise RuntimeError(f"run {rt.run_id}: iteration {batch} at weight version "
                           f"{weight_version} expects rollout batch {batch}'s train rows within "
                           f"trainer.max_staleness={k}; {stale} of them are older")
    return chosen, slice_lake_version(table)


def batch_slice(rows: pa.Table, weight_version: int, max_staleness: int, batch: int,
                run_id: str) -> pa.Table:
    """What ``read_rollout_batch`` reads once rollout batch ``batch``'s rows (``rows``, appended
    by this process's rollout side) landed, built from the rows themselves: their train rows
    with version >= v - max_staleness, oldest first (``buffer.lake.slice_of_written``). Holds
    when every older batch was consumed whole, which each iteration ensures: a train row outside
    the bound is refused here as the lake read refuses it (never silently left behind)."""
    chosen = slice_of_written(rows, weight_version - max_staleness)
    train = pc.sum(pc.equal(rows.column("kind"), "train")).as_py() or 0
    if chosen.num_rows == 0 or chosen.num_rows != train:
        raise RuntimeError(f"run {run_id}: iteration {batch} at weight version {weight_version} "
                           f"expects rollout batch {batch}'s train rows within "
                           f"trainer.max_staleness={max_staleness}; {chosen.num_rows} of its "
                           f"{train} train rows are")
    return chosen
