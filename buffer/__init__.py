"""The trajectory lake: Delta tables, idempotent appends, staleness slices, SQL. See README.md."""

from buffer.lake import Lake, slice_lake_version
from buffer.schema import SCHEMA_VERSION

__all__ = ["Lake", "SCHEMA_VERSION", "slice_lake_version"]
