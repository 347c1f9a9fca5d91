"""Cores for async mode's two sides on one machine (``pin_cores``, Linux).

The training process keeps ``torch_threads`` cores of its own; its child processes (the rollout
side's process, the embedded Prefect server, the MLflow tracker) share the others. Unpinned, the
scheduler spreads five busy processes over the cores and the train step, the iteration's
critical path, lost its core to them in turns: on 2 cores it took 0.088-0.099 s in async mode
against 0.063-0.070 s pinned (2026-11-27, docs/operations.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from infra.recovery import parent_pid


def split_cores(available: Iterable[int], training_threads: int) -> tuple[set[int], set[int]] | None:
    """(the training process's cores, everyone else's): the first ``training_threads`` of
    ``available`` (sorted) and the rest; None when no core would be left for the rest."""
    cores = sorted(set(available))
    if training_threads < 1 or len(cores) <= training_threads:
        return None
    return set(cores[:training_threads]), set(cores[training_threads:])


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    return [int(e.name) for e in os.scandir("/proc")
            if e.name.isdigit() and parent_pid(int(e.name)) == pid]


def pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (threads it starts later inherit their starter's)."""
    for tid in _thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # ended meanwhile
            continue


def _thread_ids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@contextmanager
def training_cores(training_threads: int) -> Iterator[tuple[set[int], set[int]] | None]:
    """Pin this process to its own cores and its children to the rest (``split_cores`` of the
    cores this process may use); put every thread back as it was on exit. Yields the split, or
    None where nothing was pinned (not Linux, or too few cores)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        yield None
        return
    split = split_cores(os.sched_getaffinity(0), training_threads)
    if split is None:
        yield None
        return
    mine, rest = split
    children = child_pids(os.getpid())
    # each process's cores as its main thread had them (a thread started meanwhile inherited
    # the pinned set: it is put back too)
    before = {pid: cores for pid in [os.getpid(), *children]
              if (cores := _affinity(pid)) is not None}
    pin_process(os.getpid(), mine)
    for pid in children:
        pin_process(pid, rest)
    try:
        yield split
    finally:
        for pid, cores in before.items():
            pin_process(pid, cores)


def _affinity(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except OSError:  # ended meanwhile
        return None
