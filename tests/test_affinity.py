"""infra/affinity.py: a run's core split (async mode; sync on CPU), on this machine's real scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from infra.affinity import child_pids, claimed_cores, split_cores, training_cores
from infra.recovery import _cmdline


def test_the_training_process_takes_the_first_cores_and_leaves_at_least_one():
    assert split_cores([1, 0], 1) == ({0}, {1})
    assert split_cores(range(8), 2) == ({0, 1}, set(range(2, 8)))
    assert split_cores([3, 5, 7], 1) == ({3}, {5, 7})
    assert split_cores([0], 1) is None  # nothing left for the rollout side: no pinning
    assert split_cores([0, 1], 2) is None


def test_a_second_run_takes_a_free_core_and_keeps_its_children_off_the_taken_ones():
    assert split_cores([0, 1], 1, taken={0}) == ({1}, {0})  # nothing else left: shared
    assert split_cores(range(4), 1, taken={0}) == ({1}, {2, 3})
    assert split_cores(range(4), 2, taken={1}) == ({0, 2}, {3})
    assert split_cores([0, 1], 1, taken={0, 1}) is None  # no free core: no pinning


def _cores(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_training_cores_pins_this_process_and_its_children_apart_then_puts_them_back():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine_before, child_before = _cores(0), _cores(child.pid)
        assert child.pid in child_pids(os.getpid())
        started: dict[str, set[int]] = {}
        with training_cores(1) as split:
            mine, rest = split
            assert _cores(0) == mine and _cores(child.pid) == rest
            assert not (mine & rest) and mine | rest == mine_before
            # a thread started meanwhile inherits the training cores ...
            ready, leave = threading.Event(), threading.Event()

            def worker() -> None:
                started["tid"] = threading.get_native_id()
                ready.set()
                leave.wait(30)
            thread = threading.Thread(target=worker)
            thread.start()
            ready.wait(30)
            assert _cores(started["tid"]) == mine
        # ... and is put back with every other thread
        assert _cores(0) == mine_before and _cores(child.pid) == child_before
        assert _cores(started["tid"]) == mine_before
        leave.set()
        thread.join()
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_a_child_started_while_pinned_goes_on_the_helpers_cores_and_later_ones_where_it_was():
    """A child started from the launcher (reward workers, Megatron's ranks) while the process
    is pinned starts on the helpers' cores, not the training ones its starter had; once
    unpinned, a child starts where the process is again."""
    from infra.spawned import in_launcher, launch_lasting

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    children = []
    try:
        before = _cores(0)
        with training_cores(1) as (mine, rest):
            children.append(launch_lasting(sleeper))
            children.append(in_launcher(lambda: subprocess.Popen(sleeper)))
            assert [_cores(c.pid) for c in children] == [rest, rest] and _cores(0) == mine
        assert _cores(children[0].pid) == rest  # it stays one of the helpers
        children.append(launch_lasting(sleeper))
        assert _cores(children[-1].pid) == before == _cores(0)
    finally:
        for child in children:
            child.kill()
            child.wait()


PYTHON_API_RUN = """
import json, sys
import torch

torch.set_num_threads(2)  # the caller's own count (torch's default on two cores)
from flows.rl import rl_run, set_reporter
from infra.config import load_config

cfg = load_config("configs/quickstart.yaml", [f"home={sys.argv[1]}", "num_rollout=2",
                  "mode=async", "trainer.max_staleness=1", *sys.argv[2:]])
threads = []
set_reporter(lambda event, payload: threads.append(torch.get_num_threads())
             if event == "iteration" else None)
rl_run(cfg.model_dump(), run_id="python-api")
from prefect.settings import get_current_settings
print(json.dumps([threads, get_current_settings().server.ephemeral.startup_timeout_seconds]))
"""


def test_a_run_started_from_python_trains_with_the_runs_torch_threads(tmp_path):
    """``rl_run`` called from Python (or a deployment's worker), not through the CLI that sets
    torch's threads: the run still uses ``torch_threads``, not the caller's count. Async mode
    pins the training process to ``torch_threads`` cores; two threads on one core ran 30x slower.
    Prefect's own temporary server serves it, with rlake's settings (its 300 s start-up limit,
    not Prefect's 20 s, which a loaded CI machine overran: they were set after Prefect's import)."""
    from tests.conftest import REPO
    from tests.opshelp import TINY, cli_env

    overrides = [TINY[i + 1] for i in range(0, len(TINY), 2)]
    home = tmp_path / "home"
    (home / "prefect").mkdir(parents=True)
    env = cli_env(None, PYTHONPATH=str(REPO), PREFECT_HOME=str(home / "prefect"))
    env.pop("OMP_NUM_THREADS")
    proc = subprocess.run([sys.executable, "-c", PYTHON_API_RUN, str(home), *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[1, 1], 300]


HOLD_CORE = """
import sys
from infra.affinity import claimed_cores
with claimed_cores([0, 1, 2], 1) as split:
    print(sorted(split[0]), flush=True)
    sys.stdin.read()  # held until the test closes stdin
"""


def test_claimed_cores_are_held_until_released_or_the_process_ends(tmp_path, monkeypatch):
    """Cores as two runs on one machine see them (lock files in a folder of the test's own, not
    this machine's real cores)."""
    from infra.affinity import LOCK_DIR_ENV
    from tests.conftest import REPO

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", HOLD_CORE], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert json.loads(other.stdout.readline()) == [0]
        with claimed_cores([0, 1, 2], 1) as split:
            assert split == ({1}, {2})
            with claimed_cores([0, 1, 2], 1) as third:  # a third run: core 2, children shared
                assert third == ({2}, {0, 1})
        other.kill()  # a run that dies lets its core go
        other.wait(timeout=30)
        with claimed_cores([0, 1, 2], 1) as split:
            assert split == ({0}, {1, 2})
    finally:
        other.kill()
        other.wait(timeout=30)


def test_which_runs_pin_their_processes():
    """Sync mode pins only where every child process is a helper (torch engine and trainer on
    cpu); async mode unless Megatron trains in ranks; nothing with Ray or ``pin_cores: false``."""
    from flows.rl import pins_cores
    from infra.config import config_from_dict

    def pins(device: str = "cpu", **config) -> bool:
        return pins_cores(config_from_dict(config), device)

    assert pins() and pins(mode="async", trainer={"max_staleness": 1})
    assert pins(device="cuda", mode="async", trainer={"max_staleness": 1})  # as before: async pins
    assert not pins(device="cuda")  # a pinned sync run on a GPU is untested
    assert not pins(rollout={"engine": "sglang"})  # its servers generate: children of their own
    assert not pins(trainer={"backend": "megatron"})
    # its reward workers start during the run, on the helpers' cores (in_launcher)
    assert pins(rollout={"custom_rm_path": "tests.opshelp:length_reward"})
    # Megatron's ranks train: children of its own
    assert not pins(mode="async", trainer={"max_staleness": 1, "backend": "megatron",
                                           "tensor_model_parallel_size": 2})
    assert pins(mode="async", trainer={"max_staleness": 1, "backend": "megatron"})
    assert pins(mode="async", trainer={"max_staleness": 1},  # started by the rollout process
                rollout={"custom_rm_path": "tests.opshelp:length_reward"})
    assert not pins(cluster={"ray_address": "local"})
    assert not pins(pin_cores=False)
    assert not pins(mode="async", trainer={"max_staleness": 1}, pin_cores=False)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_a_sync_run_keeps_a_core_of_its_own_and_its_helpers_share_the_others(tmp_path):
    """``rlake run`` in sync mode on CPU: while it trains, its process is on one core and its
    children (its embedded Prefect server, the MLflow tracker, and the custom reward function's
    workers, started during the run) on the others; unpinned they took turns on its core and
    the train step ran ~20 ms slower (docs/async-log.md, 2026-12-01)."""
    from buffer import Lake
    from tests.opshelp import TINY, cli_env, rlake, tail

    home, log = tmp_path / "home", tmp_path / "run.log"
    # a lock folder of its own: another test's run holding a core must not change this one's split
    env = cli_env(None, RLAKE_CORE_LOCK_DIR=str(tmp_path / "locks"))
    proc = rlake(["run", "--set", f"home={home}", "--set", "run_id=pinned", "--set", "num_rollout=40",
                  "--set", "eval.eval_interval=100", "--set",
                  "rollout.custom_rm_path=tests.opshelp:length_reward", *TINY], env, log,
                 background=True)
    try:
        end, steps = time.monotonic() + 600, 0  # a hang guard: until a step is committed
        while time.monotonic() < end and proc.poll() is None and not steps:
            time.sleep(0.2)
            try:
                steps = len(Lake(str(home / "lake")).read("train_steps", run_id="pinned"))
            except Exception:  # noqa: BLE001 - the table does not exist yet
                continue
        mine, children = _cores(proc.pid), {pid: _cores(pid) for pid in child_pids(proc.pid)}
        assert steps and proc.poll() is None, tail(log)
        workers = [pid for pid in children if "rewards.workers" in _cmdline(pid)]
        assert len(mine) == 1 and len(children) >= 3 and workers, (mine, children)
        assert all(cores and not cores & mine for cores in children.values()), (mine, children)
        assert proc.wait(timeout=600) == 0, tail(log)
    finally:
        proc.kill()
        proc.wait()
