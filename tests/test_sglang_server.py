"""Real SGLang servers (from .venv-sglang, built by scripts/setup_sglang.sh) on a tiny Qwen2.

One engine with two servers is shared by the whole module (each server costs ~2 GB and
20-80 s to start on these machines); the tests run in file order and the last one kills a
server. Logprobs are checked against a fp32 HF forward recomputation (log_softmax(logits / T)).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, wait
from functools import cache
from pathlib import Path

import httpx
import pytest
import torch

from infra.ports import free_port
from rollout.engine import GenerationResult, RolloutEngine, SamplingParams
from rollout.sglang import SGLangConfig, SGLangEngine
from rollout.sglang import engine as sglang_engine
from rollout.sglang.client import served_weight_version
from rollout.sglang.server import (
    group_members,
    move_router_worker,
    router_process,
    shm_files_in_use,
    shm_inode,
    shm_names,
    wait_router_workers,
)
from rollout.sglang.tiny_model import build_tiny_qwen2
from tests.opshelp import listening_socket, taken_port_fixture

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
TOL = 1e-4
PROMPTS = [[3, 4, 12, 5, 13], [5, 5, 13], [2, 3, 4, 5, 6, 7], [9, 9, 12, 8, 13]]
HANG_GUARD_S = 900  # bounded waits on events fail with a message after this, never a speed check


def wait_until(predicate, what: str) -> None:
    """Poll ``predicate`` (an event we cannot be notified of) until true; a hang guard."""
    guard = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < guard, f"hang guard: {what}"
        time.sleep(0.01)


def live_requests(batch) -> int:
    with batch._lock:
        return len(batch._live)


@cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def recompute(path: str, prompt: list[int], result: GenerationResult, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the response tokens under the checkpoint at ``path``."""
    ids = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        logits = hf_model(path)(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]


class Mismatch(float):
    """Mean |rollout logprob - recomputed logprob| over all response tokens; its repr lists the
    samples that are off (their server, version, cached tokens, attempts) so a failure says where."""

    def __new__(cls, value: float, off: list[str]):
        obj = super().__new__(cls, value)
        obj.off = off
        return obj

    def __repr__(self) -> str:
        return f"{float(self):.4g} (off: {'; '.join(self.off) or 'none'})"


def mismatch(path: str, prompts: list[list[int]], results: list[GenerationResult], temperature: float) -> Mismatch:
    """Mean |rollout logprob - recomputed logprob| over all response tokens."""
    diffs = [(recompute(path, p, r, temperature) - torch.tensor(r.logprobs)).abs()
             for p, r in zip(prompts, results, strict=True)]
    off = [f"#{i} {float(d.mean()):.3g} {p}->{r.token_ids} {r.meta}"
           for i, (p, r, d) in enumerate(zip(prompts, results, diffs, strict=True)) if float(d.mean()) >= TOL]
    return Mismatch(float(torch.cat(diffs).mean()), off)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    return {name: str(build_tiny_qwen2(root / name, seed=seed)) for name, seed in (("a", 0), ("b", 1))}


@pytest.fixture(scope="module")
def taken_port():
    """A port another process listens on while the module's engine starts."""
    yield from taken_port_fixture()


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory, taken_port):
    """The module's engine; its first server is given a port another process holds (what a port
    picked free and taken before the server bound it looks like): it starts on another."""
    cfg = SGLangConfig(
        num_servers=2, concurrency=16, health_interval_s=1.0, health_timeout_s=10.0, health_failures=2,
        log_dir=str(tmp_path_factory.mktemp("sglang-logs")),
    )
    picks = iter([taken_port])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_engine, "free_port", lambda: next(picks, None) or free_port())
        eng = SGLangEngine(ckpts["a"], cfg, weight_version=0)
    yield eng
    eng.shutdown()


