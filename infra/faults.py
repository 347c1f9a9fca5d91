"""Fault injection: make the process kill itself (SIGKILL, like ``kill -9``) at a named point.

    RLAKE_FAULT=after_lake_append:3      # die right after iteration 3's trajectories are committed
    RLAKE_FAULT=during_train:2,after_checkpoint_save:5   # several points (the first one hit wins)
    RLAKE_FAULT=after_run_recorded       # no iteration: the first time the point is reached

Points are named in ``POINTS`` and placed in the pipeline with ``fault_point(name)``; the
iteration is the one set by ``set_iteration`` (the flow sets it at the start of each iteration).
Nothing happens when the variable is unset, so the cost in a normal run is one dict lookup.
"""

from __future__ import annotations

import os
import signal

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
    "during_train": "the trainer updated the weights in memory, nothing saved",
    "during_checkpoint_save": "the checkpoint's temporary folder is written, not renamed into place",
    "after_checkpoint_save": "the new checkpoint exists, the train_steps row (commit point) does not",
    "during_weight_handoff": "the checkpoint is saved, the engine is not updated yet",
    "during_mlflow_log": "the train_steps row is committed, the MLflow metrics are not logged",
}
_STATE = {"iteration": -1}


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


def set_iteration(iteration: int) -> None:
    """The iteration the next ``fault_point`` calls belong to."""
    _STATE["iteration"] = iteration


def armed(name: str) -> bool:
    """Whether ``fault_point(name)`` would kill the process now (at the current iteration)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    faults = parse_faults(spec)
    return name in faults and faults[name] in (None, _STATE["iteration"])


def fault_point(name: str) -> None:
    """SIGKILL this process if ``RLAKE_FAULT`` names ``name`` at the current iteration."""
    if armed(name):
        os.kill(os.getpid(), signal.SIGKILL)
