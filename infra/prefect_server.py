"""A Prefect API server for the state folder: started once, found again by its pid file.

    url = ensure_server(home)         # start `prefect server start` on 127.0.0.1 (or reuse it)
    stop_server(home)                 # end it by PID

The server's database lives in ``{home}/prefect`` (``PREFECT_HOME``); ``{home}/prefect/server.json``
records its PID, URL and starter (the process that started it) so ``rlake serve``, ``rlake
deploy`` and a test can share one. It dies with its starter (``PR_SET_PDEATHSIG``: a kill -9 of
``rlake serve`` left it running forever, adopted by every later serve and never stopped: review,
2026-11-29). One ``rlake serve`` per home: ``lock_serve``. Unlike the
embedded server, this one runs the scheduler (deployments with schedules need it). While it runs,
``rlake run`` / ``resume`` on the same home use it instead of starting an embedded server
(``EmbeddedServer.start``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from infra import prefect_db
from infra.ports import PORT_TRIES, free_port, port_in_use, ready_or_moved
from infra.recovery import EMBEDDED_APP, pid_alive, stop_processes

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


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """GET {url}/health answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:  # noqa: S310 - 127.0.0.1
            return resp.status == 200
    except OSError:
        return False


def recorded_server(home: str | Path) -> dict | None:
    """{"pid", "url", "starter"} that ``ensure_server`` recorded for this state folder, or None
    (no "starter" in a record written before 2026-11-29)."""
    path = prefect_home(home) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def server_info(home: str | Path) -> dict | None:
    """{"pid", "url", "starter"} of this state folder's live server, or None."""
    info = recorded_server(home)
    return info if info and pid_alive(int(info["pid"])) and healthy(info["url"]) else None


def starter_gone(info: dict) -> bool:
    """Whether the process that started a live server (``server_info``) has ended: nothing
    will stop that server (one started before 2026-11-29, or where ``PR_SET_PDEATHSIG`` is not
    available), so the next ``rlake serve`` takes it over and stops it when it stops."""
    starter = info.get("starter")
    return not isinstance(starter, int) or not pid_alive(starter)


SERVE_LOCK = ".serve.lock"


def lock_serve(home: str | Path):
    """An exclusive lock on ``{home}/deployments/.serve.lock`` (the open file: closing it, or
    the process's death, kill -9 included, releases it) for ``rlake serve``'s life; a
    ValueError naming the holder when another serve holds it. A second serve on one home
    shared the first one's server and, when stopped, paused every deployment (Prefect's Runner
    pauses its deployments on stop): the first one then fired nothing (review, 2026-11-29)."""
    import fcntl

    folder = Path(home).resolve() / "deployments"
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / SERVE_LOCK, "a+")  # noqa: SIM115 - held for serve's life; O_CLOEXEC
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise ValueError(f"another `rlake serve` (process {holder or '?'}) serves the home "
                         f"{Path(home).resolve()}: one serve per home (stop that one first)") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def wait_until_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float,
                       poll_s: float) -> None:
    """Poll ``url`` until Prefect's server answers; a RuntimeError naming ``log`` when ``proc``
    exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url, timeout_s=1.0):
        if proc.poll() is not None:
            raise RuntimeError(f"Prefect's server exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"Prefect's server did not answer within {timeout_s:.0f} s; see {log}")
        time.sleep(poll_s)


def ensure_server(home: str | Path, port: int | None = None, startup_timeout_s: float = 180.0) -> str:
    """The URL of this state folder's server, starting ``prefect server start`` if none runs.

    Bound to 127.0.0.1; its log goes to ``{home}/prefect/server.log``. A server started here
    gets SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``; call this from the
    thread that lives as long as the server should, the main one), and SIGTERM ends it.
    """
    info = server_info(home)
    if info:
        return info["url"]
    phome = prefect_home(home)
    phome.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SERVER_ENV, "PREFECT_HOME": str(phome)}
    env.pop("PREFECT_API_URL", None)
    prefect_bin = Path(sys.executable).with_name("prefect")

    def launch(chosen: int) -> subprocess.Popen:
        cmd = [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(chosen)]
        with open(phome / "server.log", "ab") as log:
            # its own session (a terminal's Ctrl-C reaches serve alone, which stops it in
            # order); it dies with this process (kill -9 included)
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent)  # noqa: PLW1509

    def wait(proc: subprocess.Popen, chosen: int) -> None:
        wait_until_healthy(api_url(chosen), proc, phome / "server.log", startup_timeout_s, poll_s=0.5)

    first = port or free_port()
    # a port the user gave is never moved
    proc, chosen = ready_or_moved(launch(first), first, launch, wait, taken=exited_on_taken_port,
                                  stop=lambda proc: _stop_group(proc.pid),
                                  tries=1 if port else PORT_TRIES, name="Prefect's server")
    (phome / STATE_FILE).write_text(json.dumps({"pid": proc.pid, "url": api_url(chosen),
                                                "starter": os.getpid()}))
    return api_url(chosen)


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/api"


def exited_on_taken_port(proc: subprocess.Popen, port: int) -> bool:
    """Whether a Prefect server exited while another socket holds its port: the port was taken
    between its pick and the server's bind (the logs say so in two wordings, uvicorn's and
    ``prefect server start``'s own check; the port itself is what both servers share)."""
    return proc.poll() is not None and port_in_use(port)


