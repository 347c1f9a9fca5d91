"""infra/spawned.py: async mode's rollout process is spawned when the runtime opens, imports
while the run starts, and leaves with the runtime (or with an open that failed)."""

from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from flows.durability import close_runtime
from infra.affinity import child_pids
from infra.config import load_config
from infra.runtime import open_runtime
from tests.conftest import REPO
from tests.opshelp import TINY

OVERRIDES = [TINY[i + 1] for i in range(0, len(TINY), 2)]


def _config(home: Path, *extra: str):
    return load_config(REPO / "configs" / "quickstart.yaml", [f"home={home}", *OVERRIDES, *extra])


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _wait(condition, deadline_s: float = 120.0) -> bool:
    """A hang guard, not a timing check."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


def test_an_async_runtime_spawns_its_rollout_process_which_imports_before_it_runs(tmp_path):
    rt = open_runtime(_config(tmp_path / "home", "mode=async", "trainer.max_staleness=1"), "early")
    try:
        proc = rt.spawned.proc
        assert proc.is_alive() and proc.pid in child_pids(os.getpid())
        # torch is loaded while the run is still starting: told nothing yet, it reports nothing
        assert _wait(lambda: _maps_torch(proc.pid)), "the spawned process never imported torch"
        assert proc.is_alive() and rt.spawned.outbox.empty()
    finally:
        close_runtime(rt)
    assert not proc.is_alive() and rt.spawned is None


def test_a_sync_runtime_spawns_none_and_a_failed_open_leaves_no_process(tmp_path):
    rt = open_runtime(_config(tmp_path / "sync"), "sync")
    try:
        assert rt.spawned is None
    finally:
        close_runtime(rt)
    # multiprocessing's resource tracker, started by a process's first spawn and alive as long
    # as it, is no child left behind: started before the count (it was not, when this test came
    # first in its pytest worker)
    resource_tracker.ensure_running()
    before = set(child_pids(os.getpid()))
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(FileNotFoundError, match="not an HF model folder"):
        open_runtime(_config(tmp_path / "bad", "mode=async", "trainer.max_staleness=1",
                             f"model.path={not_a_model}"), "bad")
    # the rollout process and the MLflow helper were stopped (and waited for) on the way out
    assert set(child_pids(os.getpid())) <= before