def test_a_server_whose_port_was_taken_started_on_another(engine, taken_port):
    ports = [int(u.rsplit(":", 1)[1]) for u in engine.urls]
    assert taken_port not in ports and len(set(ports)) == 2
    assert all(w.up and w.server.alive() and w.server.spec.port == p for w, p in zip(engine.workers, ports, strict=True))
    first_log = Path(engine.workers[0].server.log_path).read_text()
    assert first_log.count(f"{taken_port}): address already in use") == 1


def ipc_sockets(folder: str) -> list[Path]:
    return [p for p in Path(folder).iterdir() if stat.S_ISSOCK(p.stat().st_mode)]


def shm_of_group(pgid: int) -> set[str]:
    """Names under /dev/shm that the processes of group ``pgid`` use (an SGLang server's
    scheduler: its load segment; its semaphore)."""
    used = shm_files_in_use(group_members(pgid))
    return {name for name in shm_names() if shm_inode(name) in used}


def test_each_servers_temporary_files_are_in_its_own_folder(engine):
    """SGLang makes its ZMQ sockets with ``tempfile`` and never removes them: each launch's go to
    a folder of its own (its ``TMPDIR``), which stopping it removes (the restart test below)."""
    folders = [w.server.tmp_dir for w in engine.workers]
    assert len(set(folders)) == 2
    for folder in folders:
        assert Path(folder).parent == Path(tempfile.gettempdir())
        assert len(ipc_sockets(folder)) >= 3  # tokenizer, scheduler, detokenizer at least


def test_generation_matches_hf_logprobs(engine, ckpts):
    assert isinstance(engine, RolloutEngine)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7)
    results = engine.generate(PROMPTS * 2, sampling)
    assert len(results) == 8
    for r in results:
        assert 0 < len(r.token_ids) <= 12 and len(r.logprobs) == len(r.token_ids)
        assert r.finish_reason in ("stop", "length")
        assert (r.finish_reason == "stop") == (r.token_ids[-1] == 1)  # EOS id 1, kept in the response
        assert r.meta["weight_version"] == "0"
    assert {r.meta["server"] for r in results} == set(engine.urls)  # both servers used
    assert mismatch(ckpts["a"], PROMPTS * 2, results, 0.7) < TOL
    assert mismatch(ckpts["b"], PROMPTS * 2, results, 0.7) > 1e-2  # the check can tell models apart


def test_disk_sync_then_outputs_follow_new_checkpoint(engine, ckpts):
    engine.update_weights(ckpts["b"], 1)
    assert engine.weight_version == 1
    assert [served_weight_version(engine.http, u) for u in engine.urls] == ["1", "1"]
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert {r.meta["weight_version"] for r in results} == {"1"}
    assert mismatch(ckpts["b"], PROMPTS, results, 1.0) < TOL


def test_distributed_sync_then_outputs_follow_new_checkpoint(engine, ckpts):
    engine.config.weight_sync = "distributed"
    try:
        engine.update_weights(ckpts["a"], 2)
        assert engine.weight_version == 2
        results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert {r.meta["weight_version"] for r in results} == {"2"}
        assert mismatch(ckpts["a"], PROMPTS, results, 1.0) < TOL
        # the trainer-side call: live parameters, the group reused for the next version
        named = [(n, p.detach()) for n, p in hf_model(ckpts["b"]).named_parameters()]
        engine.update_weights_from_tensors(named, 3, checkpoint_dir=ckpts["b"])
        results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert {r.meta["weight_version"] for r in results} == {"3"}
        assert mismatch(ckpts["b"], PROMPTS, results, 1.0) < TOL
    finally:
        engine.config.weight_sync = "disk"


@pytest.fixture
def calls_of_two(engine):
    """The engine sends 2 prompts a call for one test: with 16 calls in flight, a batch of 64
    prompts keeps some queued while the first finish."""
    engine.config.request_batch_size = 2
    yield 2
    engine.config.request_batch_size = SGLangConfig().request_batch_size


