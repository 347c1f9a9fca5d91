"""Concurrent writers and killed writers: exactly-once appends, an always-readable table."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from deltalake import DeltaTable

from buffer import Lake
from buffer.maintenance import vacuum
from buffer.synth import synthetic_rows

WORKERS, BATCHES, ROWS = 4, 50, 16
ROOT = Path(__file__).resolve().parents[1]


def _writer(lake_uri: str, worker: int, barrier) -> None:
    """Append this worker's 50 batches; interleaved, re-append the next worker's batch of the same k
    (so every batch is written by two processes at about the same time)."""
    lake = Lake(lake_uri)
    neighbour = (worker + 1) % WORKERS
    barrier.wait()
    for k in range(BATCHES):
        lake.append_trajectories(synthetic_rows("run", worker * 1000 + k, ROWS, response_len=8))
        lake.append_trajectories(synthetic_rows("run", neighbour * 1000 + k, ROWS, response_len=8))


def test_four_processes_fifty_batches_exactly_once(tmp_path):
    uri = str(tmp_path / "lake")
    ctx = mp.get_context("spawn")  # deltalake's runtime does not survive fork
    barrier = ctx.Barrier(WORKERS)
    procs = [ctx.Process(target=_writer, args=(uri, w, barrier)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    table = Lake(uri).read("trajectories", columns=["sample_uid", "iteration"])
    got = table.column("sample_uid").to_pylist()
    assert len(got) == WORKERS * BATCHES * ROWS
    assert len(set(got)) == len(got)
    per_batch = Counter(table.column("iteration").to_pylist())
    assert len(per_batch) == WORKERS * BATCHES and set(per_batch.values()) == {ROWS}


CHILD = """
import sys
from buffer import Lake
from buffer.synth import synthetic_rows
lake = Lake(sys.argv[1])
for it in range(int(sys.argv[2]), int(sys.argv[3])):
    rows = synthetic_rows("run", it, 4096, response_len=128)
    print("start", it, flush=True)
    lake.append_trajectories(rows)
    print("done", it, flush=True)
"""


def _files_on_disk(uri: str) -> set[str]:
    return {str(p) for p in Path(uri, "trajectories").rglob("*.parquet")}


def test_sigkill_mid_append_leaves_whole_batches(tmp_path):
    uri = str(tmp_path / "lake")
    rng = random.Random(0)
    n_iters, killed_mid_append, orphaned = 12, 0, False
    start = 0
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, uri, str(start), str(n_iters)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        # wait until an append is under way, then kill at a random point inside it
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            break
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        lines = [line.strip(), *out.split("\n")]
        started = [int(x.split()[1]) for x in lines if x.startswith("start")]
        done = [int(x.split()[1]) for x in lines if x.startswith("done")]
        killed_mid_append += bool(started) and (not done or started[-1] > done[-1])
        # the table is readable and every batch is all there or not there at all
        lake = Lake(uri)
        if lake.table_version("trajectories") is not None:
            counts = Counter(lake.read("trajectories", columns=["iteration"]).column(0).to_pylist())
            assert set(counts.values()) <= {4096}, counts
            referenced = set(DeltaTable(lake.table_uri("trajectories")).file_uris())
            orphaned |= bool(_files_on_disk(uri) - referenced)
            start = len(counts)
    assert killed_mid_append >= 1
    # re-running the appends completes the table, writing each batch once
    lake = Lake(uri)
    for it in range(n_iters):
        lake.append_trajectories(synthetic_rows("run", it, 4096, response_len=128))
    counts = Counter(lake.read("trajectories", columns=["iteration"]).column(0).to_pylist())
    assert counts == {it: 4096 for it in range(n_iters)}
    # files half-written by killed writers are never referenced; vacuum removes them
    vacuum(lake, retention_hours=0)
    assert _files_on_disk(uri) == set(DeltaTable(lake.table_uri("trajectories")).file_uris())
    print("orphans seen:", orphaned)
