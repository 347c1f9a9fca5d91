"""Arrow schemas of the lake's four Delta tables, every column documented.

Each table is declared once as a list of ``Column(name, type, nullable, doc)``; ``arrow_schema``
turns it into a ``pyarrow.Schema`` (the doc travels as field metadata ``doc``), and
``buffer/README.md`` lists the same columns. ``SCHEMA_VERSION`` is written into each table's Delta
configuration as ``rlake.schemaVersion`` when the table is created (and refreshed when a write adds
columns), so a reader can tell which layout a table was written with.

Evolution rule: columns are only ever added (nullable), never renamed or retyped. Readers fill a
column missing from older files or older table versions with nulls (see ``conform``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "rlake.schemaVersion"
TS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    nullable: bool
    doc: str


def _c(name: str, type_: pa.DataType, doc: str, nullable: bool = True) -> Column:
    return Column(name, type_, nullable, doc)


TRAJECTORIES: list[Column] = [
    _c("sample_uid", pa.string(), "Unique key `{run_id}/{iteration}/{index}` for kind train; `{run_id}/{kind}-{iteration}/{index}` for the others (`eval-5`, `filtered-5`, `aborted-5`, `partial-5`).", False),
    _c("run_id", pa.string(), "Run that generated the sample; the table's partition column.", False),
    _c("iteration", pa.int64(), "RL iteration (rollout round) that generated it.", False),
    _c("weight_version", pa.int64(), "Policy weight version that generated the response.", False),
    _c("group_index", pa.int64(), "Index of the prompt group (samples of one prompt share it)."),
    _c("sample_index", pa.int64(), "Index of the sample within the iteration."),
    _c("kind", pa.string(), "'train' (rollout trained on), 'filtered' (group rejected by the dynamic sampling filter), 'aborted' (group stopped once enough were kept), 'partial' (such a group with partial_rollout on: continued next iteration) or 'eval' (evaluation rollout).", False),
    _c("prompt", pa.string(), "Prompt text as given to the engine."),
    _c("prompt_token_ids", pa.list_(pa.int32()), "Token ids of the prompt."),
    _c("response", pa.string(), "Generated response text."),
    _c("response_token_ids", pa.list_(pa.int32()), "Token ids of the response."),
    _c("rollout_logprobs", pa.list_(pa.float32()), "Engine log-probabilities of each response token."),
    _c("loss_mask", pa.list_(pa.int8()), "1 where a response token is trained on, 0 where masked."),
    _c("reward", pa.float64(), "Scalar reward (null until scored)."),
    _c("reward_detail", pa.string(), "JSON object with the reward function's details."),
    _c("label", pa.string(), "Reference answer / label of the prompt, if any."),
    _c("status", pa.string(), "pending | completed | truncated | aborted | failed."),
    _c("finish_reason", pa.string(), "Engine finish reason (stop, length, abort, ...)."),
    _c("metadata", pa.string(), "JSON object of free-form per-sample metadata."),
    _c("engine", pa.string(), "Rollout engine that produced it (torch, sglang, ...)."),
    _c("data_source", pa.string(), "Prompt data source (file or dataset name): lineage to the prompt."),
    _c("row", pa.int64(), "Row of the prompt within data_source."),
    _c("created_at", TS, "UTC time the row was written (stamped by the lake if missing)."),
]

TRAIN_STEPS: list[Column] = [
    _c("run_id", pa.string(), "Run the step belongs to; key part 1.", False),
    _c("step", pa.int64(), "Optimizer step / training call number within the run; key part 2.", False),
    _c("iteration", pa.int64(), "RL iteration during which the step ran."),
    _c("base_version", pa.int64(), "Weight version the step started from."),
    _c("weight_version", pa.int64(), "Weight version the step produced."),
    _c("lake_version", pa.int64(), "Delta version of `trajectories` the step's slice was read at."),
    _c("sample_uids", pa.list_(pa.string()), "sample_uid of every trajectory the step consumed."),
    _c("n_samples", pa.int64(), "Number of samples consumed."),
    _c("n_response_tokens", pa.int64(), "Number of response tokens trained on."),
    _c("pg_loss", pa.float64(), "Policy-gradient loss."),
    _c("pg_clipfrac", pa.float64(), "Fraction of tokens where the PPO ratio was clipped."),
    _c("ppo_kl", pa.float64(), "Mean of lp_old - lp over response tokens, lp_old from the trainer's weights at the start of the training call (not the engine: see metrics.train_rollout_logprob_abs_diff)."),
    _c("kl_loss", pa.float64(), "KL penalty to the reference policy."),
    _c("entropy", pa.float64(), "Mean token entropy of the policy."),
    _c("grad_norm", pa.float64(), "Gradient norm before clipping."),
    _c("staleness_min", pa.float64(), "Min of base_version - weight_version over consumed samples."),
    _c("staleness_mean", pa.float64(), "Mean version lag over consumed samples."),
    _c("staleness_max", pa.float64(), "Max version lag over consumed samples."),
    _c("metrics", pa.string(), "JSON object of every metric the trainer reported."),
    _c("timings", pa.string(), "JSON object: seconds spent per phase."),
    _c("created_at", TS, "UTC time the row was written."),
]

EVALS: list[Column] = [
    _c("run_id", pa.string(), "Run evaluated; key part 1.", False),
    _c("weight_version", pa.int64(), "Weight version evaluated; key part 2.", False),
    _c("iteration", pa.int64(), "Iteration at which the evaluation ran."),
    _c("dataset", pa.string(), "Evaluation dataset name; key part 3.", False),
    _c("metric", pa.string(), "Metric name (accuracy, mean_reward, ...); key part 4.", False),
    _c("value", pa.float64(), "Metric value."),
    _c("n", pa.int64(), "Number of samples the value is computed over."),
    _c("created_at", TS, "UTC time the row was written."),
]

RUNS: list[Column] = [
    _c("run_id", pa.string(), "Run identifier; key.", False),
    _c("config", pa.string(), "JSON of the full run configuration."),
    _c("status", pa.string(), "running | completed | failed | interrupted (stopped by Ctrl-C, or by SIGTERM of the Prefect flow run that ran it; `rlake status` also shows a running run whose process is gone, killed, as interrupted)."),
    _c("mlflow_run_id", pa.string(), "MLflow run id tracking this run."),
    _c("parent_run_id", pa.string(), "Run this one was resumed/forked from."),
    _c("replay_of", pa.string(), "Run whose trajectories this run replays."),
    _c("notes", pa.string(), "JSON object of free-form notes (host, git commit, ...)."),
    _c("created_at", TS, "UTC time the run row was first written."),
    _c("updated_at", TS, "UTC time of the last update."),
]

TABLES: dict[str, list[Column]] = {  # in buffer.names.TABLE_NAMES' order (tests/test_lake.py)
    "trajectories": TRAJECTORIES,
    "train_steps": TRAIN_STEPS,
    "evals": EVALS,
    "runs": RUNS,
}
KEYS: dict[str, tuple[str, ...]] = {
    "trajectories": ("sample_uid",),
    "train_steps": ("run_id", "step"),
    "evals": ("run_id", "weight_version", "dataset", "metric"),
    "runs": ("run_id",),
}
PARTITIONS: dict[str, list[str]] = {"trajectories": ["run_id"]}


def columns(table: str) -> list[Column]:
    """The declared columns of ``table``; a clear error for an unknown name."""
    try:
        return TABLES[table]
    except KeyError:
        raise ValueError(f"unknown lake table {table!r}; known: {', '.join(TABLES)}") from None


def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of ``table``: one field per declared column, doc in field metadata."""
    return pa.schema(
        [pa.field(c.name, c.type, c.nullable, metadata={"doc": c.doc}) for c in columns(table)]
    )


