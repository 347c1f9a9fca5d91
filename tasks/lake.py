"""Lake tasks: append trajectories, read the staleness-filtered training slice, record steps."""

from __future__ import annotations

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from buffer.lake import slice_lake_version
from infra.runtime import Runtime
from rollout.sample import Sample


@task(name="write_trajectories", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def write_trajectories(rt: Runtime, samples: list[Sample], iteration: int, kind: str = "train") -> int | None:
    """One Delta commit; idempotent on sample_uid, so a retry or resume never duplicates."""
    rows = [s.to_row(rt.run_id, iteration, rt.engine.name, kind) for s in samples]
    return rt.lake.append_trajectories(rows)


@task(name="read_training_slice", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def read_training_slice(rt: Runtime, weight_version: int) -> tuple[pa.Table, int]:
    """Unconsumed samples with version in [v - max_staleness, v], and the lake version read."""
    table = rt.lake.training_slice(rt.run_id, weight_version - rt.cfg.trainer.max_staleness,
                                   weight_version)
    return table, slice_lake_version(table)


@task(name="record_train_step", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record_train_step(rt: Runtime, row: dict) -> None:
    rt.lake.append_train_step(row)
