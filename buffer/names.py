"""The lake's names and the CLI's defaults, without importing pyarrow, deltalake or DuckDB: the
CLI defines its options from these before anything else runs, and ``rlake run`` starts Prefect's
server before it imports the lake (infra/startup.py), so the server's start is not held back by
the ~0.4 s those imports take."""

TABLE_NAMES = ("trajectories", "train_steps", "evals", "runs")
FORMATS = ("table", "csv", "json", "parquet")  # ``rlake sql --format``
DEFAULT_RETENTION_HOURS = 168  # ``rlake lake vacuum``
DEFAULT_MEMORY_LIMIT = "2GB"  # ``rlake sql``
DEFAULT_TIMEOUT_S = 300.0
