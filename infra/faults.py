"""Fault injection: make the process kill itself (SIGKILL, like ``kill -9``) at a named point.

    RLAKE_FAULT=after_lake_append:3      # die right after iteration 3's trajectories are committed
    RLAKE_FAULT=during_train:2,after_checkpoint_save:5   # several points (the first one hit wins)
    RLAKE_FAULT=after_run_recorded       # no iteration: the first time the point is reached

Points are named in ``POINTS`` and placed in the pipeline with ``fault_point(name)``; the
iteration is the one set by ``set_iteration`` (the flow sets it at the start of each iteration).
Nothing happens when the variable is unset, so the cost in a normal run is one dict lookup.

A point inside the background checkpoint writer (trainers/checkpoint.py) would otherwise die at
a moment that races the main thread; there the writer *holds* (``fault_point(name, iteration,
hold=True)`` blocks once the point is reached) and the main thread kills the process at a fixed
place of its own (``fault_join(name)``), so a test knows exactly what was committed and what was
half-written.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "RLAKE_FAULT"
# before the first iteration (``rlake run``/``resume``, infra/startup.py): no iteration needed
STARTUP_POINTS: dict[str, str] = {
    "after_run_recorded": "the runs row is written (status running), nothing else",
    "before_first_flow": "model, data, MLflow store and Prefect server are up, no flow ran",
}
POINTS: dict[str, str] = {
    "during_generate": "engine generated the iteration's samples, nothing written yet",
    "during_lake_append": "inside the trajectories' Delta write: part of the rows handed to the "
                          "writer, nothing committed",
    "after_lake_append": "the iteration's trajectories are committed to the lake, not trained on",
    "during_train": "the iteration's trajectories are committed and the trainer updated the "
                    "weights in memory, nothing saved",
    "during_checkpoint_save": "the checkpoint's temporary folder is written, not renamed into place",
    "after_checkpoint_save": "the new checkpoint is saved (or, in the background, being saved), the "
                             "train_steps row (commit point) does not exist",
    "during_weight_handoff": "the checkpoint is saved, the engine is not updated yet",
    "during_background_write": "the train_steps row is committed while the background writer has "
                               "put the weights, not the optimizer state, in the checkpoint's "
                               "temporary folder",
    "during_mlflow_log": "the train_steps row is committed, the MLflow metrics are not logged",
    "during_evaluation": "the evaluation after the iteration committed its samples and evals rows "
                         "to the lake, its MLflow metrics are not logged",
}
# Points whose state includes the iteration's trajectories committed: training overlaps their
# append (flows.steps), so with one of these armed the append is waited for before training
# (a kill there then always leaves rows to reuse; unarmed, nothing waits).
AFTER_APPEND_POINTS = ("during_train", "during_checkpoint_save", "after_checkpoint_save",
                       "during_weight_handoff")
# Points after the train_steps commit: an iteration commits behind (the next iteration
# generates or trains meanwhile, flows.steps), so with one of these armed the iteration commits before it
# ends instead (the kill then comes inside that iteration's flow run, at a known place).
POST_COMMIT_POINTS = ("during_background_write", "during_mlflow_log")
_STATE = {"iteration": -1}
_REACHED: dict[str, threading.Event] = {}
JOIN_TIMEOUT_S = 300.0


def parse_faults(spec: str | None) -> dict[str, int | None]:
    """``"a:3,b"`` -> {"a": 3, "b": None} (None: a startup point, no iteration); an unknown
    point or a bad iteration is a ValueError."""
    out: dict[str, int | None] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, colon, it = item.partition(":")
        if name not in POINTS and name not in STARTUP_POINTS:
            raise ValueError(f"{ENV}: unknown fault point '{name}'; known: "
                             f"{', '.join([*STARTUP_POINTS, *POINTS])}")
        if not colon and name in STARTUP_POINTS:
            out[name] = None
            continue
        if not it.strip().lstrip("-").isdigit():
            raise ValueError(f"{ENV}: '{item}' must look like point:iteration (e.g. during_train:2)")
        out[name] = int(it)
    return out


def parse_member_fault(spec: str | None, index: int, env: str, member: str) -> int | None:
    """``"k:n"`` -> n when k == ``index`` (member k of a group, e.g. an engine or a Megatron
    rank, exits in its n-th call), else None. ``env`` and ``member`` name the variable and what
    k counts in the error for a malformed spec."""
    if not spec:
        return None
    k, _, n = spec.partition(":")
    if not (k.strip().isdigit() and n.strip().isdigit()):
        raise ValueError(f"{env}: '{spec}' must look like {member}:call (e.g. 1:2)")
    return int(n) if int(k) == index else None


def set_iteration(iteration: int) -> None:
    """The iteration the next ``fault_point`` calls belong to."""
    _STATE["iteration"] = iteration


def current_iteration() -> int:
    return _STATE["iteration"]


def fault_armed(name: str, iteration: int | None = None) -> bool:
    """Whether ``RLAKE_FAULT`` names ``name`` at ``iteration`` (default: the current one)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    faults = parse_faults(spec)
    at = _STATE["iteration"] if iteration is None else iteration
    return name in faults and faults[name] in (None, at)  # None: a startup point, any time


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fault_point(name: str, iteration: int | None = None, hold: bool = False) -> None:
    """SIGKILL this process if ``RLAKE_FAULT`` names ``name`` at ``iteration`` (default: the
    current one). With ``hold`` (a background thread), block instead and let the main thread's
    ``fault_join(name)`` kill the process."""
    if not fault_armed(name, iteration):
        return
    if not hold:
        _kill()
    _REACHED.setdefault(name, threading.Event()).set()
    while True:  # the main thread kills the process; nothing after this point may run
        time.sleep(3600)


def fault_join(name: str, iteration: int | None = None) -> None:
    """Waiting side of a held point: if armed at ``iteration`` (default: the current one), wait
    until a background thread holds at ``name``, then SIGKILL the process."""
    if not fault_armed(name, iteration):
        return
    at = _STATE["iteration"] if iteration is None else iteration
    if not _REACHED.setdefault(name, threading.Event()).wait(JOIN_TIMEOUT_S):
        raise RuntimeError(f"{ENV}: fault point '{name}' was never reached by the background "
                           f"writer at iteration {at} (is a save due there?)")
    _kill()
