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
- Two processes must not drive one run: ``claim_run`` writes ``owner.pid`` in the run folder and
  refuses when a live process already holds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


def run_owner(run_dir: Path) -> int | None:
    """The PID of another live (Python) process that owns the run folder, or None."""
    lock = run_dir / "owner.pid"
    text = lock.read_text().strip() if lock.exists() else ""
    if text.isdigit() and int(text) != os.getpid() and pid_alive(int(text)) \
            and "python" in _cmdline(int(text)):
        return int(text)
    return None


def claim_run(run_dir: Path) -> None:
    """Record this process as the run's owner; a ValueError if a live process already owns it."""
    lock = run_dir / "owner.pid"
    owner = run_owner(run_dir)
    if owner is not None:
        raise ValueError(f"run folder {run_dir} is in use by process {owner} "
                         "(stop it first, or wait for it to finish)")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = lock.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(lock)


def release_run(run_dir: Path) -> None:
    lock = run_dir / "owner.pid"
    if lock.exists() and lock.read_text().strip() == str(os.getpid()):
        lock.unlink(missing_ok=True)


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