def stop_server(home: str | Path) -> int | None:
    """Stop the state folder's server (by the PID in its state file); returns the PID or None."""
    info = recorded_server(home)
    if info is None:
        return None
    pid = int(info["pid"])
    _stop_group(pid)
    (prefect_home(home) / STATE_FILE).unlink(missing_ok=True)
    return pid


def _stop_group(pid: int) -> None:
    """End a server started in its own session: the whole group (uvicorn and what it started)."""
    if pid_alive(pid):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        stop_processes([pid], grace_s=10.0)


class EmbeddedServer:
    """Prefect's embedded API server for one rlake process, started before the slow part of
    startup (model, data, MLflow store) so the two overlap, instead of on the first flow call.

    The same server Prefect would start itself (uvicorn on ``create_app`` with Prefect's
    ephemeral settings), with five differences: its app (``infra.prefect_app``) closes an
    unclosed SQLite cursor on its connection's own thread and waits 5 s for a lock, not 60
    (together: no ~60 s deadlock of its event loop); it starts early; a fresh home gets a ready
    database from the cache (``infra.prefect_db``: no migrations, no block registration); it
    dies with this process
    (``PR_SET_PDEATHSIG``: a kill -9 of the run leaves no server behind; ``infra.recovery``
    still stops any that survive); and two processes on one fresh home do not create its
    database at once (a file lock is held from spawn until it answers).
    """

    def __init__(self, home: str | Path) -> None:
        self.phome = prefect_home(home)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._lock = None
        self.from_template = False  # its database was copied from the cache (infra/prefect_db.py)
        self._builds_database = False  # it creates its database itself: keep a template after

    @classmethod
    def start(cls, home: str | Path) -> EmbeddedServer | None:
        """Spawn the server and point ``PREFECT_API_URL`` at it; None when the environment
        already names a server (a cluster profile, a test's shared server) or the home's own
        server runs (``rlake serve``'s, found by ``server_info``): the run uses that one, so
        one server writes the home's database, and the run skips a server's start (~3 s of
        its startup here, docs/operations.md)."""
        if os.environ.get("PREFECT_API_URL"):
            return None
        running = server_info(home)
        if running:
            os.environ["PREFECT_API_URL"] = running["url"]
            return None
        server = cls(home)
        server.phome.mkdir(parents=True, exist_ok=True)
        if server._try_lock(blocking=False):
            server._spawn()
        else:  # another process is creating this home's server database: spawn once it answers
            server.url = api_url(free_port())
        os.environ["PREFECT_API_URL"] = server.url
        return server

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    def _try_lock(self, blocking: bool) -> bool:
        import fcntl

        self._lock = open(self.phome / ".server-start.lock", "w")  # noqa: SIM115 - held across calls
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            return False
        return True

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def _spawn(self) -> None:
        import importlib.util

        if self.url is None:
            self.url = api_url(free_port())
        port = str(self.port)
        app_dir = Path(importlib.util.find_spec("prefect").submodule_search_locations[0]).parent
        cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
               EMBEDDED_APP, "--host", "127.0.0.1", "--port", port,
               "--log-level", "error", "--lifespan", "on"]
        env = {**os.environ, "PREFECT_HOME": str(self.phome), "PREFECT_UI_ENABLED": "0",
               "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        env.pop("PREFECT_API_URL", None)
        # a fresh home starts from a ready database when the cache has one (seconds saved)
        fresh = not (self.phome / prefect_db.DB_NAME).exists()
        self.from_template = prefect_db.seed_database(self.phome) or self.from_template
        self._builds_database = (fresh and not self.from_template) or self._builds_database
        if self.from_template:
            env.update(prefect_db.FROM_TEMPLATE_ENV)
        with open(self.phome / "embedded-server.log", "ab") as log:
            # its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) stopped
            # the server too, and the run then reported "its Prefect server ended" instead of an
            # interrupt (exit 1, not 130); it still dies with the run (``_die_with_parent``)
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,  # noqa: PLW1509
                                         process_group=0)

    def wait(self, timeout_s: float | None = None) -> str:
        """Block until the server answers (spawning it first if another process held the
        lock); returns its API URL. The limit is Prefect's own setting for its embedded server
        (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``; infra/env.py sets 300 s)."""
        if timeout_s is None:
            timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))
        if self.proc is None:
            self._try_lock(blocking=True)
            self._spawn()
        log = self.phome / "embedded-server.log"

        def respawn(port: int) -> subprocess.Popen:
            # nothing has called the API yet: the run's clients read the new URL
            self.url = api_url(port)
            os.environ["PREFECT_API_URL"] = self.url
            self._spawn()
            return self.proc

        def wait(proc: subprocess.Popen, port: int) -> None:
            wait_until_healthy(api_url(port), proc, log, timeout_s, poll_s=0.1)

        try:
            ready_or_moved(self.proc, self.port, respawn, wait, taken=exited_on_taken_port,
                           stop=_stop_process, name="Prefect's embedded server")
            if self._builds_database:  # once per machine and Prefect version
                prefect_db.save_template(self.phome)
        finally:
            self._release()
        return self.url

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 5 s)."""
        self._release()
        if self.proc is not None:
            _stop_process(self.proc)
        self.proc = None


def _stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc``, SIGKILL after ``grace_s``; reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerWatch:
    """Calls ``on_lost`` once when ``alive()`` turns false, checking every ``interval_s`` on a
    daemon thread; ``stop()`` ends the watch (a run's own ending stops its server after it)."""

    def __init__(self, alive: Callable[[], bool], on_lost: Callable[[], None],
                 interval_s: float = 0.5) -> None:
        self.alive, self.on_lost, self.interval_s = alive, on_lost, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlake-server-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval_s):
            if not self.alive():
                if not self._stopped.is_set():
                    self.on_lost()
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def run_server_liveness(server: EmbeddedServer | None, home: str | Path
                        ) -> tuple[Callable[[], bool], str] | None:
    """(is it alive, what it is) for the Prefect server a run uses: its own embedded server, or
    the home's ``rlake serve`` server when the run found that one (``EmbeddedServer.start``);
    None for a server named by ``PREFECT_API_URL`` from outside (not this machine's to judge:
    Prefect's client retries its calls there, ~60 s each). The home's server answered when the
    run chose it: its record is enough here."""
    if server is not None and server.proc is not None:
        proc = server.proc
        return (lambda: proc.poll() is None), f"its Prefect server (pid {proc.pid}, {server.url})"
    info = recorded_server(home)
    if info is None or info["url"] != os.environ.get("PREFECT_API_URL"):
        return None
    pid = int(info["pid"])
    return (lambda: pid_alive(pid)), f"the home's Prefect server (pid {pid}, {info['url']})"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
