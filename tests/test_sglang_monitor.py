"""The SGLang engine's request, sync and health paths against a local HTTP server on 127.0.0.1
that misbehaves on purpose (stdlib http.server in a thread, SGLang's endpoints and JSON shapes):
URL-given workers, request attempt and re-issue limits, hung workers taken out of rotation and
back, probes skipped while a weight sync pauses generation, stale workers brought back by the
next sync. No .venv-sglang needed; tests/test_sglang_server.py runs the real servers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from rollout.engine import SamplingParams
from rollout.sglang import SGLangConfig, SGLangEngine
from rollout.sglang.client import SGLangError

SAMPLING = SamplingParams(max_new_tokens=2, temperature=1.0)


class Gate:
    """Holds each arrival until ``n`` have arrived (then lets everyone through)."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.lock, self.open = n, 0, threading.Lock(), threading.Event()

    def arrive(self) -> None:
        with self.lock:
            self.arrived += 1
            if self.arrived >= self.n:
                self.open.set()
        assert self.open.wait(timeout=300), "hang guard: the other request never arrived"


class FakeSGLang:
    """SGLang's HTTP surface with scripted behaviour: ``script`` is consumed one entry per
    ``/generate`` call ("ok", "abort" = aborted by the server, "abort_first" = only the call's
    first prompt aborted, "500", "400"; ``default`` once empty); ``health`` is what
    ``/health_generate`` answers. Counts every call per endpoint. A call in SGLang's batch form
    (a list of prompts) gets a list of results."""

    def __init__(self, version: str = "0") -> None:
        self.version, self.health, self.default = version, 200, "ok"
        self.apply_updates = True  # False: answers success to a weight update but keeps its version
        self.gate: Gate | None = None  # /generate waits at it (requests held in flight together)
        self.script: list[str] = []
        self.calls: dict[str, int] = {}
        self.bodies: dict[str, list[dict]] = {}
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict | list) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                fake.count(self.path, {})
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/health_generate":
                    self._send(fake.health, {})
                elif self.path == "/model_info":
                    self._send(200, {"weight_version": fake.version})
                else:
                    self._send(404, {"message": self.path})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                fake.count(self.path, body)
                if self.path == "/generate":
                    self._generate(body, fake.next_behaviour())
                elif self.path == "/update_weights_from_disk":
                    if fake.apply_updates:
                        fake.version = body["weight_version"]
                    self._send(200, {"success": True})
                elif self.path in ("/pause_generation", "/continue_generation", "/abort_request"):
                    self._send(200, {"success": True})
                else:
                    self._send(404, {"message": self.path})

            def _generate(self, body: dict, behaviour: str) -> None:
                if fake.gate is not None:
                    fake.gate.arrive()
                if behaviour in ("500", "400"):
                    self._send(int(behaviour), {"message": "scripted failure"})
                    return
                batched = isinstance(body["input_ids"][0], list)  # SGLang's batch form: a list back
                n = len(body["input_ids"]) if batched else 1
                # "abort": the server aborted the whole call; "abort_first": only its first prompt
                finishes = ["abort" if behaviour == "abort" or (behaviour == "abort_first" and k == 0)
                            else "stop" for k in range(n)]
                results = [{"meta_info": {"output_token_logprobs": [[-0.5, 7, "x"], [-0.25, 1, ""]],
                                          "finish_reason": {"type": f}, "weight_version": fake.version}}
                           for f in finishes]
                self._send(200, results if batched else results[0])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, path: str, body: dict) -> None:
        with self.lock:
            self.calls[path] = self.calls.get(path, 0) + 1
            self.bodies.setdefault(path, []).append(body)

    def next_behaviour(self) -> str:
        with self.lock:
            return self.script.pop(0) if self.script else self.default

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made: list[FakeSGLang] = []
    yield lambda: made.append(FakeSGLang()) or made[-1]
    for f in made:
        f.close()


def _engine(urls: list[str], **over) -> SGLangEngine:
    # monitors probe only when woken (a failed request) or when a test calls _check: the
    # interval is long so that no background probe races the test's own
    cfg = dict(urls=urls, concurrency=4, health_interval_s=3600.0, health_timeout_s=10.0,
               health_failures=2, max_request_attempts=3, startup_timeout_s=30.0)
    return SGLangEngine("/unused-model-dir", SGLangConfig(**{**cfg, **over}), weight_version=0)


