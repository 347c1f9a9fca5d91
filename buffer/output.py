"""Render an Arrow table as text, CSV, JSON lines or Parquet (for ``rlake sql``).

Values Arrow's writers or ``json`` do not render readably are spelled out the same way in every
text format: an INTERVAL as DuckDB prints it (``00:01:09.75671``, ``1 month 2 days 03:04:05``),
a BLOB as lowercase hex (``616201``: no prefix, two digits a byte), a DECIMAL in JSON as a
number (an integer when its scale is 0, as ``sum`` of integers gives, else a float).
"""

from __future__ import annotations

import io
import json
import math
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from buffer.names import FORMATS

MAX_CELL = 60


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if abs(n) == 1 else 's'}"


def interval_text(value: pa.MonthDayNano) -> str:
    """An interval as DuckDB prints it: ``1 year 2 months 3 days -04:05:06.5``, the time part
    left out when zero unless all is zero (``00:00:00``). Arrow hands DuckDB's INTERVAL over as
    ``MonthDayNano``, which the text formats showed raw, JSON as ``[0, 0, n]``, and which the CSV
    and Parquet writers refused (review, 2026-11-29)."""
    years, months = int(value.months / 12), value.months - int(value.months / 12) * 12  # toward 0
    parts = [_plural(n, unit) for n, unit in ((years, "year"), (months, "month"), (value.days, "day"))
             if n]
    if value.nanoseconds or not parts:
        sign, nanos = ("-" if value.nanoseconds < 0 else ""), abs(value.nanoseconds)
        seconds, frac = divmod(nanos, 1_000_000_000)
        text = f"{sign}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if frac:
            digits = f"{frac:09d}" if frac % 1000 else f"{frac // 1000:06d}"
            text += "." + digits.rstrip("0")
        parts.append(text)
    return " ".join(parts)


def plain(value: Any) -> Any:
    """``value`` (also inside lists and structs) with what JSON and text cannot show as it is
    spelled out: an interval as DuckDB's text, bytes as hex, a decimal as a number (int at
    scale 0), NaN and infinite floats as None (JSON has no NaN or Infinity, and a reader of the
    lines refuses them: review, 2026-11-29)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, pa.MonthDayNano):  # a tuple: before the list/tuple case
        return interval_text(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Decimal):
        return int(value) if value.as_tuple().exponent >= 0 else float(value)
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def _json_default(value: Any) -> str:
    """What ``json`` cannot write after ``plain``: times as ISO 8601, anything else as text."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _json(value: Any) -> str:
    return json.dumps(plain(value), default=_json_default)


def _cell(value: Any) -> str:
    """One value as table text: ISO for times, JSON for lists/dicts, cut to ``MAX_CELL`` chars."""
    if value is None:
        text = "NULL"
    elif isinstance(value, datetime | date):
        text = value.isoformat()
    elif isinstance(value, pa.MonthDayNano | bytes):
        text = plain(value)
    elif isinstance(value, list | dict):
        text = _json(value)
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


def to_json_lines(table: pa.Table) -> str:
    """One JSON object per row (timestamps as ISO 8601 strings, NaN and infinities as null,
    intervals, blobs and decimals as ``plain`` spells them)."""
    return "".join(json.dumps(plain(r), allow_nan=False, default=_json_default) + "\n"
                   for r in unique_names(table).to_pylist())


def _is_interval(kind: pa.DataType) -> bool:
    return kind == pa.month_day_nano_interval()


def _holds_interval(kind: pa.DataType) -> bool:
    """An interval type, or a nested type (list, struct, map...) with one anywhere inside."""
    return _is_interval(kind) or any(_holds_interval(kind.field(i).type) for i in range(kind.num_fields))


def _is_blob(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)


def _as_text(col: pa.ChunkedArray, spell) -> pa.Array:
    return pa.array([None if v is None else spell(v) for v in col.to_pylist()], pa.string())


def to_csv(table: pa.Table) -> str:
    """CSV with a header row; nested columns (list, struct, map...) are written as JSON text, as
    the table and JSON formats show them (a map as its [key, value] pairs); intervals and blobs
    as ``plain`` text (the writer refused intervals, and wrote blobs' raw bytes)."""
    table = unique_names(table)
    cols = []
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_nested(col.type):  # the CSV writer takes none of them (a map failed)
            col = _as_text(col, _json)
        elif _is_interval(col.type) or _is_blob(col.type):
            col = _as_text(col, plain)
        cols.append(col)
    buf = io.BytesIO()
    pcsv.write_csv(pa.Table.from_arrays(cols, names=table.column_names), buf)
    return buf.getvalue().decode()


def parquet_ready(table: pa.Table) -> pa.Table:
    """``table`` with its interval columns as string columns of DuckDB's text, and a nested
    column holding an interval as JSON text (Parquet has no type Arrow writes an interval as:
    the write failed); every other column keeps its type."""
    for i, name in enumerate(table.column_names):
        kind = table.column(i).type
        if _holds_interval(kind):
            table = table.set_column(i, name, _as_text(table.column(i),
                                                       interval_text if _is_interval(kind) else _json))
    return table


def render(table: pa.Table, fmt: str, out: Path | None = None) -> str | None:
    """Write ``table`` as ``fmt`` to ``out`` (returns None) or return the text (parquet needs ``out``).

    Parquet keeps every column's type except intervals, written as strings (``parquet_ready``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        if out is None:
            raise ValueError("--format parquet needs --out FILE")
        pq.write_table(parquet_ready(unique_names(table)), out)  # else pyarrow cannot read the file back
        return None
    text = {"table": format_table, "csv": to_csv, "json": to_json_lines}[fmt](table)
    if out is None:
        return text
    Path(out).write_text(text if text.endswith("\n") else text + "\n")
    return None
