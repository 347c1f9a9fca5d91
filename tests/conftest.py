"""Test session setup: offline, quiet, 1 torch thread; helpers to run the CLI as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.env import OFFLINE_ENV

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 1500,
            check: bool = True) -> subprocess.CompletedProcess:
    """``python -m infra.cli ARGS`` in a subprocess (its own Prefect and MLflow state)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlake {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# Test files that start Ray share one xdist worker: two local Ray clusters at once on 2 cores
# only slow each other down, and each would see the other's processes.
RAY_FILES = frozenset({"test_ray.py", "test_megatron_ray.py", "test_ray_fixes.py"})
# The SGLang server files share one worker too: two server sets up at once on 2 cores only slow
# each other down.
SGLANG_FILES = frozenset({"test_sglang_server.py", "test_sglang_quickstart.py"})
# The slowest files first (from `--durations`), so both workers are busy until near the end
# instead of one running a 5-minute file alone after the other has finished. test_quickstart.py
# leads: its module fixture builds the shared SFT warm-up (``warm_model``, ~3 min under load) at
# once, while the other worker runs test_resume_faults.py, which needs none; the other learning
# tests then find it built instead of waiting on its lock.
SLOW_FIRST = ("test_quickstart.py", "test_resume_faults.py", "test_async.py",
              "test_sglang_quickstart.py", "test_ray.py", "test_checkpoints.py")


def _file_name(item: pytest.Item) -> str:
    return item.path.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow files first (stable: each file's tests stay together and in order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(_file_name(item), len(rank)))


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file, the Ray files one unit, the SGLang files one."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return "ray" if name in RAY_FILES else "sglang" if name in SGLANG_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadgroup``: one work unit per file (a module's fixtures, a model or a
    server, start once, and its tests run in file order), with the groups of ``work_unit``.
    Done here rather than with ``xdist_group`` markers: xdist 3.8 marks a grouped test by
    setting ``item._nodeid``, which pytest 9 no longer reads, so the markers had no effect and
    every test was its own unit (a module's tests and fixtures spread over both workers)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tests marked ``sglang`` need the SGLang environment: without it they fail (they are core
    tests, never skipped) with the command that builds it, before any fixture starts a server."""
    if item.get_closest_marker("sglang") is None:
        return
    from rollout.sglang.server import sglang_python

    try:
        sglang_python()
        return
    except FileNotFoundError as err:
        missing = str(err)
    pytest.fail(f"{missing} -- the SGLang tests need it: run `make setup-sglang` first", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def rlake_cache_dir(tmp_path_factory) -> Path:
    """rlake's cache (the Prefect database template, infra/prefect_db.py) in this test session's
    temporary folder, never the user's: shared by the xdist workers of one session (the parent
    of a worker's base folder is the session's; the template is written under a file lock)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "rlake-cache"
    os.environ["RLAKE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def cli():
    return run_cli


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """The quickstart's SFT warm-up alone (``num_rollout=0``), run once per test session through
    the CLI: its weight version 0 is the starting point of the learning tests. Under xdist the
    first worker to ask runs it and the others wait on a file lock, then reuse it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder above every worker's own
    home = shared / "warmup-home"
    checkpoint = home / "runs" / "warmup" / "checkpoints" / "v000000"
    with FileLock(str(shared / "warmup.lock")):
        if not (checkpoint / "config.json").exists():
            proc = run_cli(["run", "configs/quickstart.yaml", "--run-id", "warmup",
                            "--set", f"home={home}", "--set", "num_rollout=0"],
                           env={"PREFECT_HOME": str(home / "prefect")})
            assert (checkpoint / "config.json").exists(), proc.stdout[-2000:]
    return {"home": home, "run_id": "warmup", "checkpoint": checkpoint}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 1-layer, hidden-32 Qwen2 + char tokenizer (random init): (path, tokenizer)."""
    from infra.config import TinyModelConfig
    from infra.modeling import build_tiny_model, load_tokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64), seed=0)
    return path, load_tokenizer(path)
