"""Process environment for a run: state folders, telemetry off, quiet logs, torch threads.

Must run before Prefect or MLflow is imported: both read their settings at import time.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

OFFLINE_ENV = {
    # nothing leaves the machine
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # quiet consoles: rlake prints its own progress
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # MLflow configures its own loggers at import (INFO: "Creating initial MLflow database
    # tables..." landed in the live display); the embedded Prefect server's task-run recorder
    # logs a CancelledError traceback at ERROR when the server stops after the run. Set either
    # back (e.g. PREFECT_SERVER_LOGGING_LEVEL=WARNING) to see them.
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    # measured here: the embedded server needs time to start on a loaded 2-core machine, and
    # batching its writers keeps a flow run per iteration cheap (docs/design.md)
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "500",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000",
    # no automations engine (rlake defines none) and no event store (flow and task runs are still
    # recorded): the event persister's flushes are the writes a flow run's state changes collide
    # with (SQLite busy -> 503 -> the client retries after 2 s). bench/prefect_cost.py, under
    # load: median 1.53 s vs 2.37 s per flow run, max 4.2 s vs 10.5 s
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
    # the server does not check CSRF tokens (its own setting is off by default), yet each new
    # client fetched one before its first write: a round trip on every subflow call
    "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
}


def set_offline_defaults() -> None:
    """``OFFLINE_ENV`` into the environment where the user has not set a key; says so when
    Prefect was imported first (it read its settings then, and keeps its defaults)."""
    unseen = [k for k in OFFLINE_ENV if k.startswith("PREFECT_") and k not in os.environ]
    if unseen and "prefect.settings" in sys.modules:
        # bench/stalls.py did this until 2026-11-27: its runs logged at INFO, fetched CSRF tokens
        logging.getLogger(__name__).warning(
            "Prefect was imported before rlake's environment was set: it keeps its defaults "
            "for %s", ", ".join(unseen))
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def set_environment(home: str | Path, torch_threads: int = 1) -> Path:
    """The environment part of ``configure_environment``: imports nothing heavy, so it can run
    before anything slow (Prefect's server is spawned with this environment)."""
    home = Path(home).resolve()
    if home.exists() and not home.is_dir():
        raise NotADirectoryError(f"home '{home}' is a file, not a folder")
    home.mkdir(parents=True, exist_ok=True)
    set_offline_defaults()
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return home


def configure_environment(home: str | Path, torch_threads: int = 1) -> Path:
    """Point Prefect's state at ``{home}/prefect``, turn telemetry off, pin torch threads.

    Values the user already set in the environment win (so a cluster profile can point
    PREFECT_API_URL at a server)."""
    home = set_environment(home, torch_threads)
    import torch

    torch.set_num_threads(torch_threads)
    # the environment above quiets transformers when it is imported later (a run may never
    # import it: infra.qwen2, infra.tokenizer); one imported already is told directly
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    return home


_HEAP_FROZEN = False  # freeze_startup_heap ran in this process


def freeze_startup_heap(collect: bool = True) -> None:
    """Exempt what a long-lived process made while starting (modules, Prefect's and MLflow's
    machinery: ~350k objects in Prefect's server; the engine's model) from the garbage
    collector's full collections, which otherwise walk all of it again every few hundred
    requests or iterations: ~10% of the embedded server's CPU in async mode (2026-11-27,
    docs/operations.md).

    ``collect`` first where garbage may hold something large: a cycle frozen is never freed
    (a model's tensors, on a GPU, among it). A process that holds no model (the server, the
    tracker) freezes at once: its start-up garbage is a few import-time objects. (The run's
    own process does not freeze: collecting first cost it 0.4 s of start-up, about what the
    freeze saves it over 100 iterations.) Once per process. Objects made later are collected
    as before, and a frozen object whose last reference goes is still freed.

    Cheap to call again: a flag, not ``gc.get_freeze_count()``, which counts the frozen objects
    one by one (CPython 3.11): called after every batch, it took ~20% of async mode's rollout
    process (2026-11-28)."""
    global _HEAP_FROZEN
    if _HEAP_FROZEN:
        return
    import gc

    _HEAP_FROZEN = True
    if gc.get_freeze_count() == 0:  # once: another freeze (a second start-up) is left alone
        if collect:
            gc.collect()
        gc.freeze()
