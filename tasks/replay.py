"""Replay tasks: read a source run's recorded trajectories; read the replay run's training slice."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from infra.runtime import Runtime
from tasks.step import step_task


@step_task(name="read_source_trajectories", retries=2, retry_delay_seconds=1)
def read_source_trajectories(rt: Runtime, source_run: str, first: int, stop: int | None) -> pa.Table:
    """The source run's train trajectories with ``first <= iteration < stop`` (stop None: all)."""
    table = rt.lake.read("trajectories", run_id=source_run)
    keep = pc.and_(pc.equal(table.column("kind"), "train"),
                   pc.greater_equal(table.column("iteration"), first))
    if stop is not None:
        keep = pc.and_(keep, pc.less(table.column("iteration"), stop))
    return table.filter(keep).sort_by([("iteration", "ascending"), ("sample_index", "ascending")])


@step_task(name="read_replay_slice", retries=2, retry_delay_seconds=1)
def read_replay_slice(rt: Runtime, weight_version: int) -> tuple[pa.Table, int]:
    """Every unconsumed replayed sample of the run, whatever version generated it (the source's
    versions are not the replay's), and the lake version read."""
    lake_version = rt.lake.table_version("trajectories")
    return rt.lake.training_slice(rt.run_id, 0), lake_version