def utc_now() -> datetime:
    return datetime.now(UTC)


def rows_to_table(table: str, rows: list[dict[str, Any]] | pa.Table, now: datetime | None = None) -> pa.Table:
    """Rows (dicts or Arrow) -> an Arrow table in ``table``'s schema.

    Declared columns missing from the input become nulls; ``created_at`` (and ``updated_at`` for
    runs) missing or null is stamped with ``now`` (UTC). Extra keys not in the schema are kept as
    extra columns (the write then adds them with schema merging). A value of the wrong type raises
    ``ValueError`` naming the column.
    """
    schema = arrow_schema(table)
    now = now or utc_now()
    if isinstance(rows, pa.Table):
        data = rows
    else:
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{table}: rows must be a list of dicts or a pyarrow.Table")
        names = list(dict.fromkeys(k for r in rows for k in r))
        data = {}
        for name in names:
            values = [r.get(name) for r in rows]
            typ = schema.field(name).type if name in schema.names else None
            try:
                data[name] = pa.array(values, type=typ)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise ValueError(f"{table}: bad value in column {name!r}: {e}") from None
        data = pa.table(data) if data else pa.table({"__empty": pa.nulls(0)}).drop(["__empty"])
    n = data.num_rows
    out_fields, out_cols = [], []
    for field in schema:
        if field.name in data.column_names:
            col = data.column(field.name)
            if not col.type.equals(field.type):
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    raise ValueError(f"{table}: column {field.name!r} has type {col.type}, "
                                     f"expected {field.type}: {e}") from None
        else:
            col = pa.nulls(n, field.type)
        if field.name in ("created_at", "updated_at") and col.null_count:
            import pyarrow.compute as pc

            col = pc.fill_null(col, pa.scalar(now, TS))
        if not field.nullable and col.null_count:
            raise ValueError(f"{table}: column {field.name!r} must not be null")
        if field.name in PARTITIONS.get(table, ()) and n and _has_empty_string(col):
            # Delta writes an empty partition value as null: the commit would land and every
            # later read of the table fail on its non-nullable column
            raise ValueError(f"{table}: column {field.name!r} must not be an empty string")
        out_fields.append(field)
        out_cols.append(col)
    for name in data.column_names:
        if name not in schema.names:
            out_fields.append(pa.field(name, data.column(name).type))
            out_cols.append(data.column(name))
    return pa.Table.from_arrays(out_cols, schema=pa.schema(out_fields))


