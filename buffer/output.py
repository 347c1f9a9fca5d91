"""Render an Arrow table as text, CSV, JSON lines or Parquet (for ``rlake sql``)."""

from __future__ import annotations

import io
import json
import math
from datetime import date, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

FORMATS = ("table", "csv", "json", "parquet")
MAX_CELL = 60


def _cell(value: Any) -> str:
    """One value as table text: ISO for times, JSON for lists/dicts, cut to ``MAX_CELL`` chars."""
    if value is None:
        text = "NULL"
    elif isinstance(value, datetime | date):
        text = value.isoformat()
    elif isinstance(value, list | dict):
        text = json.dumps(value, default=str)
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def unique_names(table: pa.Table) -> pa.Table:
    """``table`` with a repeated column name suffixed ``_1``, ``_2``... (as DuckDB names them).

    A join's ``t.weight_version, s.weight_version`` gives two columns of one name: rows as dicts
    kept only the last (the table showed its values under both headers, JSON dropped a column)
    and the CSV writer refused them (review, 2026-11-29)."""
    seen: set[str] = set()
    names = []
    for name in table.column_names:
        new, n = name, 0
        while new in seen:
            n += 1
            new = f"{name}_{n}"
        seen.add(new)
        names.append(new)
    return table if names == table.column_names else table.rename_columns(names)


def format_table(table: pa.Table, max_rows: int | None = None) -> str:
    """Fixed-width text: a header, a rule, one line per row, and a ``(n rows)`` footer."""
    table = unique_names(table)
    rows = table.slice(0, max_rows).to_pylist() if max_rows is not None else table.to_pylist()
    names = table.column_names
    cells = [[_cell(r[n]) for n in names] for r in rows]
    widths = [max([len(n)] + [len(c[i]) for c in cells]) for i, n in enumerate(names)]
    lines = [" | ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    shown = f"{len(rows)} of {table.num_rows}" if len(rows) < table.num_rows else str(table.num_rows)
    lines.append(f"({shown} row{'s' if table.num_rows != 1 else ''})")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinite floats (also inside lists and structs) as None: JSON has
    no NaN or Infinity, and a reader of the lines refuses them (review, 2026-11-29)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def to_json_lines(table: pa.Table) -> str:
    """One JSON object per row (timestamps as ISO 8601 strings, NaN and infinities as null)."""
    return "".join(json.dumps(_finite(r), allow_nan=False,
                              default=lambda v: v.isoformat() if hasattr(v, "isoformat") else str(v))
                   + "\n" for r in unique_names(table).to_pylist())


def to_csv(table: pa.Table) -> str:
    """CSV with a header row; nested columns (list, struct, map...) are written as JSON text, as
    the table and JSON formats show them (a map as its [key, value] pairs)."""
    table = unique_names(table)
    cols = []
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_nested(col.type):  # the CSV writer takes none of them (a map failed)
            col = pa.array([None if v is None else json.dumps(v, default=str) for v in col.to_pylist()],
                           pa.string())
        cols.append(col)
    buf = io.BytesIO()
    pcsv.write_csv(pa.Table.from_arrays(cols, names=table.column_names), buf)
    return buf.getvalue().decode()


def render(table: pa.Table, fmt: str, out: Path | None = None) -> str | None:
    """Write ``table`` as ``fmt`` to ``out`` (returns None) or return the text (parquet needs ``out``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        if out is None:
            raise ValueError("--format parquet needs --out FILE")
        pq.write_table(unique_names(table), out)  # else pyarrow cannot read the file back
        return None
    text = {"table": format_table, "csv": to_csv, "json": to_json_lines}[fmt](table)
    if out is None:
        return text
    Path(out).write_text(text if text.endswith("\n") else text + "\n")
    return None
