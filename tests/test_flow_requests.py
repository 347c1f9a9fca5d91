"""The Prefect API round trips an RL iteration waits for, counted against the real embedded
server (bench/flow_requests.py: every request the run's process sends, recorded at httpx), and
the flow runs created ahead of their iteration (flows/prefetch.py).

Before the prefetcher and the client setting (infra/env.py) an iteration sent 8 requests and
waited for all of them: a CSRF token, the subflow's tracking task run, a look-up of an existing
subflow run, the flow, the flow run, Running, a read, Completed. Then it waited for 4 (an update
of the pre-created run, Running, a read, Completed), the 3 creating the next one sent from a
background thread. Now it waits for none: the run's own states go to that thread too, in order,
the read is answered from the engine's copy and the update (a no-op) is dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infra.env import OFFLINE_ENV
from tests.conftest import REPO

MAX_CRITICAL = 0


def _run(code_or_args: list[str], tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # rlake's Prefect settings (a server start limit for a loaded machine among them)
    env.update(OFFLINE_ENV, PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"))
    proc = subprocess.run([sys.executable, *code_or_args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_an_iteration_waits_for_no_prefect_request(tmp_path):
    stdout = _run(["bench/flow_requests.py", "--iterations", "5"], tmp_path)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert len(out["critical"]) == 4  # iterations 1..4 (the first pays one-off set-up)
    assert max(out["critical"]) <= MAX_CRITICAL, stdout
    # the next iteration's run is created and this one's states are sent meanwhile, off the path
    # (when they land relative to the iteration events varies)
    assert sum(t - c - lease for t, c, lease in zip(out["total"], out["critical"], out["leases"],
                                                    strict=True)) >= 3, stdout
    # one writer: every flow-run and task-run write between the first and the last iteration's
    # ends comes from the background thread, so none meets another at the server's SQLite
    assert out["writers"] == ["rlake-prefetch"], stdout
    # every iteration is a flow run of its own, finished; none created ahead is left over
    assert out["rl_iteration_runs"] == {"COMPLETED": 5}, stdout


# rlake's embedded server (its database from the cached template), as a run gets it: Prefect's
# own temporary server would migrate a fresh database first (a minute under load)
START_SERVER = """
import json, os
from infra.env import set_environment
from infra.prefect_server import EmbeddedServer
home = set_environment(os.path.dirname(os.environ["PREFECT_HOME"]))
server = EmbeddedServer.start(home)
server.wait()
"""

FAILING_PARENT_BODY = """
import time
from prefect import flow
from flows.durability import drain_prefect_clients
from flows.prefetch import IterationRuns, ahead
from bench.flow_requests import flow_run_states

@flow(name="child")
def child(i: int) -> int:
    if i == 2:
        time.sleep(FAIL_AFTER_S)  # the runs of 3 and 4 are created by then
        raise ValueError("iteration 2 fails")
    return i

@flow(name="parent")
def parent() -> list:
    out = []
    with IterationRuns(child) as runs:
        for i in range(5):
            out.append(runs.run({"i": i}, upcoming=ahead(i, 5, lambda j: {"i": j})))
    return out

try:
    parent()
except ValueError:
    pass
try:
    print(json.dumps({"states": flow_run_states("child"), "lost": LOST}))
finally:
    drain_prefect_clients()  # as the CLI does: logs sent after the server stops wait ~60 s
    server.stop()
"""
FAILING_PARENT = START_SERVER + "LOST, FAIL_AFTER_S = [], 0" + FAILING_PARENT_BODY


def test_a_failed_iteration_leaves_no_run_created_ahead(tmp_path):
    """Iteration 2 fails while the runs of iterations 3 and 4 exist already (``RUNS_AHEAD``):
    they are deleted, so the child runs are exactly 0, 1 (Completed) and 2 (Failed)."""
    stdout = _run(["-c", FAILING_PARENT], tmp_path)
    assert json.loads(stdout.strip().splitlines()[-1])["states"] == {"COMPLETED": 2, "FAILED": 1}, stdout


# the prefetch thread's transport loses the server's answer to the first request of each kind
# after the server has acted on it, as a request timing out does (``PREFECT_API_REQUEST_TIMEOUT``)
LOSING_TRANSPORT = """
import httpx
import flows.prefetch

LOST = []

class LosingTransport(flows.prefetch.LockRetryTransport):
    def handle_request(self, request):
        response = super().handle_request(request)
        kind = request.method + " " + ("set_state" if request.url.path.endswith("/set_state")
                                       else request.url.path.split("/")[2])
        if kind not in LOST and kind != "POST flows":
            response.read()
            LOST.append(kind)
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response