def test_sync_during_rollout_keeps_each_sample_on_one_version(engine, ckpts, calls_of_two):
    """pause_generation(abort) + re-issue: a batch in flight across a weight update completes,
    and every sample's logprobs match the one checkpoint its weight version names. The update
    starts once the first call is done (so some samples are on the old version) while the rest
    (64 prompts, 2 a call, 16 calls at a time) are in flight or queued (so some must come from
    the new one). The prompts of a call the pause aborted are sent again, on the new weights."""
    prompts = PROMPTS * 16
    batch = engine.start(prompts, SamplingParams(max_new_tokens=24, temperature=1.0))
    done, _ = wait(batch.futures, timeout=HANG_GUARD_S, return_when=FIRST_COMPLETED)
    assert done, "hang guard: no sample finished"
    assert live_requests(batch) > 0, "the batch finished before the update: nothing in flight"
    engine.update_weights(ckpts["a"], 4)
    results = batch.results()
    assert all(r.finish_reason in ("stop", "length") for r in results)
    by_version = {"3": ckpts["b"], "4": ckpts["a"]}
    for p, r in zip(prompts, results, strict=True):
        assert (recompute(by_version[r.meta["weight_version"]], p, r, 1.0) - torch.tensor(r.logprobs)).abs().mean() < TOL
    versions = [r.meta["weight_version"] for r in results]
    assert "3" in versions and "4" in versions, versions  # the batch spans the update


def test_abort_surplus_requests(engine, calls_of_two):
    before = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    batch = engine.start(PROMPTS * 16, SamplingParams(max_new_tokens=64, temperature=1.0))
    wait_until(lambda: live_requests(batch) > 0, "no request of the batch went live")
    live = batch.abort()
    in_flight = engine.config.concurrency * calls_of_two  # at most this many prompts sent at once
    assert 1 <= live <= in_flight  # the live requests were aborted, and only those
    results = batch.results()
    assert len(results) == 64
    aborted = [r for r in results if r.finish_reason == "abort"]
    assert len(aborted) >= 64 - in_flight  # never-sent requests come back aborted
    assert all(len(r.logprobs) == len(r.token_ids) for r in results)
    after = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))  # the engine still serves
    assert all(r.finish_reason != "abort" for r in before + after)


def test_router_and_given_urls(engine, ckpts, tmp_path):
    """A second engine connecting to the running servers by URL, through an sglang-router; its
    router's log goes where the run says (a run's engine: its folder's logs/). An engine with
    servers given by URL and no router starts nothing that logs: it leaves no temporary folder."""
    def temporary_log_folders() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("rlake-sglang-*")}
    before = temporary_log_folders()
    plain = SGLangEngine.from_config({"urls": engine.urls}, ckpts["a"], 4)
    assert plain.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))
    plain.shutdown()
    assert temporary_log_folders() == before
    other = SGLangEngine.from_config({"urls": engine.urls, "router": True}, ckpts["a"], 4,
                                     log_dir=tmp_path / "logs")
    assert (tmp_path / "logs" / "router.log").is_file()
    try:
        results = other.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert {r.meta["server"] for r in results} == {other.router_url}
        assert other.stats["request_failures"] == 0  # the router was ready when start-up returned
        assert mismatch(ckpts["a"], PROMPTS, results, 1.0) < TOL
    finally:
        other.shutdown()
    assert all(w.server.alive() for w in engine.workers)  # not ours to stop


@pytest.fixture
def routed(engine, ckpts, tmp_path):
    """A second engine in front of the module's servers, through an sglang-router it launched;
    the router's monitor probes every half second (two unanswered in a row, 5 s each: hung)."""
    other = SGLangEngine.from_config(
        {"urls": engine.urls, "router": True, "health_interval_s": 0.5, "health_timeout_s": 5.0,
         "health_failures": 2}, ckpts["a"], 4, log_dir=tmp_path / "logs")
    yield other
    other.shutdown()
    assert all(w.server.alive() for w in engine.workers)  # not ours to stop