def test_url_given_workers_serve_and_are_external(fakes):
    a, b = fakes(), fakes()
    a.gate = b.gate = Gate(2)  # the first request is held on one server until one reaches the other
    with _engine([a.url, b.url + "/"]) as eng:
        assert eng.urls == [a.url, b.url]  # trailing slash dropped
        assert all(w.server is None for w in eng.workers)  # not ours: never launched/restarted
        results = eng.generate([[3, 4]] * 8, SAMPLING)
    assert [r.token_ids for r in results] == [[7, 1]] * 8
    assert all(r.finish_reason == "stop" and r.logprobs == [-0.5, -0.25] for r in results)
    assert {r.meta["server"] for r in results} == {a.url, b.url}  # spread over both
    bodies = a.bodies["/generate"] + b.bodies["/generate"]  # request_batch_size 8, two workers:
    assert [len(body["input_ids"]) for body in bodies] == [4, 4]  # two calls of 4 prompts
    assert len({rid for body in bodies for rid in body["rid"]}) == 8  # each prompt its own id
    assert a.calls.get("/health_generate", 0) == 0  # start-up checks /health only


def test_failed_requests_stop_after_max_request_attempts(fakes):
    a = fakes()
    a.default = "500"
    with _engine([a.url]) as eng:
        with pytest.raises(SGLangError, match=r"requests \[0\] failed 3 times, last: HTTP 500"):
            eng.generate([[3, 4]], SAMPLING)
        assert eng.stats["request_failures"] == 3
    assert a.calls["/generate"] == 3


def test_failure_then_success_is_reissued(fakes):
    a = fakes()
    a.script = ["500", "ok"]
    with _engine([a.url]) as eng:
        [r] = eng.generate([[3, 4]], SAMPLING)
        assert r.finish_reason == "stop" and r.meta["attempts"] == 2
        assert eng.stats["request_failures"] == 1 and eng.stats["reissued"] == 1


def test_client_errors_are_not_retried(fakes):
    a = fakes()
    a.default = "400"
    with _engine([a.url]) as eng:
        with pytest.raises(SGLangError, match="HTTP 400"):
            eng.generate([[3, 4]], SAMPLING)
    assert a.calls["/generate"] == 1


def test_server_side_aborts_are_reissued_up_to_the_limit(fakes):
    from rollout.sglang.engine import _MAX_REISSUES

    a = fakes()
    a.script = ["abort", "abort", "ok"]  # a weight-update pause aborted it twice
    with _engine([a.url]) as eng:
        [r] = eng.generate([[3, 4]], SAMPLING)
        assert r.finish_reason == "stop" and r.meta["attempts"] == 3 and eng.stats["reissued"] == 2
        a.default = "abort"  # a server that aborts forever: the request gives up
        with pytest.raises(SGLangError, match=f"aborted by the server {_MAX_REISSUES + 1} times"):
            eng.generate([[3, 4]], SAMPLING)
    assert a.calls["/generate"] == 3 + _MAX_REISSUES + 1


def test_a_call_the_server_partly_aborted_reissues_only_those_prompts(fakes):
    """Four prompts in one call; a weight-update pause aborts the first: only it is sent again,
    and every result lands at its own prompt's position."""
    a = fakes()
    a.script = ["abort_first", "ok"]
    with _engine([a.url]) as eng:
        results = eng.generate([[3, 4], [5], [6], [7]], SAMPLING)
        assert eng.stats["reissued"] == 1 and eng.stats["request_failures"] == 0
    first, again = a.bodies["/generate"]
    assert first["input_ids"] == [[3, 4], [5], [6], [7]] and len(first["rid"]) == 4
    assert again["input_ids"] == [3, 4]  # one prompt: SGLang's single form
    assert again["rid"] not in first["rid"]  # a new request id for the re-issued prompt
    assert [r.finish_reason for r in results] == ["stop"] * 4
    assert [r.meta["attempts"] for r in results] == [2, 1, 1, 1]


