"""A server's port picked free can be taken before the server binds it (SGLang loads for 20 s
and more first; any process on the machine may get that port from the OS meanwhile): the
server then exits at start-up, and ``ready_or_moved`` starts it again on another free port.
Real processes throughout: Python's http.server, and the uvicorn and sglang-router that SGLang
runs, each against a port this test holds open."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import httpx
import pytest

from rollout.sglang.server import ManagedProcess, ready_or_moved, router_process, sglang_python, wait_ready
from tests.opshelp import taken_port_fixture


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on for the test's length."""
    yield from taken_port_fixture()


def http_server(tmp_path, launches: list[int]):
    def launch(port: int) -> ManagedProcess:
        launches.append(port)
        cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
               "--directory", str(tmp_path)]
        return ManagedProcess(cmd, {}, str(tmp_path / "server.log"), f"http:{port}")
    return launch


def wait_http(proc: ManagedProcess, port: int) -> None:
    wait_ready(proc, f"http://127.0.0.1:{port}", 60.0, endpoint="/")


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path, taken_port):
    launches: list[int] = []
    launch = http_server(tmp_path, launches)
    first = launch(taken_port)
    first.start()
    proc, port = ready_or_moved(first, taken_port, launch, wait_http)
    try:
        assert launches[0] == taken_port and len(launches) == 2 and port == launches[1] != taken_port
        assert first.port_taken() and not proc.port_taken()
        assert "already in use" in (tmp_path / "server.log").read_text()
        assert "already in use" not in proc.log_tail(400)  # this launch's lines only
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    finally:
        proc.stop()
    assert not proc.alive()


def test_an_exit_for_another_reason_is_raised_not_retried(tmp_path):
    launches: list[int] = []

    def launch(port: int) -> ManagedProcess:
        launches.append(port)
        cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
        return ManagedProcess(cmd, {}, str(tmp_path / "server.log"), f"broken:{port}")

    proc = launch(1)
    proc.start()
    with pytest.raises(RuntimeError, match="no model here"):
        ready_or_moved(proc, 1, launch, wait_http)
    assert launches == [1]


def test_every_launch_on_a_taken_port_gives_up_after_tries(tmp_path, taken_port, monkeypatch):
    import infra.ports

    monkeypatch.setattr(infra.ports, "free_port", lambda host="127.0.0.1": taken_port)
    launches: list[int] = []
    launch = http_server(tmp_path, launches)
    first = launch(taken_port)
    first.start()
    with pytest.raises(RuntimeError, match="already in use"):
        ready_or_moved(first, taken_port, launch, wait_http, tries=2)
    assert launches == [taken_port, taken_port]


@pytest.mark.sglang
def test_sglang_uvicorn_and_router_name_a_taken_port(tmp_path, taken_port):
    """What ``port_taken`` looks for is what the pinned SGLang environment prints: its uvicorn
    (which serves every SGLang server) and its sglang-router, each started on a taken port."""
    app = f"import uvicorn; uvicorn.run(lambda *a: None, host='127.0.0.1', port={taken_port}, lifespan='off')"
    uvicorn = ManagedProcess([sglang_python(), "-c", app], {}, str(tmp_path / "uvicorn.log"), "uvicorn")
    router = router_process(["http://127.0.0.1:9"], taken_port, log_path=str(tmp_path / "router.log"))
    for proc in (uvicorn, router):
        proc.start()
        try:
            proc.proc.wait(timeout=120)
            assert proc.port_taken(), proc.log_tail()
        finally:
            proc.stop()  # exited on its own: its temporary folder goes with the stop


def test_the_embedded_prefect_server_moves_off_a_taken_port(tmp_path, taken_port, monkeypatch):
    """A run's own Prefect server (``EmbeddedServer``) started on a taken port is spawned again
    on another before the run calls its API: the URL the run's clients read follows it."""
    import infra.prefect_server as prefect_server

    picks = iter([taken_port])
    real_free_port = prefect_server.free_port
    monkeypatch.setattr(prefect_server, "free_port", lambda: next(picks, None) or real_free_port())
    monkeypatch.setenv("PREFECT_API_URL", "unset")  # restored as it was after the test
    monkeypatch.delenv("PREFECT_API_URL")
    spawned = []
    spawn = prefect_server.EmbeddedServer._spawn

    def counted_spawn(self):
        spawn(self)
        spawned.append(self.port)

    monkeypatch.setattr(prefect_server.EmbeddedServer, "_spawn", counted_spawn)
    server = prefect_server.EmbeddedServer.start(tmp_path / "home")
    try:
        assert server.url == f"http://127.0.0.1:{taken_port}/api"
        url = server.wait(timeout_s=300)
        assert url == server.url == os.environ["PREFECT_API_URL"] and f":{taken_port}/" not in url
        assert prefect_server.healthy(url) and server.proc.poll() is None
        assert spawned == [taken_port, server.port]
        # the first launch's log says why it ended (Prefect's logging muted uvicorn's error)
        log = (tmp_path / "home" / "prefect" / "embedded-server.log").read_text()
        assert f"{taken_port}): address already in use" in log, log
    finally:
        server.stop()


def test_the_embedded_prefect_server_failing_otherwise_is_not_respawned(tmp_path, monkeypatch):
    """An exit with its port free (here: an app that cannot be imported) is raised at once."""
    import infra.prefect_server as prefect_server

    monkeypatch.setattr(prefect_server, "EMBEDDED_APP", "no_such_module:create_app")
    monkeypatch.setenv("PREFECT_API_URL", "unset")
    monkeypatch.delenv("PREFECT_API_URL")
    server = prefect_server.EmbeddedServer.start(tmp_path / "home")
    first = server.url
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait(timeout_s=300)
        assert server.url == first
    finally:
        server.stop()


def test_the_homes_prefect_server_moves_off_a_taken_port(tmp_path, taken_port, monkeypatch):
    """``rlake serve``'s server (``ensure_server``, Prefect's own ``prefect server start``) on a
    port picked free and taken: started on another, and that is the one recorded."""
    import infra.prefect_server as prefect_server

    picks = iter([taken_port])
    real_free_port = prefect_server.free_port
    monkeypatch.setattr(prefect_server, "free_port", lambda: next(picks, None) or real_free_port())
    home = tmp_path / "home"
    url = prefect_server.ensure_server(home)
    try:
        assert f":{taken_port}/" not in url and prefect_server.healthy(url)
        assert prefect_server.server_info(home)["url"] == url
    finally:
        prefect_server.stop_server(home)
    assert prefect_server.server_info(home) is None


def test_a_port_the_user_gave_is_not_moved(tmp_path, taken_port):
    """``rlake serve --port P`` with P taken: the error, not a server on another port."""
    import infra.prefect_server as prefect_server

    home = tmp_path / "home"
    with pytest.raises(RuntimeError, match="exited"):
        prefect_server.ensure_server(home, port=taken_port)
    assert prefect_server.server_info(home) is None
    assert (home / "prefect" / "server.log").read_text().count(f"{taken_port} is already in use") == 1