def assert_completed_through_a_new_router(other: SGLangEngine, old, results: list[GenerationResult],
                                          model: str, failed_through_old: bool = True) -> None:
    """The batch's requests failed through router ``old`` (``failed_through_old``; else they
    may also have been answered by it), which was started again once, and completed through
    the new one, on the weights of ``model``."""
    assert other.stats["router_restarts"] == 1, other.stats
    assert other.stats["request_failures"] >= int(failed_through_old), other.stats
    assert other.router is not old and other.router.alive() and not old.alive()
    assert {r.meta["server"] for r in results} == {other.router_url}
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert mismatch(model, PROMPTS, results, 1.0) < TOL


def test_a_router_that_died_is_started_again_and_the_batch_completes(routed, ckpts):
    """The sglang-router an engine launched is killed (SIGKILL to its group): the next batch's
    requests through it fail, the engine starts the router again in front of the same servers,
    and the batch completes through it, on the right weights, started once: the router's own
    monitor, probing every half second, never takes the new router, still starting, for a hung
    one (it did once, in CI, 2026-11-28: two restarts)."""
    dead = routed.router
    dead.signal_group(signal.SIGKILL)
    dead.proc.wait(timeout=60)
    results = routed.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert_completed_through_a_new_router(routed, dead, results, ckpts["a"])