def test_a_failed_call_is_reissued_whole_on_the_other_worker(fakes):
    a, b = fakes(), fakes()
    a.default = "500"
    with _engine([a.url, b.url], request_batch_size=3) as eng:
        results = eng.generate([[3, 4]] * 6, SAMPLING)  # two calls of 3: one lands on a, fails
    assert a.calls["/generate"] >= 1 and all(len(x["input_ids"]) == 3 for x in b.bodies["/generate"])
    assert [r.meta["server"] for r in results] == [b.url] * 6


def test_request_batch_size_one_sends_a_call_per_prompt(fakes):
    a = fakes()
    with _engine([a.url], request_batch_size=1) as eng:
        eng.generate([[3, 4]] * 5, SAMPLING)
    assert [(x["input_ids"], type(x["rid"])) for x in a.bodies["/generate"]] == [([3, 4], str)] * 5


def test_hung_worker_leaves_rotation_after_health_failures_and_comes_back(fakes):
    a, b = fakes(), fakes()
    with _engine([a.url, b.url]) as eng:
        wa = eng.workers[0]
        a.health = 503
        eng._check(wa)
        assert wa.up and wa.failures == 1  # one failed probe is not enough (health_failures=2)
        eng._check(wa)
        assert not wa.up and wa.failures == 2 and wa.restarts == 0  # external: out, not restarted
        results = eng.generate([[3, 4]] * 6, SAMPLING)
        assert {r.meta["server"] for r in results} == {b.url}
        a.health = 200
        eng._check(wa)
        assert wa.up and wa.failures == 0
        results = eng.generate([[3, 4]] * 6, SAMPLING)
        assert a.url in {r.meta["server"] for r in results}


def test_probes_are_skipped_while_a_sync_pauses_generation(fakes):
    a = fakes()
    with _engine([a.url]) as eng:
        w = eng.workers[0]
        a.health = 503  # a paused server would time out /health_generate
        eng._syncing.set()
        try:
            eng._check(w)
            eng._check(w)
        finally:
            eng._syncing.clear()
        assert a.calls.get("/health_generate", 0) == 0 and w.up and w.failures == 0
        eng._check(w)  # not syncing any more: probed
        assert a.calls["/health_generate"] == 1 and w.failures == 1


def test_weight_sync_pauses_updates_checks_and_continues(fakes):
    a, b = fakes(), fakes()
    with _engine([a.url, b.url]) as eng:
        eng.update_weights("/ckpt/v3", 3)
        assert eng.weight_version == 3 and eng._disk == ("/ckpt/v3", 3)
        results = eng.generate([[3, 4]] * 4, SAMPLING)
    for f in (a, b):
        assert f.version == "3" and f.bodies["/update_weights_from_disk"][0]["model_path"] == "/ckpt/v3"
        assert f.calls["/pause_generation"] == f.calls["/continue_generation"] == 1
    assert {r.meta["weight_version"] for r in results} == {"3"}


def test_sync_not_applied_is_an_error_and_generation_continues(fakes):
    a = fakes()
    a.apply_updates = False  # says success, keeps serving version 0
    with _engine([a.url]) as eng:
        with pytest.raises(SGLangError, match="weight sync to version 1 not applied"):
            eng.update_weights("/ckpt/v1", 1)
        assert eng.weight_version == 0 and eng._disk[1] == 0
        assert a.calls["/continue_generation"] == 1 and not eng._syncing.is_set()


def test_stale_worker_is_idle_until_the_next_sync_reaches_it(fakes):
    """A worker back at an older version (restarted when the newest weights were pushed from
    tensors, with no checkpoint to reload) serves nothing until a sync brings it current."""
    a, b = fakes(), fakes()
    with _engine([a.url, b.url]) as eng:
        wa = eng.workers[0]
        wa.stale = True
        eng._set_up(wa, False)
        eng._check(wa)  # healthy, but stale: stays out
        assert not wa.up
        results = eng.generate([[3, 4]] * 4, SAMPLING)
        assert {r.meta["server"] for r in results} == {b.url}
        assert a.url in eng._sync_targets()  # the sync must reach it
        eng.update_weights("/ckpt/v2", 2)
        assert not wa.stale and wa.up and a.version == "2"
        results = eng.generate([[3, 4]] * 8, SAMPLING)
        assert a.url in {r.meta["server"] for r in results}


