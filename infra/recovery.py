"""What a ``kill -9`` leaves behind, cleaned up on resume.

- The embedded Prefect server of the dead process keeps running (it is a ``uvicorn`` child that
  loses its parent): ``orphan_servers`` finds the ones serving our ``PREFECT_HOME`` whose parent
  is gone, ``stop_processes`` ends them by PID.
- The dead process's flow runs stay RUNNING: ``mark_crashed`` sets every RUNNING flow run tagged
  with the rlake run (``run_tag``) to Crashed.
- A flow run the dead process created ahead of time for a next iteration never started
  (Pending, named ``PREFETCHED``): ``delete_prefetched`` deletes it rather than mark it Crashed,
  unless it did start (the lake says its iteration committed, or it has task runs) and only its
  Running state, sent from a background thread, was lost with the process: that one is marked
  Crashed like the others.
- Two processes must not drive one run: ``claim_run`` takes an exclusive flock on ``owner.lock``
  in the run folder (the kernel drops it when its process dies: a PID reused since is no
  owner), writes its PID into ``owner.pid`` for messages, and refuses when another process
  holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from pathlib import Path

# in the command line of a Prefect API server: Prefect's own app (its temporary server, `prefect
# server start`), the embedded server's (uvicorn's factory: infra/prefect_app.py)
SERVER_SIGNATURE = "prefect.server.api.server:create_app"
EMBEDDED_APP = "infra.prefect_app:create_app"
SERVER_SIGNATURES = (SERVER_SIGNATURE, EMBEDDED_APP)
# the state name of a flow run created ahead of its iteration (flows/prefetch.py) and not started
PREFETCHED = "Prefetched"


def run_tag(run_id: str) -> str:
    """The Prefect tag on every flow run of an rlake run."""
    return f"rlake-run:{run_id}"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> dict[str, str]:
    out = {}
    for item in _read(Path(f"/proc/{pid}/environ")).split(b"\0"):
        key, _, value = item.partition(b"=")
        if key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _cmdline(pid: int) -> str:
    return _read(Path(f"/proc/{pid}/cmdline")).replace(b"\0", b" ").decode(errors="replace")


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...);
    empty when the process is gone."""
    # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ')'
    return _read(Path(f"/proc/{pid}/stat")).decode(errors="replace").rpartition(")")[2].split()


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (from /proc), or None when it is gone."""
    fields = stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else None


def pid_alive(pid: int) -> bool:
    state = stat_fields(pid)
    return bool(state) and state[0] not in ("Z", "X")


def prefect_servers(prefect_home: str | Path) -> list[int]:
    """PIDs of Prefect API server processes whose PREFECT_HOME is ``prefect_home``."""
    home = str(Path(prefect_home).resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        if any(sign in _cmdline(pid) for sign in SERVER_SIGNATURES) and pid_alive(pid):
            env_home = _environ(pid).get("PREFECT_HOME")
            if env_home and str(Path(env_home).resolve()) == home:
                found.append(pid)
    return sorted(found)


def orphan_servers(prefect_home: str | Path) -> list[int]:
    """Servers of ``prefect_home`` whose starting process died: parent is init (1), gone, or no
    longer a Python process (adopted by a shell or a subreaper). Our own server is never one."""
    out = []
    for pid in prefect_servers(prefect_home):
        parent = parent_pid(pid)
        if parent == os.getpid():
            continue
        if parent in (None, 0, 1) or not pid_alive(parent) or "python" not in _cmdline(parent):
            out.append(pid)
    return out


def stop_processes(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM each PID, then SIGKILL those still alive after ``grace_s``; returns the PIDs ended."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


# the run lock (``claim_run``): an exclusive flock on this file in the run folder, held by the
# owning process while it drives the run; the kernel drops it when that process dies, so a dead
# owner never blocks a resume, whatever process its PID names later. The file stays (deleting a
# locked file lets two processes lock two files of one name). ``owner.pid`` beside it only names
# the holder, for messages and for people.
LOCK_FILE = "owner.lock"
OWNER_FILE = "owner.pid"
# how long a claim retries a taken lock before refusing: ``run_owner``'s probe (another process's
# `rlake status`) holds it for microseconds; a real owner holds it for the run's lifetime
CLAIM_RETRY_S = 0.25
# how long ``run_owner`` waits for a new holder to write its PID (it does so right after locking)
OWNER_PID_WAIT_S = 2.0
# this process's claims: resolved run folder -> [lock file descriptor, claim count]. A run is
# claimed twice in one process (``infra.startup.prepared_run``, then the flow's
# ``flows.durability.owned_run``): a second flock on a new descriptor would conflict with the
# first, so nested claims count instead, and the last release unlocks.
_HELD: dict[Path, list[int]] = {}
_HELD_LOCK = threading.Lock()


def _try_flock(fd: int, mode: int) -> bool:
    """Take a flock of ``mode`` on ``fd`` without waiting; False when another holds it."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _recorded_owner(run_dir: Path, wait_s: float) -> int:
    """The PID in ``owner.pid``; 0 when none is written within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        text = _read(run_dir / OWNER_FILE).decode(errors="replace").strip()
        if text.isdigit() or time.monotonic() >= deadline:
            return int(text) if text.isdigit() else 0
        time.sleep(0.01)


def run_owner(run_dir: Path) -> int | None:
    """The PID of another live process that owns the run folder (holds its lock), or None.

    0 when the lock is held but its holder wrote no PID (should not happen: it writes it right
    after locking)."""
    if Path(run_dir).resolve() in _HELD:
        return None
    try:  # O_CLOEXEC (Python's default too): no child of ours keeps the probe
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # never claimed (or by a version before the lock)
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):  # a shared probe: never blocks another probe
            return None
    finally:
        os.close(fd)  # releases the probe's lock
    return _recorded_owner(Path(run_dir), OWNER_PID_WAIT_S)


def _write_owner(run_dir: Path) -> None:
    """``owner.pid`` := this PID, atomically (a temp file of this process's own, renamed)."""
    tmp = run_dir / f"{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.replace(run_dir / OWNER_FILE)


def _lock_run(run_dir: Path) -> int:
    """This process's exclusive lock on the run folder, as its descriptor (kept open: the lock
    lives as long as it); a ValueError naming the owner when another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC: a child that execs (Prefect's server, reward workers, the rollout process under
    # multiprocessing's spawn) does not share the lock, so it ends with this process
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + CLAIM_RETRY_S
    while not _try_flock(fd, fcntl.LOCK_EX):
        if time.monotonic() >= deadline:
            os.close(fd)
            owner = _recorded_owner(run_dir, OWNER_PID_WAIT_S)
            holder = f"process {owner}" if owner else "another process"
            raise ValueError(f"run folder {run_dir} is in use by {holder} "
                             "(stop it first, or wait for it to finish)")
        time.sleep(0.02)
    return fd


def claim_run(run_dir: Path) -> None:
    """Make this process the run's owner until ``release_run`` (or its death); a ValueError if
    another live process owns it. Claiming a run this process owns already nests."""
    key = Path(run_dir).resolve()
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1] += 1
            return
        fd = _lock_run(Path(run_dir))
        try:
            _write_owner(Path(run_dir))
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = [fd, 1]


def release_run(run_dir: Path) -> None:
    """Undo one ``claim_run``: the last one removes ``owner.pid`` and unlocks the run folder."""
    key = Path(run_dir).resolve()
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[key]
        lock = Path(run_dir) / OWNER_FILE
        if _read(lock).decode(errors="replace").strip() == str(os.getpid()):
            lock.unlink(missing_ok=True)
        os.close(held[0])  # closing the (only) descriptor releases the flock


def mark_crashed(run_id: str, exclude: set[str] | None = None) -> list[str]:
    """Set the RUNNING (or PENDING) flow runs tagged ``run_tag(run_id)`` to Crashed.

    Returns their ids. ``exclude`` holds flow-run ids that are alive (this process's own).
    """
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    flt = FlowRunFilter(
        tags=FlowRunFilterTags(all_=[run_tag(run_id)]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING,
                                                                  StateType.PENDING])))
    marked = []
    with get_client(sync_client=True) as client:
        for fr in client.read_flow_runs(flow_run_filter=flt):
            if str(fr.id) in (exclude or set()):
                continue
            client.set_flow_run_state(fr.id, Crashed(message="process died (found on resume)"),
                                      force=True)
            marked.append(str(fr.id))
    return marked


def delete_prefetched(run_id: str, committed: set[int] = frozenset()) -> list[str]:
    """Delete the flow runs tagged ``run_tag(run_id)`` that were created ahead of their iteration
    and never started (Pending, named ``PREFETCHED``), and the parent's task runs that stood
    for them. Returns their ids.

    A run that did start but whose Running state was still queued on the dead process's
    background thread is still Pending ``PREFETCHED``; it is kept, for ``mark_crashed``, when
    its iteration is in ``committed`` (the lake says it ran) or when it has task runs (Prefect
    says it ran: their records travel apart from the run's states). Deleting it would delete
    its task runs with it (the server cascades)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateName,
        FlowRunFilterTags,
    )

    flt = FlowRunFilter(tags=FlowRunFilterTags(all_=[run_tag(run_id)]),
                        state=FlowRunFilterState(name=FlowRunFilterStateName(any_=[PREFETCHED])))
    deleted = []
    with get_client(sync_client=True) as client:
        for fr in client.read_flow_runs(flow_run_filter=flt):
            if fr.state_type is not None and fr.state_type.value != "PENDING":
                continue
            if fr.parameters.get("iteration") in committed or client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])), limit=1):
                continue  # it started
            delete_with_tracker(client, fr)
            deleted.append(str(fr.id))
    return deleted


def delete_with_tracker(client, flow_run) -> None:
    """Delete a subflow run and the parent's task run that stood for it (a sync client). One
    already gone is no error: Prefect's client sends a DELETE again when its answer is late."""
    from prefect.exceptions import ObjectNotFound

    for delete, record_id in ((client.delete_flow_run, flow_run.id),
                              (client.delete_task_run, flow_run.parent_task_run_id)):
        if record_id is not None:
            with contextlib.suppress(ObjectNotFound):
                delete(record_id)


def tag_current_flow_run(run_id: str) -> str | None:
    """Add ``run_tag(run_id)`` to the flow run this code runs in; returns its id (or None)."""
    from prefect import get_client
    from prefect.runtime import flow_run

    fr_id = flow_run.get_id()
    if not fr_id:
        return None
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(fr_id)
        client.update_flow_run(fr_id, tags=sorted({*current.tags, run_tag(run_id)}))
    return str(fr_id)
