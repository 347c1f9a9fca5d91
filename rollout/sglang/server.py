"""SGLang server (and sglang-router) subprocesses: launch, readiness, stop by process group.

Each server runs ``python -m sglang.launch_server`` from the SGLang environment
(``.venv-sglang``, built by ``scripts/setup_sglang.sh``) in its own session, so stopping it
kills exactly its process group (scheduler and detokenizer children included) and nothing else.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra import ports
from infra.ports import PORT_TAKEN
from infra.recovery import stat_fields
from infra.spawned import dying_with_this_process, launch_lasting

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Flags that make SGLang 0.5.x serve on CPU (DESIGN.md "What runs where"); GPU runs drop them.
CPU_SERVER_ARGS = ("--device", "cpu", "--dtype", "float32", "--sleep-on-idle", "--skip-server-warmup")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def sglang_python(python: str | None = None) -> str:
    """The interpreter that has sglang: ``python`` if given, else $RLAKE_SGLANG_PYTHON, else
    ``<repo>/.venv-sglang/bin/python``; a clear error if it does not exist."""
    path = python or os.environ.get("RLAKE_SGLANG_PYTHON") or str(REPO_ROOT / ".venv-sglang/bin/python")
    if not Path(path).exists():
        raise FileNotFoundError(
            f"SGLang python {path!r} not found: run `make setup-sglang` (scripts/setup_sglang.sh), "
            "or set rollout.sglang.python"
        )
    return path


@dataclass
class ServerSpec:
    """How to launch one SGLang server."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    python: str | None = None
    weight_version: str = "0"
    # None: no --max-total-tokens, SGLang sizes the KV cache from GPU memory (CUDA)
    max_total_tokens: int | None = 65536
    device: str = "cpu"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None

    def command(self) -> list[str]:
        """The ``sglang.launch_server`` command line."""
        cmd = [
            sglang_python(self.python), "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host, "--port", str(self.port),
            "--weight-version", self.weight_version,
        ]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.device == "cpu":
            cmd += list(CPU_SERVER_ARGS)
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if Path(self.model_path).is_dir():
            env.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never ask the Hub
        if self.device == "cpu":
            env.update(CPU_ENV)
        env.update(self.env)
        return env


SHM = Path("/dev/shm")
# what an SGLang server's processes leave there: its scheduler's load segment, multiprocessing's
# semaphores (SGLang kills its own resource tracker with its children, before it unlinks them)
SHM_PREFIXES = ("sglang_", "sem.mp-")


