"""The trajectory lake: Delta tables, idempotent appends, staleness slices, SQL. See README.md.

Its names are loaded on first use (PEP 562): ``import buffer.names`` stays light."""

__all__ = ["Lake", "SCHEMA_VERSION", "slice_lake_version"]


def __getattr__(name: str):
    if name in ("Lake", "slice_lake_version"):
        from buffer import lake

        return getattr(lake, name)
    if name == "SCHEMA_VERSION":
        from buffer.schema import SCHEMA_VERSION

        return SCHEMA_VERSION
    raise AttributeError(f"module 'buffer' has no attribute {name!r}")
