"""Lake maintenance as a flow (and a built-in deployment): compact, then vacuum, each table."""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from buffer import Lake
from buffer import maintenance as mt

TABLES = ("trajectories", "train_steps", "evals")


@task(name="compact_table", cache_policy=NO_CACHE)
def compact_table(lake_uri: str, table: str) -> dict:
    return mt.compact(Lake(lake_uri), table)


@task(name="vacuum_table", cache_policy=NO_CACHE)
def vacuum_table(lake_uri: str, table: str, retention_hours: int) -> int:
    return len(mt.vacuum(Lake(lake_uri), table, retention_hours=retention_hours))


@flow(name="lake_maintenance")
def lake_maintenance(lake_uri: str, retention_hours: int = mt.DEFAULT_RETENTION_HOURS) -> dict:
    """Compact every existing table (small files -> large, sorted, checkpointed), then vacuum files
    unreferenced for ``retention_hours`` (time travel to older versions ends there)."""
    lake = Lake(lake_uri)
    out = {}
    for table in TABLES:
        if lake.table_version(table) is None:
            continue
        metrics = compact_table(lake_uri, table)
        removed = vacuum_table(lake_uri, table, retention_hours)
        out[table] = {"version": metrics["version"], "files_added": metrics.get("numFilesAdded"),
                      "files_removed": metrics.get("numFilesRemoved"), "vacuumed": removed}
    return out