def shm_files_in_use(pids: Iterable[int] | None = None) -> set[int]:
    """Inodes of the files under /dev/shm that processes ``pids`` (default: every process on
    this machine) map or hold open (Linux /proc), under whatever name they were opened by: a
    named semaphore's creator maps it under glibc's temporary name, unlinked once the file is
    linked to its own (``/dev/shm/sem.XXXXXX (deleted)`` in its maps), so a name is not enough."""
    inodes = set()
    for entry in map(str, pids) if pids is not None else filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:  # address perms offset device inode path
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        inodes.add(int(fields[4]))
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for fd in fds:
            link = f"/proc/{entry}/fd/{fd}"
            try:
                if os.readlink(link).startswith("/dev/shm/"):
                    inodes.add(os.stat(link).st_ino)
            except OSError:  # closed meanwhile
                continue
    return inodes


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are alive, not zombies (Linux /proc): an
    orphan nobody reaps (PID 1 of a container that does not) stays a zombie for good."""
    members = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        fields = stat_fields(pid)  # empty: gone meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(pid)
    return members


def shm_names() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def shm_inode(name: str) -> int | None:
    try:
        return (SHM / name).stat().st_ino
    except OSError:  # removed meanwhile
        return None


def remove_orphaned_shm(names: set[str], owned: set[int]) -> list[str]:
    """Unlink those of ``names`` (under /dev/shm, ``SHM_PREFIXES`` only) that a stopped process
    group left: files it used (inodes ``owned``; any ``sglang_*`` segment too, whose name is
    SGLang's own) that no process maps or holds open now, so nothing can reach them but an open
    by name, which only a holder would make. A ``sem.mp-*`` the group is not known to have
    used stays: another process's semaphore, made for a child that has not opened it yet,
    looks exactly like an orphan. Returns what it removed."""
    candidates = {n: shm_inode(n) for n in names & shm_names() if n.startswith(SHM_PREFIXES)}
    candidates = {n: i for n, i in candidates.items() if i is not None and (i in owned or n.startswith("sglang_"))}
    if not candidates:  # the usual case: no scan of every process
        return []
    in_use = shm_files_in_use()
    removed = []
    for name, inode in sorted(candidates.items()):
        if inode in in_use or shm_inode(name) != inode:  # in use, or replaced meanwhile
            continue
        try:
            (SHM / name).unlink()
            removed.append(name)
        except OSError:  # removed meanwhile, or another user's
            pass
    return removed


class ManagedProcess:
    """A child process in its own session; ``stop`` signals its whole process group.

    Each launch gets its own temporary folder (``TMPDIR``: ``tmp_dir``), removed once its
    process group is stopped: an SGLang server names its ZMQ sockets with
    ``tempfile.NamedTemporaryFile(delete=False)`` (five a launch) and never removes them, so
    every start and restart left files in the machine's /tmp. What its processes left in
    /dev/shm (a shared-memory segment and a semaphore a launch) is removed then too
    (``remove_orphaned_shm``): what its process group was seen to use while it started
    (``record_own_shm``, from ``wait_ready``) or when ``stop`` began."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str | None, name: str):
        self.cmd, self.env, self.log_path, self.name = cmd, env, log_path, name
        self.proc: subprocess.Popen | None = None
        self.tmp_dir: str | None = None
        self._shm_before: set[str] = set()  # /dev/shm when this launch started
        self._own_shm: set[int] = set()  # inodes under /dev/shm its process group was seen to use
        self._log_start = 0  # where this launch's output begins in the (appended) log

    def start(self) -> None:
        # in the system's temporary folder, not under a run's home: a ZMQ socket path must
        # stay within the OS's ~107 characters
        self.tmp_dir = tempfile.mkdtemp(prefix="rlake-proc-")
        self._shm_before, self._own_shm = shm_names(), set()
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._log_start = out.tell() if out is not subprocess.DEVNULL else 0
        try:
            # dying with this process: in a session of its own, a kill -9 of the run left the
            # server (and on a GPU its memory) to the next run; its scheduler and detokenizer
            # die with it (SGLang's own PR_SET_PDEATHSIG)
            self.proc = launch_lasting(
                dying_with_this_process(self.cmd), env={**self.env, "TMPDIR": self.tmp_dir},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to this process's group (its pgid is its pid: it leads its session)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    stop_grace_s = 10.0  # what ``stop`` waits after SIGTERM before SIGKILL

    def record_own_shm(self) -> None:
        """Note what under /dev/shm this launch's process group uses now, for ``stop`` to
        remove once they are gone: a server that dies is not there to ask at its stop."""
        if self.proc is not None:
            self._own_shm |= shm_files_in_use(group_members(self.proc.pid))

    def wait_group_gone(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no live process of this process's group is left
        (``group_members``); False if one still is."""
        deadline = time.monotonic() + timeout_s
        while group_members(self.proc.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the group (SIGCONT too, in case it was stopped), wait up to ``grace_s``
        (``stop_grace_s`` unless given), then SIGKILL it; reap the child. With a grace of 0
        the group is SIGKILLed at once."""
        if self.proc is None:
            return
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        self.record_own_shm()
        if grace_s > 0:
            self.signal_group(signal.SIGTERM)
            self.signal_group(signal.SIGCONT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # the group, or children that outlived the leader
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # until its last process is gone: a dying scheduler still maps its segment (which
        # would then stay) and holds its device memory (which a restart needs)
        self.wait_group_gone(10.0)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None
        # made since this launch started, used by its processes and by none now: what they left
        # (another server's, started meanwhile, is in use and stays)
        remove_orphaned_shm(shm_names() - self._shm_before, self._own_shm)

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines this launch wrote (an earlier launch's stay out)."""
        if not self.log_path or not Path(self.log_path).exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def port_taken(self) -> bool:
        """Whether it exited because another process had bound its port: the port was free
        when picked, and a server binds it only once loaded (SGLang: 20 s and more on a busy
        CPU), a window in which any process on the machine may get it from the OS."""
        return not self.alive() and PORT_TAKEN in self.log_tail(400).lower()


class SGLangServer(ManagedProcess):
    """One SGLang server process launched from a ServerSpec.

    Stopped with SIGKILL at once (``stop_grace_s`` 0): on SIGTERM its scheduler exits and the
    server's main process then sleeps 5 s "before crash diagnostics" (SGLang 0.5.23) before it
    kills its own tree, so every stop and restart took ~5.8 s; killed, 0.14 s (measured
    2026-11-28, CPU). Nothing is lost by it: a server is stopped with no request rlake still
    waits for (a run's end, a restart of a dead or hung server, a failed start), and what its
    SIGTERM path would clean (its /dev/shm segment, its ZMQ sockets) ``stop`` removes itself."""

    stop_grace_s = 0.0

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        super().__init__(spec.command(), spec.environment(), spec.log_path, f"sglang:{spec.port}")

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def relaunch(self, model_path: str, weight_version: str) -> None:
        """Stop, then start again on the same port from ``model_path`` as ``weight_version``."""
        self.stop()
        self.spec.model_path, self.spec.weight_version = model_path, weight_version
        self.cmd = self.spec.command()
        self.start()


def wait_ready(proc: ManagedProcess, url: str, timeout_s: float, endpoint: str = "/health") -> None:
    """Poll ``url+endpoint`` until HTTP 200; raise (with the log tail) if the process exits or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            # what its processes made in /dev/shm, noted as it starts: one that dies before it
            # is ready (its port taken) is not there to ask at its stop
            proc.record_own_shm()
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
            try:
                if client.get(f"{url}{endpoint}", timeout=5).status_code == 200:
                    proc.record_own_shm()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.log_tail()}")


def ready_or_moved(proc: ManagedProcess, port: int, launch: Callable[[int], ManagedProcess],
                   wait: Callable[[ManagedProcess, int], None],
                   tries: int = ports.PORT_TRIES) -> tuple[ManagedProcess, int]:
    """``infra.ports.ready_or_moved`` for a server or router process: its port was taken when
    this launch's log says so (``port_taken``); a new launch is started here; a failed one is
    stopped with its process group."""
    def started(new_port: int) -> ManagedProcess:
        new = launch(new_port)
        new.start()
        return new
    return ports.ready_or_moved(proc, port, started, wait, taken=lambda p, _port: p.port_taken(),
                                stop=lambda p: p.stop(), tries=tries, name=proc.name)


def router_workers(client: httpx.Client, router_url: str) -> list[dict]:
    """The router's ``GET /workers`` listing; empty while it cannot answer."""
    try:
        return client.get(f"{router_url}/workers", timeout=5).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return []


def wait_router_workers(router: ManagedProcess, url: str, n_workers: int, timeout_s: float) -> None:
    """Wait until the router lists ``n_workers`` healthy workers in ``GET /workers`` (it answers
    before its workers are registered, and routes nothing until they are)."""
    wait_ready(router, url, timeout_s, endpoint="/workers")
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if sum(bool(w.get("is_healthy")) for w in router_workers(client, url)) >= n_workers:
                return
            if not router.alive():
                raise RuntimeError(f"{router.name} exited:\n{router.log_tail()}")
            time.sleep(0.5)
    raise TimeoutError(f"{router.name}: {n_workers} healthy workers not registered after {timeout_s:.0f} s")


def move_router_worker(router_url: str, old_url: str, new_url: str, timeout_s: float) -> None:
    """Have the router at ``router_url`` send to ``new_url`` instead of ``old_url`` (a server
    restarted on another port). sglang-router 0.3.x queues both changes as background jobs (HTTP
    202: ``POST /workers {"url"}``, ``DELETE /workers/{id}``), so each is waited for in ``GET
    /workers``: the new worker listed healthy first, so the router is never left with none."""
    deadline = time.monotonic() + timeout_s

    def wait(client: httpx.Client, what: str, done: Callable[[list[dict]], bool]) -> list[dict]:
        while time.monotonic() < deadline:
            workers = router_workers(client, router_url)
            if done(workers):
                return workers
            time.sleep(0.2)
        raise TimeoutError(f"sglang-router {router_url}: {what} not done after {timeout_s:.0f} s")

    with httpx.Client() as client:
        if not any(w.get("url") == new_url for w in router_workers(client, router_url)):
            client.post(f"{router_url}/workers", json={"url": new_url}, timeout=10).raise_for_status()
        workers = wait(client, f"adding {new_url}", lambda ws: any(
            w.get("url") == new_url and w.get("is_healthy") for w in ws))
        for w in workers:
            if w.get("url") == old_url:
                client.delete(f"{router_url}/workers/{w['id']}", timeout=10).raise_for_status()
        wait(client, f"removing {old_url}", lambda ws: not any(w.get("url") == old_url for w in ws))


def router_process(worker_urls: list[str], port: int, python: str | None = None,
                   host: str = "127.0.0.1", log_path: str | None = None) -> ManagedProcess:
    """An sglang-router (round robin) in front of ``worker_urls``; start it with ``.start()``."""
    cmd = [
        sglang_python(python), "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port), "--policy", "round_robin",
        "--worker-urls", *worker_urls,
    ]
    return ManagedProcess(cmd, dict(os.environ), log_path, f"sglang-router:{port}")
