"""A Prefect API server for the state folder: started once, found again by its pid file.

    url = ensure_server(home)         # start `prefect server start` on 127.0.0.1 (or reuse it)
    stop_server(home)                 # end it by PID

The server's database lives in ``{home}/prefect`` (``PREFECT_HOME``); ``{home}/prefect/server.json``
records its PID and URL so ``rlake serve``, ``rlake deploy`` and a test can share one. Unlike the
embedded server, this one runs the scheduler (deployments with schedules need it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from infra.recovery import pid_alive, stop_processes

STATE_FILE = "server.json"
# the scheduler and the late-runs service look every few seconds instead of every minute, so a
# deployment on a short interval gets its first run quickly
SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_LOOP_SECONDS": "5",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
    "DO_NOT_TRACK": "true",
}


def prefect_home(home: str | Path) -> Path:
    return Path(home).resolve() / "prefect"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """GET {url}/health answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:  # noqa: S310 - 127.0.0.1
            return resp.status == 200
    except OSError:
        return False


def server_info(home: str | Path) -> dict | None:
    """{"pid", "url"} of this state folder's live server, or None."""
    path = prefect_home(home) / STATE_FILE
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    return info if pid_alive(int(info["pid"])) and healthy(info["url"]) else None


def ensure_server(home: str | Path, port: int | None = None, startup_timeout_s: float = 180.0) -> str:
    """The URL of this state folder's server, starting ``prefect server start`` if none runs.

    Bound to 127.0.0.1; its log goes to ``{home}/prefect/server.log``.
    """
    info = server_info(home)
    if info:
        return info["url"]
    phome = prefect_home(home)
    phome.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **SERVER_ENV, "PREFECT_HOME": str(phome)}
    env.pop("PREFECT_API_URL", None)
    prefect_bin = Path(sys.executable).with_name("prefect")
    cmd = [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with open(phome / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + startup_timeout_s
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {phome / 'server.log'}")
        if time.monotonic() > deadline:
            stop_processes([proc.pid])
            raise RuntimeError(f"prefect server did not answer within {startup_timeout_s:.0f} s; "
                               f"see {phome / 'server.log'}")
        time.sleep(0.5)
    (phome / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "url": url}))
    return url


def stop_server(home: str | Path) -> int | None:
    """Stop the state folder's server (by the PID in its state file); returns the PID or None."""
    path = prefect_home(home) / STATE_FILE
    if not path.exists():
        return None
    pid = int(json.loads(path.read_text())["pid"])
    if pid_alive(pid):
        try:  # its own session: end the whole group (uvicorn and anything it started)
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        stop_processes([pid], grace_s=10.0)
    path.unlink(missing_ok=True)
    return pid
