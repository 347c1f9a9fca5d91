"""CLI for the lake: ``rlake sql`` (``sql_command``) and ``rlake lake compact|vacuum|history``.

Mounted into the main CLI by ``infra/cli.py``::

    app.add_typer(lake_app, name="lake")
    app.command("sql")(sql_command)

The lake is chosen with ``--lake URI`` (default ``$RLAKE_LAKE_URI``, else ``./rlake-home/lake``)
and object-store credentials with repeatable ``--storage-option KEY=VALUE`` (passed to deltalake).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

# the lake's code (pyarrow, deltalake, DuckDB: ~0.4 s) is imported by the commands that use it:
# every rlake command imports this module, and `rlake run` starts Prefect's server before that
from buffer.names import (
    DEFAULT_MEMORY_LIMIT,
    DEFAULT_RETENTION_HOURS,
    DEFAULT_TIMEOUT_S,
    FORMATS,
    TABLE_NAMES,
)

if TYPE_CHECKING:
    from buffer import Lake

DEFAULT_LAKE = "./rlake-home/lake"

LakeOpt = Annotated[str, typer.Option("--lake", envvar="RLAKE_LAKE_URI",
                                      help="Lake root: a folder or an object-store URI (s3://, gs://, az://).")]
StorageOpt = Annotated[list[str] | None, typer.Option(
    "--storage-option", "-S", help="Object-store option KEY=VALUE (repeatable), passed to deltalake.")]
TableOpt = Annotated[str, typer.Option("--table", "-t", help=f"One of: {', '.join(TABLE_NAMES)}.")]

lake_app = typer.Typer(help="Maintain the trajectory lake (compaction, vacuum, history).", no_args_is_help=True)


def parse_storage_options(items: list[str] | None) -> dict[str, str] | None:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}``; a clear error naming a malformed item."""
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"storage option {item!r} is not KEY=VALUE")
        out[key.strip()] = value
    return out


def open_lake(lake: str | None, storage_option: list[str] | None) -> Lake:
    """The lake at ``lake``; a local folder that does not exist is an error (reading it would
    show empty tables, as if a typo in the path were an empty lake)."""
    uri = lake or os.environ.get("RLAKE_LAKE_URI") or DEFAULT_LAKE
    options = parse_storage_options(storage_option)
    check_lake(uri)
    from buffer import Lake

    return Lake(uri, storage_options=options)


def check_lake(uri: str) -> None:
    """Refuse (exit 2) a local ``uri`` that is no lake: a missing folder, or one holding none of
    the tables (an object-store URI is not checked here)."""
    local = uri.removeprefix("file://") if uri.startswith("file://") or "://" not in uri else None
    if local is not None and not Path(local).is_dir():
        _fail(f"no lake at {uri} (--lake / RLAKE_LAKE_URI): the folder does not exist")
    if local is not None and not any((Path(local) / t / "_delta_log").is_dir() for t in TABLE_NAMES):
        # a home given for its lake read as an empty lake (count 0, exit 0)
        hint = f"; its lake is {Path(local) / 'lake'}" if (Path(local) / "lake").is_dir() else ""
        _fail(f"no lake at {uri} (--lake / RLAKE_LAKE_URI): the folder holds none of the tables "
              f"{', '.join(TABLE_NAMES)}{hint}")


def inside_local_lake(path: Path, lake_uri: str) -> bool:
    """Whether ``path`` lies in the folder of a local lake (an object-store lake: never)."""
    from buffer.delta import is_local, local_path, normalize_uri

    uri = normalize_uri(lake_uri)
    if not is_local(uri):
        return False
    return path.resolve().is_relative_to(Path(local_path(uri)).resolve())


def check_out(out: Path, lake: str) -> None:
    """Refuse (exit 2) an ``--out`` that is a folder or lies inside the local lake ``lake``,
    before any work (``rlake sql``, ``rlake report``)."""
    if out.is_dir():
        _fail(f"--out {out}: is a folder, not a file")
    if inside_local_lake(out, lake):
        # a Parquet file written over a data file lost its rows; a JSON or HTML one in
        # _delta_log became a commit (review, 2026-11-29)
        _fail(f"--out {out}: is inside the lake ({lake}); write it elsewhere")


# where a Rust backtrace starts in a deltalake error's text: with RUST_BACKTRACE set, the error
# carries one ("Stack backtrace:" and/or numbered frames "   0: <unknown>", each on its own line)
_BACKTRACE = re.compile(r"\n\s*(?:stack backtrace:|0: )", re.IGNORECASE)


def without_backtrace(message: str) -> str:
    """``message`` without the Rust backtrace a deltalake error carries when RUST_BACKTRACE is
    set: the error's own text, one line (the backtrace shows with ``--debug``)."""
    return _BACKTRACE.split(message, maxsplit=1)[0].strip()


def _fail(message: str) -> None:
    typer.echo(f"error: {without_backtrace(message)}", err=True)
    raise typer.Exit(2)


def _check_table(table: str) -> None:
    if table not in TABLE_NAMES:
        _fail(f"unknown table {table!r}; choose one of {', '.join(TABLE_NAMES)}")


