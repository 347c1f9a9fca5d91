"""Benchmark the lake: append throughput vs raw Parquet, the train_steps commit, slice latency vs
table size, DuckDB GROUP BY.

    python bench/lake.py [--batches 50] [--sizes 10,100,1000] [--sql-rows 1000000] [--dir DIR]

Prints figures, then one JSON line (the last line) with every number. Never asserts on time.
Timings are medians of repeated runs; the machine may be shared, so compare ratios measured in
the same run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from buffer import Lake  # noqa: E402
from buffer.maintenance import compact  # noqa: E402
from buffer.schema import rows_to_table  # noqa: E402
from buffer.synth import relabel, synthetic_rows  # noqa: E402

BATCH = 512
RUN = "bench"


def median_ms(fn, repeat: int, cpu: bool = False) -> float:
    """Median wall time (or this process's CPU time, all threads) of ``fn()`` over ``repeat`` calls, ms."""
    clock = time.process_time if cpu else time.perf_counter
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return 1000 * statistics.median(times)


def bench_append(root: Path, base: pa.Table, batches: int, group: int = 1) -> dict:
    """Append ``batches`` batches of ``group`` x 512 rows to a fresh lake vs ``pq.write_table``."""
    data = [pa.concat_tables([relabel(base, f"append{group}", i * group + j) for j in range(group)])
            for i in range(batches)]
    nbytes = sum(b.nbytes for b in data)
    raw_dir = root / f"raw{group}"
    raw_dir.mkdir()
    lake = Lake(str(root / f"append-lake{group}"))
    lake.append_trajectories(relabel(base, f"append{group}", -1))  # table creation is not timed
    per, raw, per_cpu, raw_cpu = [], [], [], []
    for i, b in enumerate(data):  # interleaved, so both see the same machine load
        t, c = time.perf_counter(), time.process_time()
        pq.write_table(b, raw_dir / f"{i}.parquet")
        raw.append(time.perf_counter() - t)
        raw_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        lake.append_trajectories(b)
        per.append(time.perf_counter() - t)
        per_cpu.append(time.process_time() - c)
    lake_s, raw_s = sum(per), sum(raw)
    t = time.perf_counter()
    for b in data[: max(1, batches // 5)]:
        lake.append_trajectories(b)  # retries of already written batches: a check, no commit
    dup_ms = 1000 * (time.perf_counter() - t) / max(1, batches // 5)
    rows = batches * BATCH * group
    if group != 1:
        return {f"append_vs_parquet_cpu_ratio_{group * BATCH}_rows": sum(per_cpu) / sum(raw_cpu),
                f"append_rows_per_s_{group * BATCH}_rows": rows / lake_s}
    return {
        "append_batches": batches,
        "append_rows_per_s": rows / lake_s,
        "append_mb_per_s": nbytes / lake_s / 1e6,
        "append_ms_median": 1000 * statistics.median(per),
        "parquet_rows_per_s": rows / raw_s,
        "parquet_mb_per_s": nbytes / raw_s / 1e6,
        "parquet_ms_median": 1000 * statistics.median(raw),
        "append_vs_parquet_time_ratio": lake_s / raw_s,
        "append_vs_parquet_median_ratio": statistics.median(per) / statistics.median(raw),
        # CPU seconds of this process (all threads): robust to other load on a shared machine
        "append_cpu_ms_median": 1000 * statistics.median(per_cpu),
        "parquet_cpu_ms_median": 1000 * statistics.median(raw_cpu),
        "append_vs_parquet_cpu_ratio": sum(per_cpu) / sum(raw_cpu),
        "duplicate_append_ms": dup_ms,
    }


def step_row(run_id: str, step: int, samples: int) -> dict:
    """A ``train_steps`` row of step ``step`` consuming ``samples`` samples of iteration ``step``."""
    return {"run_id": run_id, "step": step, "iteration": step, "base_version": step,
            "weight_version": step + 1, "n_samples": samples,
            "sample_uids": [f"{run_id}/{step}/{i}" for i in range(samples)]}


def bench_train_step(root: Path, steps: int, samples: int = 256) -> dict:
    """The commit point of an iteration: ``steps`` one-row ``train_steps`` appends to a fresh
    table, each split into its key check (``delta.existing_keys``: is the step there already?)
    and the Delta write (``delta.write_deltalake``: Parquet file + commit), timed by wrapping
    the two in ``buffer.delta`` for this bench only."""
    from buffer import delta

    parts: dict[str, list[float]] = {"existing_keys": [], "write_deltalake": []}
    originals = {name: getattr(delta, name) for name in parts}

    def timed(name: str):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                parts[name].append(time.perf_counter() - t)
        return call

    lake = Lake(str(root / "train-steps-lake"))
    total = []
    try:
        for name in parts:
            setattr(delta, name, timed(name))
        for step in range(steps):
            t = time.perf_counter()
            lake.append_train_step(step_row(RUN, step, samples))
            total.append(time.perf_counter() - t)
    finally:
        for name, fn in originals.items():
            setattr(delta, name, fn)
    warm = slice(1, None)  # the first append creates the table
    return {"train_step_steps": steps,
            "train_step_ms_median": 1000 * statistics.median(total[warm]),
            "train_step_key_check_ms_median": 1000 * statistics.median(parts["existing_keys"][warm]),
            "train_step_write_ms_median": 1000 * statistics.median(parts["write_deltalake"][warm])}


def grow(lake: Lake, base: pa.Table, start: int, stop: int) -> list[float]:
    """Iterations ``start..stop-1``: one 512-row batch (weight_version = iteration) and one train step
    consuming the previous iteration's samples. Returns each trajectory append's seconds."""
    times = []
    for it in range(start, stop):
        batch = relabel(base, RUN, it)
        t = time.perf_counter()
        lake.append_trajectories(batch)
        times.append(time.perf_counter() - t)
        if it > 0:
            lake.append_train_step({**step_row(RUN, it - 1, BATCH), "iteration": it})
    return times


def bench_slices(root: Path, base: pa.Table, sizes: list[int], repeat: int) -> dict:
    """Slice latency (staleness 2, unconsumed only) when the table holds each of ``sizes`` iterations."""
    lake = Lake(str(root / "slice-lake"))
    out: dict = {}
    done = 0
    for size in sorted(sizes):
        t = time.perf_counter()
        appends = grow(lake, base, done, size)
        grow_s = time.perf_counter() - t
        done = size
        v = size - 1
        n = lake.training_slice(RUN, v - 2).num_rows
        out[f"slice_ms_{size}"] = median_ms(lambda v=v: lake.training_slice(RUN, v - 2), repeat)
        out[f"slice_cpu_ms_{size}"] = median_ms(lambda v=v: lake.training_slice(RUN, v - 2), repeat, cpu=True)
        out[f"slice_rows_{size}"] = n
        out[f"slice_cold_ms_{size}"] = median_ms(lambda v=v: Lake(lake.uri).training_slice(RUN, v - 2), 3)
        out[f"append_ms_at_{size}"] = 1000 * statistics.median(appends[-20:])
        print(f"  {size:5d} iterations: slice {out[f'slice_ms_{size}']:.1f} ms "
              f"({out[f'slice_cpu_ms_{size}']:.1f} ms CPU) "
              f"(cold {out[f'slice_cold_ms_{size}']:.1f} ms, {n} rows); "
              f"append there {out[f'append_ms_at_{size}']:.1f} ms; grew in {grow_s:.1f} s", flush=True)
    big = max(sizes)
    # the same slice without file pruning: Arrow opens every file's footer and filters row groups
    flt = (pc.field("run_id") == RUN) & (pc.field("kind") == "train") & (pc.field("weight_version") >= big - 3)
    out["unpruned_slice_ms"] = median_ms(lambda: lake.dataset("trajectories").to_table(filter=flt), 3)
    t = time.perf_counter()
    compact(lake, "trajectories")
    compact(lake, "train_steps")
    out["compact_s"] = time.perf_counter() - t
    out[f"slice_ms_{big}_compacted"] = median_ms(lambda: lake.training_slice(RUN, big - 3), repeat)
    out[f"slice_cpu_ms_{big}_compacted"] = median_ms(lambda: lake.training_slice(RUN, big - 3), repeat, cpu=True)
    out["slice_flatness_ratio"] = out[f"slice_ms_{big}"] / out[f"slice_ms_{min(sizes)}"]
    out["slice_flatness_cpu_ratio"] = out[f"slice_cpu_ms_{big}"] / out[f"slice_cpu_ms_{min(sizes)}"]
    return out


def bench_sql(root: Path, base: pa.Table, rows: int) -> dict:
    """DuckDB GROUP BY over at least ``rows`` trajectory rows (written as 51,200-row appends)."""
    lake = Lake(str(root / "sql-lake"))
    per_batch = BATCH * 100
    n_batches = max(1, -(-rows // per_batch))
    for k in range(n_batches):
        big = pa.concat_tables([relabel(base, f"sql-{k % 4}", k * 100 + j, weight_version=k) for j in range(100)])
        lake.append_trajectories(big)
    query = ("SELECT run_id, weight_version, count(*) AS n, avg(reward) AS mean_reward, "
             "max(created_at) AS last FROM trajectories GROUP BY 1, 2 ORDER BY 1, 2")
    query_len = ("SELECT run_id, weight_version, avg(len(response_token_ids)) AS mean_len "
                 "FROM trajectories GROUP BY 1, 2 ORDER BY 1, 2")
    n_rows = lake.sql("SELECT count(*) FROM trajectories").column(0)[0].as_py()
    ms = median_ms(lambda: lake.sql(query), 3)
    ms_len = median_ms(lambda: lake.sql(query_len), 1)
    return {"sql_rows": n_rows, "sql_groupby_ms": ms, "sql_rows_per_s": n_rows / (ms / 1000),
            "sql_groupby_list_len_ms": ms_len}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=50, help="512-row batches for the append figure")
    p.add_argument("--steps", type=int, default=60, help="train_steps appends for the commit figure")
    p.add_argument("--sizes", default="10,100,1000", help="table sizes (iterations) for slice latency")
    p.add_argument("--sql-rows", type=int, default=1_000_000, help="rows for the DuckDB GROUP BY")
    p.add_argument("--repeat", type=int, default=15, help="repetitions per slice timing")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(args.dir or tempfile.mkdtemp(prefix="rlake-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    base = rows_to_table("trajectories", synthetic_rows("base", 0, BATCH, seed=0))
    result: dict = {"bench": "lake", "batch_rows": BATCH, "batch_mb": base.nbytes / 1e6, "cpus": os.cpu_count()}
    try:
        t0 = time.perf_counter()
        result.update(bench_append(root, base, args.batches))
        result.update(bench_append(root, base, max(2, args.batches // 5), group=8))
        print(f"append: {result['append_rows_per_s']:.0f} rows/s, {result['append_mb_per_s']:.1f} MB/s, "
              f"median {result['append_ms_median']:.1f} ms/batch; raw parquet "
              f"{result['parquet_rows_per_s']:.0f} rows/s -> lake/parquet time x"
              f"{result['append_vs_parquet_time_ratio']:.2f} (medians x{result['append_vs_parquet_median_ratio']:.2f}, "
              f"CPU time x{result['append_vs_parquet_cpu_ratio']:.2f}); duplicate batch {result['duplicate_append_ms']:.1f} ms; "
              f"4096-row batches: CPU time x{result['append_vs_parquet_cpu_ratio_4096_rows']:.2f}",
              flush=True)
        result.update(bench_train_step(root, args.steps))
        print(f"train_steps commit (one row, {args.steps} steps): median {result['train_step_ms_median']:.1f} ms "
              f"= key check {result['train_step_key_check_ms_median']:.1f} ms + Delta write "
              f"{result['train_step_write_ms_median']:.1f} ms + the rest (table refresh, row build)",
              flush=True)
        print("slice (staleness 2, unconsumed, warm lake):", flush=True)
        result.update(bench_slices(root, base, sizes, args.repeat))
        big = max(sizes)
        print(f"  without file pruning {result['unpruned_slice_ms']:.0f} ms; after compaction slice "
              f"{result[f'slice_ms_{big}_compacted']:.1f} ms ({result[f'slice_cpu_ms_{big}_compacted']:.1f} ms CPU); "
              f"flatness x{result['slice_flatness_ratio']:.2f} (CPU x{result['slice_flatness_cpu_ratio']:.2f})",
              flush=True)
        result.update(bench_sql(root, base, args.sql_rows))
        print(f"duckdb GROUP BY over {result['sql_rows']} rows: {result['sql_groupby_ms']:.0f} ms "
              f"({result['sql_rows_per_s'] / 1e6:.1f} M rows/s); with avg(len(response_token_ids)) "
              f"{result['sql_groupby_list_len_ms']:.0f} ms", flush=True)
        result["total_s"] = time.perf_counter() - t0
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return result


if __name__ == "__main__":
    main()
