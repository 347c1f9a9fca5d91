"""Helpers for the operations tests: run the real CLI in a subprocess on a tiny config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--set", "sft.steps=10", "--set", "sft.batch_size=16", "--set", "rollout.rollout_batch_size=4",
        "--set", "rollout.n_samples_per_prompt=4", "--set", "data.held_out_size=8",
        "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.intermediate_size=64",
        "--set", "model.tiny.num_hidden_layers=1"]


def cli_env(api_url: str | None, **extra: str) -> dict[str, str]:
    """The test process's environment without Prefect/fault settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k != "RLAKE_FAULT"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    env["OMP_NUM_THREADS"] = "1"
    return env


def rlake(args: list[str], env: dict[str, str], log: Path, timeout: float = 900,
          background: bool = False) -> subprocess.CompletedProcess | subprocess.Popen:
    """``python -m infra.cli ARGS`` from the repository root (this checkout's code).

    Output goes to ``log``, not to a pipe: after a kill -9 the dead process's embedded Prefect
    server still holds its stdout, and reading a pipe would wait for that server to exit."""
    cmd = [sys.executable, "-m", "infra.cli", *args]
    with open(log, "w") as out:
        if background:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout)


def tail(log: Path) -> str:
    return Path(log).read_text()[-3000:]


def length_reward(cfg, sample) -> float:
    """A second reward function for --rescore tests (custom_rm_path shape): response length / 10."""
    return len(sample.response) / 10


def paused_deployments(prefect_home: Path) -> dict[str, bool]:
    """Each deployment's ``paused`` flag in the (stopped) Prefect server's database of
    ``prefect_home``. Read there, not from Prefect's log: its runner logs the pause only while
    its start is under way."""
    import sqlite3

    with sqlite3.connect(Path(prefect_home) / "prefect.db") as db:
        return {name: bool(paused) for name, paused in db.execute("select name, paused from deployment")}


def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes whose start-up environment has ``key=value`` (read from /proc)."""
    from infra.recovery import _environ, pid_alive

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if _environ(pid).get(key) == value and pid_alive(pid):
                found.append(pid)
    return sorted(found)


def shared_prefect_server(tmp_path_factory, name: str) -> Iterator[tuple[Path, str]]:
    """Body of a module-scoped fixture: one Prefect server for a test module's CLI runs (its
    start dominates otherwise), stopped after the module: yields (home, api_url)."""
    from infra.prefect_server import ensure_server, stop_server

    home = tmp_path_factory.mktemp(name)
    url = ensure_server(home)
    yield home, url
    stop_server(home)


def read_until(read: Callable[[], object], done: Callable[[object], bool], deadline_s: float = 120):
    """``read()`` again every second until ``done(result)`` or ``deadline_s`` passed; the last
    result. For what Prefect's server records from events (task runs), in batches, seconds
    after they happened (more under load)."""
    end = time.monotonic() + deadline_s
    while True:
        result = read()
        if done(result) or time.monotonic() > end:
            return result
        time.sleep(1)


def listening_socket(port: int = 0, reuse_addr: bool = False) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: a free one), as another process holding the
    port would; ``reuse_addr`` binds past the TIME_WAIT connections of a process that just let
    the port go (never past a listener)."""
    holder = socket.socket()
    if reuse_addr:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind(("127.0.0.1", port))
        holder.listen()
    except OSError:
        holder.close()
        raise
    return holder


def taken_port_fixture() -> Iterator[int]:
    """The body of a ``taken_port`` fixture: a port another process listens on while it lasts."""
    with listening_socket() as holder:
        yield holder.getsockname()[1]