def sql_command(
    query: Annotated[str, typer.Argument(help="A SELECT (or EXPLAIN) over trajectories, train_steps, evals, runs.")],
    format: Annotated[str, typer.Option("--format", "-f", help=f"Output: {' | '.join(FORMATS)}.")] = "table",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the result to FILE.")] = None,
    as_of: Annotated[str | None, typer.Option(
        "--as-of", help="Read tables as of a Delta version (int) or an ISO timestamp.")] = None,
    max_rows: Annotated[int | None, typer.Option("--max-rows", min=1,
                                                 help="Table format: show at most N rows.")] = None,
    memory_limit: Annotated[str, typer.Option(
        "--memory-limit", help="Most memory the query may use (DuckDB size: 512MB, 4GB).")] = DEFAULT_MEMORY_LIMIT,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Stop the query after this many seconds.")] = DEFAULT_TIMEOUT_S,
    lake: LakeOpt = DEFAULT_LAKE,
    storage_option: StorageOpt = None,
) -> None:
    """Run read-only SQL (DuckDB) over the lake's tables."""
    if format not in FORMATS:
        _fail(f"unknown --format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "parquet" and out is None:
        _fail("--format parquet needs --out FILE")
    if out is not None and not out.parent.is_dir():  # before the query, not after it ran
        _fail(f"--out {out}: the folder {out.parent} does not exist")
    if out is not None:
        check_out(out, lake)
    from buffer.output import format_table, render
    from buffer.sql import SqlRefused, sql

    try:
        result = sql(open_lake(lake, storage_option), query, as_of=as_of, memory_limit=memory_limit,
                     timeout_s=timeout)
    except SqlRefused as e:
        _fail(str(e))
    except ValueError as e:
        _fail(str(e))
    if format == "table" and out is None:
        typer.echo(format_table(result, max_rows))
        return
    text = render(result, format, out)
    if text is not None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"wrote {result.num_rows} rows to {out}", err=True)


@lake_app.command("compact")
def compact_command(
    table: TableOpt = "trajectories",
    run_id: Annotated[str | None, typer.Option(
        "--run-id", help="Only this run's partition (trajectories only).")] = None,
    max_row_group_size: Annotated[int | None, typer.Option(
        min=1, help="Rows per Parquet row group (default: 2048; 64 for train_steps).")] = None,
    sort: Annotated[bool, typer.Option(help="Sort rewritten rows by version (Z-order).")] = True,
    lake: LakeOpt = DEFAULT_LAKE,
    storage_option: StorageOpt = None,
) -> None:
    """Rewrite small files into larger ones with small row groups; print the metrics as JSON."""
    _check_table(table)
    from buffer.maintenance import compact

    if run_id is not None and table != "trajectories":  # the other tables are not partitioned
        _fail(f"--run-id: only trajectories is partitioned by run; {table} is compacted whole")
    try:
        metrics = compact(open_lake(lake, storage_option), table, run_id=run_id,
                          max_row_group_size=max_row_group_size, sort=sort)
    except ValueError as e:
        _fail(str(e))
    typer.echo(json.dumps(metrics, default=str))


@lake_app.command("vacuum")
def vacuum_command(
    table: TableOpt = "trajectories",
    retention_hours: Annotated[int, typer.Option(help="Keep files needed by versions newer than this.")]
    = DEFAULT_RETENTION_HOURS,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List files, delete nothing.")] = False,
    lake: LakeOpt = DEFAULT_LAKE,
    storage_option: StorageOpt = None,
) -> None:
    """Delete unreferenced files older than the retention (breaks time travel before it)."""
    _check_table(table)
    from buffer.maintenance import vacuum

    try:
        files = vacuum(open_lake(lake, storage_option), table, retention_hours=retention_hours,
                       dry_run=dry_run)
    except ValueError as e:
        _fail(str(e))
    verb = "would delete" if dry_run else "deleted"
    for f in files:
        typer.echo(f)
    typer.echo(f"{verb} {len(files)} files from {table}", err=True)


@lake_app.command("history")
def history_command(
    table: TableOpt = "trajectories",
    limit: Annotated[int | None, typer.Option(min=1, help="Newest N commits only.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per commit.")] = False,
    lake: LakeOpt = DEFAULT_LAKE,
    storage_option: StorageOpt = None,
) -> None:
    """The table's Delta commits, newest first."""
    _check_table(table)
    from buffer.maintenance import history

    try:
        entries = history(open_lake(lake, storage_option), table, limit=limit)
    except ValueError as e:
        _fail(str(e))
    if as_json:
        for e in entries:
            typer.echo(json.dumps(e, default=str))
        return
    import pyarrow as pa

    from buffer.output import format_table

    rows = [{"version": e["version"], "timestamp": e["timestamp"], "operation": e["operation"],
             "rows": (e.get("operationMetrics") or {}).get("num_added_rows", e.get("rlake.rows")),
             "rlake": e.get("rlake.operation")} for e in entries]
    typer.echo(format_table(pa.Table.from_pylist(rows) if rows else pa.table({"version": []})))