def uid_step(iteration: int, kind: str = "train") -> str:
    """The iteration part of a trajectory's ``sample_uid`` and guard: ``{iteration}`` for train
    rows, ``{kind}-{iteration}`` for the others (rollout.sample.sample_uid writes the same)."""
    return str(iteration) if kind == "train" else f"{kind}-{iteration}"


def _has_empty_string(col: pa.ChunkedArray) -> bool:
    import pyarrow.compute as pc

    return bool(pc.any(pc.equal(pc.utf8_length(col), 0)).as_py())


def conform(table: pa.Table, name: str, columns_: list[str] | None = None) -> pa.Table:
    """Make a table read from disk match the current declared schema.

    Columns declared now but missing on disk (an older schema version) are added as nulls;
    columns on disk that are not declared (added later by a writer) are kept at the end.
    With ``columns_`` only those, in that order.
    """
    schema = arrow_schema(name)
    n = table.num_rows
    wanted = columns_ or list(dict.fromkeys(schema.names + table.column_names))
    arrays, fields = [], []
    for col in wanted:
        if col in table.column_names:
            arr = table.column(col)
            field = schema.field(col) if col in schema.names else pa.field(col, arr.type)
            if not arr.type.equals(field.type):
                arr = arr.cast(field.type)
        elif col in schema.names:
            field = schema.field(col)
            arr = pa.nulls(n, field.type)
        else:
            raise ValueError(f"{name}: no column {col!r}; columns: {', '.join(schema.names)}")
        fields.append(field.with_nullable(True))
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def schema_markdown() -> str:
    """The four tables as Markdown (the column reference in buffer/README.md is generated by this)."""
    out = []
    for name, cols in TABLES.items():
        key = ", ".join(KEYS[name])
        part = f"; partitioned by {', '.join(PARTITIONS[name])}" if name in PARTITIONS else ""
        out += [f"### `{name}` (key: {key}{part})", "", "| column | type | null | meaning |",
                "|---|---|---|---|"]
        out += [f"| `{c.name}` | `{c.type}` | {'yes' if c.nullable else 'no'} | {_md(c.doc)} |" for c in cols]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(schema_markdown())
