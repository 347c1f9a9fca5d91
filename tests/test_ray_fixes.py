"""Ray: never wait forever. A hung engine actor (SIGSTOP) fails a weight hand-off, a version
query and a restarted engine's weights within ``cluster.engine_call_timeout_s``; an engine that
never finishes starting fails the pool within it; a Ray address with nothing listening fails at
once; and a client joins a ``ray start`` head that turned token auth on (a token in
``~/.ray/auth_token``) without ``RAY_AUTH_MODE`` set, or fails with one line saying what to set.

One local Ray (module scope) for the engine tests; the address and auth tests run their Ray
clients (and the ``ray start`` head) in subprocesses, so they never touch it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from infra.cluster import prepare_ray, probe_address
from infra.config import ClusterConfig
from tests.conftest import REPO

prepare_ray()  # before anything imports ray: the guard, and 127.0.0.1 as every Ray address

TIMEOUT_S = 4.0  # cluster.engine_call_timeout_s of the pools here
# Ray environment a client subprocess must not inherit from this process (ray.init of the local
# cluster sets some of them): each client decides from its own HOME, as a user's shell would
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def _bounded(fn, limit_s: float):
    """``fn()`` in a daemon thread: (its result or exception, seconds taken); fails the test
    when it has not returned within ``limit_s`` (a hang, which the fixes rule out)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out["value"] = err

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still waiting after {limit_s:.0f} s: it hangs"
    return out["value"], time.monotonic() - start


def _client_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO)}


CONNECT = """
import sys, time
from infra.cluster import connect
from infra.config import ClusterConfig
start = time.monotonic()
try:
    conn = connect(ClusterConfig(ray_address=sys.argv[1]), "test")
except Exception as err:
    print(f"FAILED {time.monotonic() - start:.1f}s {type(err).__name__}: {err}")
    raise SystemExit(3)
import os, ray
one = ray.get(ray.remote(lambda: 1).remote(), timeout=60)  # a task runs: the cluster took us
print("JOINED", int(ray.cluster_resources().get("CPU", 0)) * one, os.environ.get("RAY_AUTH_MODE"))
conn.release("test")
"""


def _connect_in_subprocess(address: str, home: Path, timeout: float) -> tuple[str, str]:
    """Run ``connect`` for ``address`` in a fresh process: (its last stdout line, stderr tail)."""
    try:
        proc = subprocess.run([sys.executable, "-c", CONNECT, address], cwd=REPO, env=_client_env(home),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"connect({address}) still waiting after {timeout:.0f} s: it hangs")
    lines = proc.stdout.strip().splitlines()
    return (lines[-1] if lines else ""), proc.stderr[-3000:]


def _home(tmp_path: Path, name: str, token: str | None) -> Path:
    home = tmp_path / name
    home.mkdir()
    (home / "ray_bootstrap_config.yaml").write_text("provider:\n  type: local\n")
    if token is not None:
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text(token)
    return home


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- bug 2: an address with nothing listening fails at once (no cluster needed) ---------------

def test_an_address_with_nothing_listening_fails_at_once(tmp_path):
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        address = f"127.0.0.1:{port}"
        line, err = _connect_in_subprocess(address, _home(tmp_path, "h", None), timeout=90)
        assert line.startswith("FAILED "), (line, err)
        assert float(line.split()[1].removesuffix("s")) < 20, line  # not Ray's ~14 minutes
        assert f"ConnectionError: cluster.ray_address={address}: nothing answers" in line
        for form in (f"ray://127.0.0.1:{port}", f"localhost:{port}"):
            with pytest.raises(ConnectionError, match=f"cluster.ray_address={form}: nothing answers"):
                probe_address(form, timeout_s=5)
    with pytest.raises(ValueError, match="cluster.ray_address='10.0.0.1'"):
        probe_address("10.0.0.1")


# --- bug 4: a `ray start` head with token auth on (a token file at hand) ----------------------

