"""Cores for a run's processes on one machine (``pin_cores``, Linux; which runs pin:
``flows.rl.pins_cores``).

The training process keeps ``torch_threads`` cores of its own; its child processes (async mode's
rollout side, the embedded Prefect server, the MLflow tracker) share the others. Unpinned, the
scheduler spreads the busy processes over the cores and the train step, the iteration's
critical path, lost its core to them in turns: on 2 cores it took 0.088-0.099 s in async mode
against 0.063-0.070 s pinned (2026-11-27, docs/operations.md); in sync mode 96-100 ms against
async's pinned 76-85 (2026-12-01).

A child started *while* the process is pinned belongs with the helpers too (a custom reward
function's workers, async eval's among them; Megatron's ranks): started from a thread on the
training cores it would inherit them. ``children_cores`` says where it goes, and
``infra.spawned.in_launcher``, the one thread that starts such children, moves itself there
before it starts one: the child inherits that thread's cores from its first instruction.

Two async runs on one machine take different cores: a training process holds a lock file per
core it pinned itself to (``claimed_cores``, released when it unpins or dies), and the next run
takes the first cores nobody holds and keeps its children off the held ones while others are
free. Without a free core for its training process a run does not pin.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from infra.recovery import parent_pid


def split_cores(available: Iterable[int], training_threads: int,
                taken: Iterable[int] = ()) -> tuple[set[int], set[int]] | None:
    """(the training process's cores, everyone else's): the first ``training_threads`` of
    ``available`` (sorted) that no other run's training process holds (``taken``), and the
    rest, without the taken ones while any other is left; None when there are not enough free
    cores for the training process, or no core would be left for the rest."""
    cores, taken = sorted(set(available)), set(taken)
    free = [c for c in cores if c not in taken]
    if training_threads < 1 or len(free) < training_threads or len(cores) <= training_threads:
        return None
    mine = set(free[:training_threads])
    rest = set(cores) - mine
    return mine, (rest - taken) or rest


LOCK_DIR_ENV = "RLAKE_CORE_LOCK_DIR"  # the lock files' folder (default: one per user in /tmp)


def _lock_dir() -> Path:
    path = Path(os.environ.get(LOCK_DIR_ENV) or
                Path(tempfile.gettempdir()) / f"rlake-cores-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _try_lock(core: int, stack: ExitStack) -> bool:
    """Hold core ``core``'s lock file until ``stack`` closes; False if another process holds it."""
    lock = stack.enter_context(open(_lock_dir() / f"core-{core}.lock", "w"))  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextmanager
def claimed_cores(available: Iterable[int], training_threads: int
                  ) -> Iterator[tuple[set[int], set[int]] | None]:
    """``split_cores`` with the cores other runs' training processes hold as ``taken``; this
    run's training cores are held (their lock files) until the block ends."""
    available = sorted(set(available))
    taken: set[int] = set()
    for core in available:  # a core whose lock is free is not taken (the probe lets it go)
        with ExitStack() as probe:
            if not _try_lock(core, probe):
                taken.add(core)
    while True:
        split = split_cores(available, training_threads, taken)
        if split is None:
            yield None
            return
        with ExitStack() as attempt:
            lost = [c for c in sorted(split[0]) if not _try_lock(c, attempt)]
            if not lost:
                held = attempt.pop_all()
                break
        taken.update(lost)  # another run took it meanwhile: choose again, holding none
    with held:
        yield split


_children_cores: set[int] | None = None  # while pinned (_pinned): the helpers' cores


def children_cores() -> set[int] | None:
    """The cores a child process started now belongs on: the helpers' while this process is
    pinned (``training_cores``); None when it is not (a child then starts where its starter is)."""
    return _children_cores


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
    with claimed_cores(os.sched_getaffinity(0), training_threads) as split:
        if split is None:
            yield None
            return
        with _pinned(*split) as pinned:
            yield pinned


@contextmanager
def _pinned(mine: set[int], rest: set[int]) -> Iterator[tuple[set[int], set[int]]]:
    global _children_cores
    children = child_pids(os.getpid())
    # each process's cores as its main thread had them (a thread started meanwhile inherited
    # the pinned set: it is put back too)
    before = {pid: cores for pid in [os.getpid(), *children]
              if (cores := _affinity(pid)) is not None}
    pin_process(os.getpid(), mine)
    for pid in children:
        pin_process(pid, rest)
    _children_cores = rest
    try:
        yield mine, rest
    finally:
        _children_cores = None
        # every thread of this process as it was, the launcher's too (it moved to ``rest``);
        # a child started meanwhile stays on the helpers' cores: it was one of them
        for pid, cores in before.items():
            pin_process(pid, cores)


def _affinity(pid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(pid)
    except OSError:  # ended meanwhile
        return None
