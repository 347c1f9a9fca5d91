"""Concurrent writers and killed writers: exactly-once appends, an always-readable table."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from deltalake import DeltaTable

from buffer import Lake
from buffer.maintenance import vacuum
from buffer.synth import relabel, synthetic_rows

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


BIG = 8192


def base_batch():
    from buffer.schema import rows_to_table

    return rows_to_table("trajectories", synthetic_rows("run", 0, BIG, response_len=128))


CHILD = """
import sys
from buffer import Lake
from buffer.synth import relabel
from infra.faults import set_iteration
from tests.test_lake_concurrency import base_batch
lake = Lake(sys.argv[1])
base = base_batch()
for it in range(int(sys.argv[2]), int(sys.argv[3])):
    batch = relabel(base, "run", it)
    set_iteration(it)
    print("start", it, flush=True)
    lake.append_trajectories(batch)
    print("done", it, flush=True)
"""


def _files_on_disk(uri: str) -> set[str]:
    return {str(p) for p in Path(uri, "trajectories").rglob("*.parquet") if "_delta_log" not in p.parts}


def test_sigkill_mid_append_leaves_whole_batches(tmp_path):
    """Five writer processes, each killed (SIGKILL) inside the Delta write of one batch by the
    ``during_lake_append`` fault point: after each, the table reads whole batches only."""
    uri = str(tmp_path / "lake")
    rng = random.Random(0)
    n_iters, start = 10, 0
    for _ in range(5):
        kill_at = rng.randrange(start, n_iters)
        proc = subprocess.run([sys.executable, "-c", CHILD, uri, str(start), str(n_iters)], cwd=ROOT,
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONPATH": str(ROOT),
                                   "RLAKE_FAULT": f"during_lake_append:{kill_at}"})
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
        lines = proc.stdout.split()
        started = [int(n) for w, n in zip(lines[::2], lines[1::2], strict=True) if w == "start"]
        done = [int(n) for w, n in zip(lines[::2], lines[1::2], strict=True) if w == "done"]
        # killed inside the append of kill_at, after every earlier one completed
        assert (started, done) == (list(range(start, kill_at + 1)), list(range(start, kill_at)))
        # the table is readable and every batch is all there or not there at all
        lake = Lake(uri)
        counts = Counter(lake.read("trajectories", columns=["iteration"]).column(0).to_pylist()) \
            if lake.table_version("trajectories") is not None else Counter()
        assert counts == {it: BIG for it in range(kill_at)}, counts
        start = kill_at
    # re-running the appends completes the table, writing each batch once
    lake, base = Lake(uri), base_batch()
    for it in range(n_iters):
        lake.append_trajectories(relabel(base, "run", it))
    counts = Counter(lake.read("trajectories", columns=["iteration"]).column(0).to_pylist())
    assert counts == {it: BIG for it in range(n_iters)}
    # files half-written by killed writers are never referenced; vacuum removes them
    vacuum(lake, retention_hours=0)
    assert _files_on_disk(uri) == set(DeltaTable(lake.table_uri("trajectories")).file_uris())


def _compact(lake_uri: str, barrier) -> None:
    from buffer.maintenance import compact

    barrier.wait()
    compact(Lake(lake_uri))


def _hold_lock(lake_uri: str, held, release) -> None:
    from buffer.maintenance import compaction_lock

    with compaction_lock(Lake(lake_uri), "trajectories"):
        held.set()
        release.wait(120)


def test_two_compactions_at_once_keep_every_row_once(tmp_path):
    """Both commits of two concurrent compactions landed (3 tries in 5, review 2026-11-29):
    every row twice. The compaction lock makes the second wait and rewrite what the first left;
    while another process holds it, a compaction does not start."""
    import time

    uri = str(tmp_path / "lake")
    lake = Lake(uri)
    ctx = mp.get_context("spawn")
    for round_ in range(3):
        for k in range(8):  # small files for this round's compactions
            lake.append_trajectories(synthetic_rows("run", round_ * 100 + k, ROWS, response_len=8))
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_compact, args=(uri, barrier)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        uids = Lake(uri).read("trajectories", columns=["sample_uid"]).column(0).to_pylist()
        assert len(uids) == 8 * (round_ + 1) * ROWS and len(set(uids)) == len(uids)
    version = Lake(uri).table_version("trajectories")
    lake.append_trajectories(synthetic_rows("run", 999, ROWS, response_len=8))
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(uri, held, release))
    holder.start()
    assert held.wait(60)
    alone = ctx.Barrier(1)  # held here: a collected one's semaphore is gone before the child opens it
    compacting = ctx.Process(target=_compact, args=(uri, alone))
    compacting.start()
    time.sleep(3)
    assert compacting.is_alive() and Lake(uri).table_version("trajectories") == version + 1
    release.set()
    compacting.join(120)
    holder.join(30)
    assert compacting.exitcode == 0 and Lake(uri).table_version("trajectories") > version + 1