flows.prefetch.LockRetryTransport = LosingTransport
"""


def test_a_request_sent_again_after_its_answer_was_lost_writes_once(tmp_path):
    """Prefect's client sends a request again when its answer does not come in time
    (``PREFECT_API_REQUEST_TIMEOUT``: it happened after the server answered nothing for ~60 s). A
    creation, a state and a deletion sent twice by the prefetch thread leave the same runs as
    sent once: no second run created ahead left Pending, no error for a run deleted twice."""
    lose_answers = LOSING_TRANSPORT + "FAIL_AFTER_S = 8"  # two creations, each losing ~2 s
    stdout = _run(["-c", START_SERVER + lose_answers + FAILING_PARENT_BODY], tmp_path)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert {"POST flow_runs", "POST task_runs", "POST set_state", "DELETE flow_runs"} <= set(out["lost"]), out
    assert out["states"] == {"COMPLETED": 2, "FAILED": 1}, stdout


# each child leaves work running behind it (a commit: flows.steps.run_behind) that ends 1.5 s
# later; the work of iteration 2 fails. While it runs, the child's run must not be Completed.
HELD_PARENT = START_SERVER + """
import threading, time
from concurrent.futures import Future
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowRunFilter
from flows.prefetch import IterationRuns, ahead
from bench.flow_requests import flow_run_states

behind, seen = {}, {}

def state_of(i):
    with get_client(sync_client=True) as client:
        return [r.state_type.value for r in client.read_flow_runs()
                if r.parameters.get("i") == i and r.state_type.value != "PENDING"]

@flow(name="child")
def child(i: int) -> int:
    future = Future()
    behind["pending"] = future
    def work():
        time.sleep(1.5)
        seen[i] = state_of(i)
        if i == 2:
            future.set_exception(RuntimeError("the commit failed"))
        else:
            future.set_result(None)
    threading.Thread(target=work).start()
    return i

@flow(name="parent")
def parent() -> None:
    with IterationRuns(child, hold=lambda: behind.get("pending")) as runs:
        for i in range(3):
            runs.run({"i": i}, upcoming=ahead(i, 3, lambda j: {"i": j}))
            behind["pending"].exception()  # the next iteration waits for it (settle_commit)

try:
    parent()
    print(json.dumps({"seen": seen, "states": flow_run_states("child")}))
finally:
    server.stop()
