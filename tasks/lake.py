"""Lake tasks: append trajectories, read the staleness-filtered training slice, record steps."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from buffer.lake import slice_lake_version, slice_of_written
from infra.runtime import Runtime
from rollout.sample import Sample
from tasks.step import step_task


@step_task(name="write_trajectories", retries=2, retry_delay_seconds=1)
def write_trajectories(rt: Runtime, samples: list[Sample], iteration: int, kind: str = "train") -> int | None:
    """One Delta commit; idempotent on sample_uid, so a retry or resume never duplicates."""
    rows = [s.to_row(rt.run_id, iteration, rt.engine.name, kind) for s in samples]
    return rt.lake.append_trajectories(rows)


@step_task(name="read_training_slice", retries=2, retry_delay_seconds=1)
def read_training_slice(rt: Runtime, weight_version: int) -> tuple[pa.Table, int]:
    """Unconsumed samples with version in [v - max_staleness, v], and the lake version read."""
    table = rt.lake.training_slice(rt.run_id, weight_version - rt.cfg.trainer.max_staleness,
                                   weight_version)
    return table, slice_lake_version(table)


def written_slice(rows: pa.Table, lake_version: Callable[[], int | None]
                  ) -> Callable[[Runtime, int], tuple[pa.Table, Callable[[], int | None]]]:
    """A ``read_slice`` for ``train_and_commit`` that reads no lake: the training slice of a sync
    iteration whose previous step (in this process) consumed every unconsumed row in its range,
    i.e. this rollout's own train rows in range (``buffer.lake.slice_of_written``); the commit's
    version comes from ``lake_version``, called just before the step's own commit."""
    def read(rt: Runtime, base_version: int) -> tuple[pa.Table, Callable[[], int | None]]:
        k = rt.cfg.trainer.max_staleness
        return slice_of_written(rows, base_version - k, base_version), lake_version
    return read


@step_task(name="record_train_step", retries=2, retry_delay_seconds=1)
def record_train_step(rt: Runtime, row: dict) -> None:
    rt.lake.append_train_step(row)