@pytest.fixture
def ray_heads(tmp_path):
    """``start(name, auth_mode)``: ``ray start --head --block`` with HOME holding
    ~/.ray/auth_token, as docs/cluster.md has it. With ``auth_mode`` None (RAY_AUTH_MODE unset)
    Ray turns token auth on because the token file exists. Each is stopped by SIGTERM (``--block``
    then stops every process of its own; ``ray stop`` would stop every cluster here)."""
    token = os.urandom(32).hex()
    home = _home(tmp_path, "head", token)
    ray_bin = Path(sys.executable).with_name("ray")
    started: list[tuple[subprocess.Popen, str, object]] = []

    def start(name: str, auth_mode: str | None) -> str:
        port = _free_port()
        temp_dir = tempfile.mkdtemp(prefix="rlk", dir="/tmp")  # short: Ray's socket paths must fit
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed below
        env = _client_env(home) | ({"RAY_AUTH_MODE": auth_mode} if auth_mode else {})
        head = subprocess.Popen(
            [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={temp_dir}"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        started.append((head, temp_dir, log))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert head.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"ray start --head ({name}) did not listen within 120 s")

    try:
        yield start, home
    finally:
        for head, temp_dir, log in started:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(60)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait(10)
            log.close()
            _kill_leftovers(temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_leftovers(temp_dir: str) -> None:
    """SIGKILL, by pid, any process of that head still running (its command line names its
    temp dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def test_a_client_joins_a_token_auth_head_without_setting_ray_auth_mode(ray_heads, tmp_path):
    """Before: ``ray start --head`` turned token auth on (the token file exists), the client
    (RAY_AUTH_MODE unset) did not, and was refused after ~20 s: 'Failed to connect'."""
    start, home = ray_heads
    address = start("token", None)
    assert "Token authentication is enabled" in (tmp_path / "token.log").read_text()
    line, err = _connect_in_subprocess(address, home, timeout=120)
    assert line == "JOINED 1 token", (line, err)  # asked the cluster: token mode, joined
    # no token here: one line saying what to export, not Ray's "Failed to connect"
    line, err = _connect_in_subprocess(address, _home(tmp_path, "bare", None), timeout=120)
    assert line.startswith("FAILED "), (line, err)
    assert f"cluster.ray_address={address}: the cluster wants a Ray auth token" in line
    assert "export RAY_AUTH_MODE=token" in line and "InvalidAuthToken" in line
    # a cluster without token auth: a client with a token file stays out of token mode (joining
    # test_ray.py's ray.cluster_utils.Cluster in token mode, its runs' trainer actor died)
    address = start("open", "disabled")
    line, err = _connect_in_subprocess(address, home, timeout=120)
    assert line == "JOINED 1 None", (line, err)


# --- bug 1: engine calls are bounded by cluster.engine_call_timeout_s ------------------------

@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="rlake-fixes",
             _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def _cluster(timeout_s: float = TIMEOUT_S, **kw) -> ClusterConfig:
    return ClusterConfig(ray_address="local", engine_call_timeout_s=timeout_s,
                         placement_timeout_s=60, **kw)


def _pool(tiny, n=2, build=None, startup_timeout_s: float = 120.0):
    """A pool started within ``startup_timeout_s`` (two Ray workers importing torch and building
    an engine overran 4 s on a loaded CI machine, 2026-11-29), then bounded by ``TIMEOUT_S``."""
    from rollout.ray_engines import RayStateDictEnginePool
    from rollout.torch_engine import TorchEngine

    path, tok = tiny
    build = build or partial(TorchEngine, str(path), tok.eos_token_id, tok.pad_token_id)
    pool = RayStateDictEnginePool(build, "torch", n, 4, _cluster(startup_timeout_s), 0)
    pool.cluster = _cluster()
    return pool


def _all_cpus_free(wait_s: float = 30) -> None:
    import ray

    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == 4, ray.available_resources()


def test_a_hung_engine_fails_handoffs_and_queries_within_the_timeout(tiny, local_ray):
    """The reviewer's repro: SIGSTOP one engine's process (a hang, not a death: Ray does not
    restart it). Before: load_state_dict waited forever in ray.get."""
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    pool = _pool(tiny)
    pid = pool.placement[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        path, tok = tiny
        local = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id)
        weights = {k: v + 0.05 * torch.randn_like(v) for k, v in local.model.state_dict().items()}
        err, took = _bounded(lambda: pool.load_state_dict(weights, 5), 60)
        assert isinstance(err, TimeoutError), err
        assert str(err) == ("ray:torch/1: no answer to load_state_dict (weight_version 5) within "
                            f"cluster.engine_call_timeout_s={TIMEOUT_S:g}")
        assert took < TIMEOUT_S + 20
        assert pool.weight_version == 0 and 1 in pool._stale  # not acknowledged: resent later

        err, _ = _bounded(pool.engine_versions, 60)
        assert isinstance(err, TimeoutError) and str(err).startswith(
            "ray:torch/1: no answer to weight_version within cluster.engine_call_timeout_s"), err

        # a restarted engine that is back but does not take its weights: here engine 0, whose
        # weights are an object that never comes (the stopped engine's answer)
        never = pool.actors[1].weight_version.remote()
        pool._weights = ("state", never, 6)
        pool._stale.add(0)
        err, _ = _bounded(lambda: pool._revive(0), 60)
        assert isinstance(err, TimeoutError) and str(err).startswith(
            "ray:torch/0: no answer to load_state_dict (weight_version 6)"), err
        assert 0 in pool._stale and pool.alive == [True, True]
    finally:
        os.kill(pid, signal.SIGCONT)
    # the engine answers again: the same hand-off goes through, both serve it (given time: the
    # stopped engine has its queued calls to answer first, on a machine perhaps loaded)
    pool.cluster = _cluster(120.0)
    try:
        value, _ = _bounded(lambda: pool.load_state_dict(weights, 5), 60)
        assert value is None, value
        assert pool.engine_versions() == [5, 5]
        results, _ = _bounded(lambda: pool.generate([[1, 2, 3]] * 8, SamplingParams(4, 1.0, seed=1)), 60)
        assert [r.meta["engine"] for r in results] == ["ray:torch/0"] * 4 + ["ray:torch/1"] * 4
    finally:
        pool.shutdown()
    _all_cpus_free()  # actors and placement group gone


def test_an_engine_that_never_starts_fails_the_pool_within_the_timeout(tiny, local_ray):
    """Start-up (building the engine) is bounded too, and a pool that failed to start leaves no
    actor or placement group behind."""
    err, took = _bounded(lambda: _pool(tiny, n=1, build=partial(time.sleep, 3600),
                                         startup_timeout_s=TIMEOUT_S), 90)
    assert isinstance(err, TimeoutError), err
    assert str(err) == ("ray:torch/0: no answer to start-up (building its engine) within "
                        f"cluster.engine_call_timeout_s={TIMEOUT_S:g}")
    _all_cpus_free()  # no actor or placement group left behind