"""


def test_a_runs_final_state_waits_for_the_work_it_left_behind(tmp_path):
    """``IterationRuns(hold=...)``: a pre-created run (iterations 1 and 2) stays Running while
    the work its flow left behind goes on, then Completed, or Failed when that work failed. The
    first iteration runs on a plain subflow call, whose Completed Prefect's engine sends itself
    (so rl_iteration never commits behind in a process's first iteration)."""
    out = json.loads(_run(["-c", HELD_PARENT], tmp_path).strip().splitlines()[-1])
    assert out["seen"] == {"0": ["COMPLETED"], "1": ["RUNNING"], "2": ["RUNNING"]}, out
    assert out["states"] == {"COMPLETED": 2, "FAILED": 1}, out


# async mode's iteration runs: top-level runs with the parent's tags, no tracking task runs
TOP_LEVEL_PARENT = START_SERVER + """
from prefect import flow, get_client, tags
from flows.prefetch import IterationRuns, ahead

@flow(name="child")
def child(i: int) -> int:
    return i

@flow(name="parent")
def parent() -> list:
    with IterationRuns(child, nested=False) as runs:
        return [runs.run({"i": i}, upcoming=ahead(i, 3, lambda j: {"i": j})) for i in range(3)]

try:
    with tags("rlake-run:t"):
        out = parent()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        parent_run = next(r for r in runs if r.name and r.parameters == {})
        children = sorted((r for r in runs if "i" in r.parameters), key=lambda r: r.parameters["i"])
        print(json.dumps({
            "out": out,
            "children": [[r.parameters["i"], r.state_type.value, r.parent_task_run_id is None,
                          "rlake-run:t" in r.tags] for r in children],
            "parent_task_runs": len(client.read_task_runs()),
        }))
finally:
    server.stop()
"""


def test_top_level_iteration_runs_carry_the_parents_tags_and_no_tracking_task_run(tmp_path):
    """``IterationRuns(nested=False)`` (async mode): every iteration, the first one too, runs on
    a flow run of its own with the parent's tags and no parent task run, and the parent flow
    run has no tracking task runs (the server would copy every state of the child to one)."""
    out = json.loads(_run(["-c", TOP_LEVEL_PARENT], tmp_path).strip().splitlines()[-1])
    assert out == {"out": [0, 1, 2],
                   "children": [[i, "COMPLETED", True, True] for i in range(3)],
                   "parent_task_runs": 0}, out


# a dead process's runs created ahead, as resume finds them: all Pending ``PREFETCHED`` (their
# Running states were still queued); iteration 3 had started tasks, 4 had not, 5 was committed
DEAD_PROCESS_RUNS = START_SERVER + """
from prefect import flow, get_client, task
from prefect.states import Pending
from infra.recovery import PREFETCHED, delete_prefetched, mark_crashed, run_tag

@flow(name="rl_iteration")
def rl_iteration(iteration: int) -> int:
    return iteration

@task(name="generate_rollouts")
def generate_rollouts() -> None:
    pass

try:
    with get_client(sync_client=True) as client:
        runs = {i: client.create_flow_run(flow=rl_iteration, parameters={"iteration": i},
                                          state=Pending(name=PREFETCHED), tags=[run_tag("r")])
                for i in (3, 4, 5)}
        client.create_task_run(task=generate_rollouts, flow_run_id=runs[3].id,
                               dynamic_key="0", state=Pending())
        deleted = delete_prefetched("r", committed={5})
        mark_crashed("r")
        left = {str(fr.parameters["iteration"]): fr.state.type.value
                for fr in client.read_flow_runs()}
    print(json.dumps({"deleted": deleted == [str(runs[4].id)], "left": left}))
finally:
    server.stop()
"""


def test_resume_deletes_only_the_runs_created_ahead_that_never_started(tmp_path):
    """A run created ahead whose iteration started (task runs recorded, or committed in the
    lake) while its Running state was still queued is marked Crashed, with its task runs; one
    that never started is deleted (CI caught the started one deleted: test_resume_reuse)."""
    out = json.loads(_run(["-c", DEAD_PROCESS_RUNS], tmp_path).strip().splitlines()[-1])
    assert out == {"deleted": True, "left": {"3": "CRASHED", "5": "CRASHED"}}, out


def test_the_writer_sends_an_iterations_states_before_the_creations_queued_earlier():
    """``flows.prefetch.Writer``: while one call runs, two creations and then two states are
    queued; the states go first, each lane in its order, on the one named thread."""
    import threading

    from flows.prefetch import Writer

    ran: list[tuple[str, str]] = []
    busy, release = threading.Event(), threading.Event()

    def call(name: str) -> str:
        ran.append((name, threading.current_thread().name))
        if name == "in flight":
            busy.set()
            release.wait(30)
        return name

    writer = Writer("rlake-prefetch")
    first = writer.submit(call, "in flight")
    assert busy.wait(30)
    later = [writer.submit(call, f"create {i}") for i in (1, 2)]
    cancelled = writer.submit(call, "create 3")
    urgent = [writer.submit(call, state, urgent=True) for state in ("Running", "Completed")]
    assert cancelled.cancel()
    release.set()
    assert [f.result(30) for f in (first, *urgent, *later)] == [
        "in flight", "Running", "Completed", "create 1", "create 2"]
    writer.shutdown()
    assert [name for name, _ in ran] == ["in flight", "Running", "Completed", "create 1", "create 2"]
    assert {thread for _, thread in ran} == {"rlake-prefetch"}


def test_a_final_state_waiting_for_its_commit_holds_back_no_other_write():
    """A run's final state is queued once the commit it waits for has ended
    (``IterationRuns._send``'s ``after``), so the writes queued after it (the next iteration's
    Running, the next runs' creations) go out meanwhile; closing waits for it to be sent."""
    import threading
    import time
    from concurrent.futures import Future

    from prefect import flow

    from flows.prefetch import IterationRuns, Writer

    @flow(name="child")
    def child(i: int) -> int:
        return i

    runs = IterationRuns(child)
    runs._pool = Writer("rlake-prefetch")  # what entering inside a flow run starts
    runs._client_ = lambda: None  # the writes below record instead of calling Prefect
    sent: list[tuple[str, str]] = []

    def write(name: str):
        return lambda _client: sent.append((name, threading.current_thread().name))

    commit = Future()
    runs._send(write("Completed 0"), after=commit)
    runs._send(write("Running 1"))
    deadline = time.monotonic() + 30
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [name for name, _ in sent] == ["Running 1"]  # not held back by the commit
    threading.Timer(0.2, commit.set_result, (None,)).start()
    runs.close()  # returns once the final state, queued when the commit ended, was sent
    assert sent == [("Running 1", "rlake-prefetch"), ("Completed 0", "rlake-prefetch")]


def _answering(statuses: list[int], answer: bytes = b""):
    """A real HTTP server on 127.0.0.1 answering ``statuses`` in turn (200 after them), with the
    body ``answer``; returns (server, the bodies it was sent); ``server.paths``: their paths."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(body.decode())
            paths.append(self.path)
            status = statuses.pop(0) if statuses else 200
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.paths = paths
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def _post_through_lock_retry(statuses: list[int]) -> tuple[int, list[str]]:
    import httpx

    from flows.prefetch import LockRetryTransport

    server, seen = _answering(statuses)
    try:
        with httpx.Client(transport=LockRetryTransport()) as client:
            response = client.post(f"http://127.0.0.1:{server.server_port}/flow_runs/", json={"a": 1})
    finally:
        server.shutdown()
    return response.status_code, seen


def test_a_locked_database_503_is_sent_again_after_short_pauses():
    """Prefect's server answers 503 while its SQLite is locked; the prefetch thread's transport
    sends the same request again (the same body) before Prefect's client would wait ~2 s, and
    hands a 503 that outlasts its pauses to Prefect's client."""
    from flows.prefetch import LOCK_RETRY_DELAYS_S

    assert _post_through_lock_retry([503, 503]) == (200, ['{"a":1}'] * 3)
    tries = len(LOCK_RETRY_DELAYS_S) + 1
    status, seen = _post_through_lock_retry([503] * tries)
    assert status == 503 and len(seen) == tries
    assert _post_through_lock_retry([500]) == (500, ['{"a":1}'])  # not a lock: no second try


def test_the_flow_upsert_before_each_flow_run_is_sent_once():
    """Prefect's ``create_flow_run`` upserts the flow before every flow run; the prefetch
    thread's transport sends that upsert once per flow and answers the next ones with the first
    answer, until a flow run creation fails (the flow may have been deleted)."""
    import httpx

    from flows.prefetch import FlowUpsertCache, LockRetryTransport

    server, seen = _answering([200, 201, 200, 404], answer=b'{"id": "f1"}')
    api = f"http://127.0.0.1:{server.server_port}/api"
    try:
        with httpx.Client(transport=FlowUpsertCache(LockRetryTransport())) as client:
            first = client.post(f"{api}/flows/", json={"name": "rl_iteration"})
            client.post(f"{api}/flow_runs/", json={"flow_id": "f1"})
            again = client.post(f"{api}/flows/", json={"name": "rl_iteration"})
            client.post(f"{api}/flows/", json={"name": "rollout_side"})
            client.post(f"{api}/flow_runs/", json={"flow_id": "f1"})  # 404: the flow is gone
            client.post(f"{api}/flows/", json={"name": "rl_iteration"})
    finally:
        server.shutdown()
    assert first.json() == again.json() == {"id": "f1"} and again.status_code == 200
    assert list(zip(server.paths, seen, strict=True)) == [
        ("/api/flows/", '{"name":"rl_iteration"}'), ("/api/flow_runs/", '{"flow_id":"f1"}'),
        ("/api/flows/", '{"name":"rollout_side"}'), ("/api/flow_runs/", '{"flow_id":"f1"}'),
        ("/api/flows/", '{"name":"rl_iteration"}')]


BUSY_TIMEOUTS = """
import sqlite3, sys
from prefect.server.database.configurations import AioSqliteConfiguration
from infra.prefect_app import shorten_busy_timeout

def busy_timeout_ms():
    conn = sqlite3.connect(sys.argv[1])
    AioSqliteConfiguration(connection_url="sqlite+aiosqlite:///" + sys.argv[1]).setup_sqlite(conn, None)
    return conn.execute("PRAGMA busy_timeout").fetchone()[0]

before = busy_timeout_ms()
shorten_busy_timeout()
shorten_busy_timeout()  # once is enough: not wrapped twice
print(json.dumps({"busy_timeout_ms": [before, busy_timeout_ms()], "command": server.proc.args}))
server.stop()
"""


def test_the_embedded_servers_sqlite_waits_seconds_not_a_minute_for_a_lock(tmp_path):
    """Prefect's server sets SQLite's busy timeout to 60 s on every connection; the embedded
    server runs Prefect's app with 5 s set after Prefect's own set-up: a server whose
    event loop was stuck behind a connection waiting for a lock stalled a run ~60 s."""
    from infra.prefect_app import SQLITE_BUSY_TIMEOUT_MS

    stdout = _run(["-c", START_SERVER + BUSY_TIMEOUTS, str(tmp_path / "server.db")], tmp_path)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["busy_timeout_ms"] == [60000, SQLITE_BUSY_TIMEOUT_MS] and SQLITE_BUSY_TIMEOUT_MS < 60000
    assert "infra.prefect_app:create_app" in out["command"]  # the server that answered runs it