def test_sync_with_no_server_up_is_refused(fakes):
    a = fakes()
    with _engine([a.url]) as eng:
        eng.workers[0].server = object()  # a launched worker that is down: skipped by syncs
        eng._set_up(eng.workers[0], False)
        try:
            with pytest.raises(SGLangError, match="weight sync: no SGLang server is up"):
                eng.update_weights("/ckpt/v1", 1)
            assert not eng._syncing.is_set() and a.calls.get("/pause_generation", 0) == 0
        finally:
            eng.workers[0].server = None  # shutdown would stop it otherwise


class FakeLaunch:
    """Stands in for the process handle of a server the engine launched (``SGLangServer``):
    ``relaunch`` brings the fake back up at the given checkpoint's version, running ``during``
    first (what happens while the real server would be starting)."""

    name = "fake-sglang"
    pid = -1

    def __init__(self, fake: FakeSGLang) -> None:
        self.fake, self.up, self.relaunched, self.during = fake, True, [], None
        self.url = fake.url
        self.spec = SimpleNamespace(port=int(fake.url.rsplit(":", 1)[1]))

    def alive(self) -> bool:
        return self.up

    def port_taken(self) -> bool:
        return False

    def relaunch(self, path: str, version: str) -> None:
        self.relaunched.append((path, version))
        if self.during is not None:
            self.during()
        self.fake.version, self.up = version, True

    def log_tail(self) -> str:
        return ""

    def record_own_shm(self) -> None:  # a thread in this process: nothing of its own in /dev/shm
        pass

    def stop(self) -> None:
        self.up = False


def test_weight_sync_landing_during_a_restart_reaches_the_restarted_server(fakes):
    """Server a dies; while it restarts (from the checkpoint of version 0), a sync to version 7
    reaches the live server b only; the restart then brings a to version 7 from disk."""
    a, b = fakes(), fakes()
    with _engine([a.url, b.url]) as eng:
        wa = eng.workers[0]
        wa.server = handle = FakeLaunch(a)
        handle.during = lambda: eng.update_weights("/ckpt/v7", 7)
        handle.up = False  # the process died
        eng._check(wa)
        assert handle.relaunched == [("/unused-model-dir", "0")]  # the newest weights at the time
        assert b.version == "7" and a.calls.get("/pause_generation", 0) == 0  # a was down
        assert a.version == "7" and a.bodies["/update_weights_from_disk"][-1]["model_path"] == "/ckpt/v7"
        assert wa.up and not wa.stale and wa.restarts == 1 and eng.stats["restarts"] == 1
        results = eng.generate([[3, 4]] * 4, SAMPLING)
        assert {r.meta["weight_version"] for r in results} == {"7"}


def test_restart_behind_the_served_version_leaves_the_worker_stale_until_a_sync(fakes):
    """The newest weights were pushed from tensors with no checkpoint (``_disk`` is older than
    the served version): the restarted server comes back behind, stays out of rotation, and
    the next sync (which must include it) brings it back."""
    a, b = fakes(), fakes()
    with _engine([a.url, b.url]) as eng:
        wa = eng.workers[0]
        wa.server = handle = FakeLaunch(a)
        eng._version = 5  # what update_weights_from_tensors(..., checkpoint_dir=None) leaves
        handle.up = False
        eng._check(wa)
        assert handle.relaunched == [("/unused-model-dir", "0")] and a.version == "0"
        assert wa.stale and not wa.up and wa.restarts == 1
        assert a.url in eng._sync_targets()
        eng.update_weights("/ckpt/v6", 6)
        assert a.version == b.version == "6" and wa.up and not wa.stale


def test_request_waiting_for_a_server_gives_up_at_shutdown(fakes):
    """No worker up: a request waits in acquire (for up to startup_timeout_s + 60 s); shutting
    the engine down ends the wait at once with a clear error instead."""
    a = fakes()
    eng = _engine([a.url], startup_timeout_s=3600.0)  # acquire would wait an hour on its own
    eng._set_up(eng.workers[0], False)
    batch = eng.start([[3, 4]], SAMPLING)
    guard = time.monotonic() + 300
    while not batch.futures[0].running():  # an event we cannot be notified of; a hang guard
        assert time.monotonic() < guard, "hang guard: the request never started"
        time.sleep(0.01)
    eng.shutdown()
    with pytest.raises(SGLangError, match="no SGLang server is up"):
        batch.futures[0].result(timeout=300)  # a hang guard
    assert a.calls.get("/generate", 0) == 0
