"""CPU time of a run's processes (Linux /proc), for the benches' per-iteration figures.

A run is several processes: the training process (the bench itself), Prefect's embedded
server, the MLflow tracker helper and, in async mode, the rollout process. On a 2-core host
what they use together is what bounds an async iteration (docs/operations.md, Async mode), so
the benches print each one's CPU per iteration, not only the training process's wall.

    before = process_tree_cpu()       # {role: CPU seconds so far}
    ... n iterations ...
    per_iteration_ms(before, process_tree_cpu(), n)
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.affinity import child_pids
from infra.recovery import stat_fields

# a child's role from its command line (the first match wins); others are "other"
ROLES = (("uvicorn", "prefect_server"), ("tracker_process", "mlflow_tracker"),
         ("spawn_main", "rollout_process"))


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of process ``pid`` (all its threads), or None when it is gone."""
    fields = stat_fields(pid)
    if len(fields) < 13:  # gone
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "resource_tracker" in command:  # multiprocessing's helper: idle, and not the run's
        return "other"
    return next((role for needle, role in ROLES if needle in command), "other")


def process_tree_cpu(pid: int | None = None) -> dict[str, float]:
    """{role: CPU seconds} of process ``pid`` (default: this one, "training_process") and its
    children by role. Empty where /proc is missing."""
    pid = os.getpid() if pid is None else pid
    own = _cpu_seconds(pid)
    if own is None:
        return {}
    out = {"training_process": own}
    for child in child_pids(pid):
        seconds = _cpu_seconds(child)
        if seconds is not None:
            role = _role(child)
            out[role] = out.get(role, 0.0) + seconds
    return out


def per_iteration_ms(before: dict[str, float], after: dict[str, float], iterations: int
                     ) -> dict[str, float]:
    """Milliseconds of CPU per iteration, per role present at both snapshots, and their total
    (and of ``wall``, where both snapshots carry a clock reading under that key)."""
    if iterations <= 0:
        return {}
    out = {role: 1000 * (after[role] - before[role]) / iterations
           for role in after if role in before and role not in ("other", "wall")}
    out["total"] = sum(out.values())
    if "wall" in before and "wall" in after:  # snapshots stamped with a clock: its mean too
        out["wall"] = 1000 * (after["wall"] - before["wall"]) / iterations
    return out