def test_a_hung_router_is_started_again_and_the_batch_completes(routed, ckpts):
    """The sglang-router an engine launched stops answering (SIGSTOP to its group) with a
    batch's requests in flight through it: its monitor finds its ``/health`` unanswered twice,
    stops it (which fails the requests waiting on it, or lets it answer them as it exits) and
    starts another in front of the same servers; failed requests are re-issued and the batch
    completes, on the right weights. Nothing else would notice: a request waits up to ``request_timeout_s``, an hour."""
    hung = routed.router
    hung.signal_group(signal.SIGSTOP)
    batch = routed.start(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    done, _ = wait(batch.futures, timeout=HANG_GUARD_S)
    assert len(done) == len(PROMPTS), "hang guard: the batch never completed"
    # the old router is stopped with SIGTERM + SIGCONT: resumed, it may answer the requests
    # waiting on it before it exits (a loaded CI machine, 2026-11-29: none failed, and the batch
    # was done before the new router was up), so the restart is waited for, not assumed done
    deadline = time.monotonic() + HANG_GUARD_S
    while routed.stats["router_restarts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_completed_through_a_new_router(routed, hung, batch.results(), ckpts["a"],
                                          failed_through_old=False)


def test_a_router_is_moved_to_a_restarted_servers_new_url(engine, tmp_path):
    """What the monitor does behind a router when a restarted server moved to another port:
    the router (a real sglang-router, in front of the first server) is told the new URL and
    forgets the old one; it then lists and serves through the new one alone."""
    old_url, new_url = engine.urls
    port = free_port()
    router = router_process([old_url], port, log_path=str(tmp_path / "router.log"))
    router.start()
    router_url = f"http://127.0.0.1:{port}"
    try:
        wait_router_workers(router, router_url, 1, 120)
        move_router_worker(router_url, old_url, new_url, timeout_s=60)
        listed = httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]
        assert [(w["url"], w["is_healthy"]) for w in listed] == [(new_url, True)]
        move_router_worker(router_url, old_url, new_url, timeout_s=60)  # again: nothing to do
        answer = httpx.post(f"{router_url}/generate", timeout=60, json={
            "input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200 and answer.json()["output_ids"], answer.text
    finally:
        router.stop()


def stopped_while_on_both(engine: SGLangEngine, prompts: list[list[int]], sampling: SamplingParams,
                          attempts: int = 10):
    """A batch of ``prompts`` whose requests are unanswered on both servers, both servers
    stopped (SIGSTOP to each group): what the test then does to them cannot come after the
    batch has ended. A batch seen in flight on both is frozen; once the answers sent before the
    stop are read (a settle, not a speed check) each server must still owe some. On a loaded
    machine a batch can finish before the test's thread looks (CI, 2026-11-27), or between that
    look and a kill, so such a batch is let go and another started (a bound on attempts)."""
    first, second = engine.workers
    for _ in range(attempts):
        batch = engine.start(prompts, sampling)
        guard = time.monotonic() + HANG_GUARD_S
        while not all(f.done() for f in batch.futures):
            if first.inflight > 0 and second.inflight > 0:
                for w in (first, second):
                    os.killpg(w.server.pid, signal.SIGSTOP)
                time.sleep(0.5)
                if first.inflight > 0 and second.inflight > 0:
                    return batch
                for w in (first, second):
                    os.killpg(w.server.pid, signal.SIGCONT)
                break
            assert time.monotonic() < guard, "hang guard: the batch neither finished nor ran on both"
            time.sleep(0.01)
        batch.results()
    raise AssertionError(f"none of {attempts} batches was seen in flight on both servers")


def hold_port(port: int, timeout_s: float = 60.0) -> socket.socket:
    """A socket listening on ``port`` once the process that held it has let it go."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return listening_socket(port, reuse_addr=True)
        except OSError:
            assert time.monotonic() < deadline, f"port {port} still held"
            time.sleep(0.05)


def test_dead_and_hung_servers_are_restarted_and_batch_completes(engine, ckpts):
    """Mid-rollout, server 0 is killed (SIGKILL to its process group) and server 1 hangs
    (SIGSTOP): the monitors restart both at the current weight version, the lost requests are
    re-issued, and the batch completes with every sample. Another process takes the dead
    server's port meanwhile (the test, as soon as the kill frees it; the restart loads for
    seconds before it binds): the restart moves to another port, and its URL follows."""
    dead, hung = engine.workers
    dead_url, hung_url = dead.url, hung.url
    old_folders = [dead.server.tmp_dir, hung.server.tmp_dir]
    old_segments = shm_of_group(dead.server.pid) | shm_of_group(hung.server.pid)
    assert old_segments  # each scheduler maps its load segment
    prompts = PROMPTS * 8
    batch = stopped_while_on_both(engine, prompts, SamplingParams(max_new_tokens=32, temperature=1.0))
    os.killpg(dead.server.pid, signal.SIGKILL)  # the other stays stopped: hung
    holder = hold_port(dead.server.spec.port)
    results = batch.results()
    assert len(results) == len(prompts)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert mismatch(ckpts["a"], prompts, results, 1.0) < TOL
    with engine._cond:  # notified whenever a worker goes up or down
        assert engine._cond.wait_for(lambda: all(w.restarts >= 1 and w.up for w in (dead, hung)),
                                     timeout=HANG_GUARD_S), "hang guard: both servers not restarted"
    assert engine.stats["restarts"] >= 2 and engine.stats["reissued"] > 0
    holder.close()
    assert dead.url != dead_url and dead.url == dead.server.url and hung.url == hung_url
    assert f"{dead_url.rsplit(':', 1)[1]}): address already in use" in Path(dead.server.log_path).read_text()
    for w in (dead, hung):
        assert w.server.alive() and served_weight_version(engine.http, w.url) == "4"
        assert w.server.tmp_dir not in old_folders and ipc_sockets(w.server.tmp_dir)
    assert not any(Path(folder).exists() for folder in old_folders)  # removed with their servers
    assert not {name for name in old_segments if Path("/dev/shm", name).exists()}  # and these
    # both restarted servers serve: each call's two requests go to the least busy server, but a
    # request may end before the other is sent (both then on one server: seen once in CI,
    # 2026-11-27), so calls are repeated until both answered (a bound, not a timing)
    served: set[str] = set()
    for _ in range(10):
        results = engine.generate(PROMPTS * 4, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert mismatch(ckpts["a"], PROMPTS * 4, results, 1.0) < TOL
        served |= {r.meta["server"] for r in results}
        if served == {dead.url, hung.url}:
            break
    assert served == {dead.url, hung.url}
