"""SGLangEngine: the rollout engine interface over real SGLang servers.

Generation: ``/generate`` calls of ``request_batch_size`` consecutive prompts each (token ids in,
token ids + logprobs out; ``request_chunks``), at most ``concurrency`` in flight, spread over the
workers by least in-flight count (or through an sglang-router, one prompt a call). Each prompt keeps its own request
id and its own result: a ``RolloutBatch`` can be aborted (dynamic sampling: stop the surplus), and
the prompts of a call the server aborted (a weight-update pause) or lost are re-issued.
Weight sync: ``pause_generation`` -> disk or distributed update on every worker ->
served ``weight_version`` checked on every worker -> ``continue_generation``.
Fault tolerance (``supervision``): a monitor thread probes ``/health_generate``; a dead or hung
server it launched is restarted on the same port from the newest checkpoint (so it comes back at
the current weight version), and the requests it lost are re-issued, so the batch completes. A
router it launched that died or hangs is started again.
"""

from __future__ import annotations

import atexit
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch

from infra.ports import free_port
from rollout.engine import GenerationResult, SamplingParams
from rollout.sglang.batch import RolloutBatch, Worker, cancel_if_cancelled, request_chunks
from rollout.sglang.client import (
    SGLangError,
    generate_payload,
    healthy,
    parse_generate_batch,
    served_weight_version,
)
from rollout.sglang.config import SGLangConfig, section
from rollout.sglang.server import (
    ManagedProcess,
    ServerSpec,
    SGLangServer,
    ready_or_moved,
    router_process,
    wait_ready,
    wait_router_workers,
)
from rollout.sglang.supervision import ServerSupervision
from rollout.sglang.weight_sync import (
    DistributedWeightSender,
    fan_out,
    iter_checkpoint_tensors,
    update_from_disk,
)

log = logging.getLogger(__name__)
_MAX_REISSUES = 50  # re-issues after server-side aborts (weight-update pauses), per request
_CONNECTION_LOST = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def config_for_run(cfg: Any, log_dir: str | Path | None = None,
                   cuda_available: bool | None = None) -> SGLangConfig:
    """The engine's settings from the run config (its ``rollout.sglang`` section, or that section
    itself). A null ``device`` is the run's top-level ``device`` (auto: cuda when torch sees a
    CUDA device; ``cuda_available`` answers instead of torch), so ``device: cuda`` alone
    launches GPU servers; an explicit one is kept. A null ``max_total_tokens`` is 65536 on cpu
    (SGLang's CPU path sizes nothing itself) and left to SGLang on cuda (from GPU memory).
    ``log_dir``: the servers' logs where the section names none."""
    settings = dict(section(cfg))
    if settings.get("device") is None:
        run_device = _run_device(cfg)
        if run_device is None:  # the section alone: SGLangConfig's default
            settings.pop("device", None)
        else:
            from infra.modeling import resolve_device

            settings["device"] = resolve_device(run_device, cuda_available)
    if settings.get("max_total_tokens") is None and settings.get("device", "cpu") == "cpu":
        settings.pop("max_total_tokens", None)  # SGLangConfig's default
    if settings.get("log_dir") is None and log_dir is not None:
        settings["log_dir"] = str(log_dir)
    return SGLangConfig.from_mapping(settings)


def _run_device(cfg: Any) -> str | None:
    """The top-level ``device`` of a whole run config (a dict or a RunConfig), else None."""
    if isinstance(cfg, Mapping):
        return cfg.get("device") if "rollout" in cfg else None
    return getattr(cfg, "device", None)


def server_spec(config: SGLangConfig, model_path: str, port: int, version: int,
                log_path: str | None = None) -> ServerSpec:
    """How server of ``config`` on ``port`` launches, from the weights at ``model_path``."""
    return ServerSpec(model_path=model_path, port=port, python=config.python,
                      weight_version=str(version), max_total_tokens=config.max_total_tokens,
                      device=config.device, extra_args=list(config.extra_server_args),
                      log_path=log_path)


class SGLangEngine(ServerSupervision):
    """The ``RolloutEngine`` over SGLang servers (see module docstring)."""

    name = "sglang"

    def __init__(self, model_dir: str | Path, config: SGLangConfig | None = None, weight_version: int = 0):
        self.config = config or SGLangConfig()
        self.http = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._version = int(weight_version)
        # the newest weights on disk and their version: what a restarted server loads
        self._disk = (str(model_dir), int(weight_version))
        self._sync_lock = threading.RLock()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._syncing = threading.Event()  # set while generation is paused for a weight sync
        self._sender: DistributedWeightSender | None = None
        self.router = None
        self.router_url: str | None = None
        self.stats = {"restarts": 0, "reissued": 0, "request_failures": 0, "router_restarts": 0}
        self._router_lock = threading.Lock()  # one thread restarts or moves the router at a time
        # the servers' logs: rollout.sglang.log_dir (a run's engine: its run folder's logs/), or
        # a temporary folder made only when a server or router starts (``log_dir``)
        self._log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        self.workers: list[Worker] = []
        self._closed = False
        atexit.register(self.shutdown)
        try:
            self._start_workers()
            if self.config.router:
                self._start_router()
        except BaseException:
            self.shutdown()
            raise
        self._pool = ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="sglang-req")
        self._monitors = [threading.Thread(target=self._monitor_loop, args=(w,), daemon=True,
                                           name=f"sglang-health-{i}") for i, w in enumerate(self.workers)]
        if self.router is not None:
            self._monitors.append(threading.Thread(target=self._router_monitor_loop, daemon=True,
                                                   name="sglang-router-health"))
        for t in self._monitors:
            t.start()

    @classmethod
    def from_config(cls, cfg: Any, model_dir: str | Path, weight_version: int = 0,
                    log_dir: str | Path | None = None) -> SGLangEngine:
        """Build from the run config (its ``rollout.sglang`` section, or that section itself);
        ``log_dir``: the servers' logs where the section names none."""
        return cls(model_dir, config_for_run(cfg, log_dir), weight_version)

    @property
    def log_dir(self) -> Path:
        """Where the servers' and the router's logs go (made on first use)."""
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="rlake-sglang-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return self._log_dir

    # ----------------------------------------------------------------- lifecycle
    def _start_workers(self) -> None:
        cfg = self.config
        if cfg.urls:
            self.workers = [Worker(url=u.rstrip("/")) for u in cfg.urls]
            for w in self.workers:
                deadline = time.monotonic() + cfg.startup_timeout_s
                while not healthy(self.http, w.url, 5.0, generate=False):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rollout.sglang.urls: {w.url} not healthy")
                    time.sleep(1.0)
            return
        for i in range(cfg.num_servers):
            server = self._server(i, free_port())
            server.start()
            self.workers.append(Worker(url=server.url, server=server))
        for i, w in enumerate(self.workers):
            w.server, _ = ready_or_moved(
                w.server, w.server.spec.port, partial(self._server, i),
                lambda server, _port: wait_ready(server, server.url, cfg.startup_timeout_s))
            w.url = w.server.url

    def _server(self, index: int, port: int) -> SGLangServer:
        """Server ``index`` on ``port``, from the newest weights on disk (not started)."""
        return SGLangServer(server_spec(self.config, self._disk[0], port, self._version,
                                        str(self.log_dir / f"sglang-{index}.log")))

    def _start_router(self, port: int | None = None, healthy_workers: int | None = None) -> None:
        """An sglang-router in front of the workers (on ``port``, else a free one; on another if
        that one is taken meanwhile), ready once it lists ``healthy_workers`` (default: all)
        as healthy."""
        urls, timeout_s = [w.url for w in self.workers], self.config.startup_timeout_s
        n_healthy = len(urls) if healthy_workers is None else max(healthy_workers, 1)

        def launch(port: int) -> ManagedProcess:
            return router_process(urls, port, self.config.python, log_path=str(self.log_dir / "router.log"))

        def wait(router: ManagedProcess, port: int) -> None:
            wait_router_workers(router, f"http://127.0.0.1:{port}", n_healthy, timeout_s)

        port = port or free_port()
        self.router = launch(port)
        self.router.start()
        self.router, port = ready_or_moved(self.router, port, launch, wait)
        self.router_url = f"http://127.0.0.1:{port}"

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._cond:  # requests waiting for a server to come up give up now
            self._cond.notify_all()
        for w in self.workers:
            w.wake.set()
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sender is not None:
            self._sender.close()
        procs = [w.server for w in self.workers if w.server is not None] + [self.router] * (self.router is not None)
        if procs:
            with ThreadPoolExecutor(max_workers=len(procs)) as pool:
                list(pool.map(lambda p: p.stop(), procs))
        self.http.close()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    # ----------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """One response per prompt, in prompt order."""
        return self.start(prompts, sampling).results()

    def start(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        """Submit ``prompts`` now; the returned batch yields results as they finish or aborts
        the rest (``batch.abort()``, for dynamic sampling's over-sampling)."""
        if self._closed:
            raise RuntimeError("SGLangEngine is shut down")
        batch = RolloutBatch(self)
        batch.futures = [Future() for _ in prompts]
        # sglang-router refuses a list of request ids (HTTP 422): behind it, one prompt a call
        size = 1 if self.router_url else self.config.request_batch_size
        for indices in request_chunks(len(prompts), size, len(self.workers)):
            call = self._pool.submit(self._settle, batch, indices, [list(prompts[i]) for i in indices], sampling)
            call.add_done_callback(partial(cancel_if_cancelled, [batch.futures[i] for i in indices]))
        return batch

    def _settle(self, batch: RolloutBatch, indices: list[int], prompts: list[list[int]],
                sampling: SamplingParams) -> None:
        """Run one call's prompts (``_request``) and hand each its result (or the error)."""
        live = [i for i in indices if batch.futures[i].set_running_or_notify_cancel()]
        try:
            results = self._request(batch, indices, prompts, sampling)
        except BaseException as err:  # noqa: BLE001 - each prompt's future raises it
            for i in live:
                batch.futures[i].set_exception(err)
            return
        for i in live:
            batch.futures[i].set_result(results[i])

    def _acquire(self, avoid: Worker | None = None) -> Worker:
        """The up worker with the fewest requests in flight, other than ``avoid`` when another
        is up (waits while none is up)."""
        deadline = time.monotonic() + self.config.startup_timeout_s + 60.0
        with self._cond:
            while True:
                up = [w for w in self.workers if w.up]
                if len(up) > 1 and avoid in up:
                    up.remove(avoid)
                if up:
                    w = min(up, key=lambda x: x.inflight)
                    w.inflight += 1
                    return w
                if self._closed or not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise SGLangError("no SGLang server is up")

    def _release(self, w: Worker) -> None:
        with self._cond:
            w.inflight -= 1

    def _request(self, batch: RolloutBatch, indices: list[int], prompts: list[list[int]],
                 sampling: SamplingParams) -> dict[int, GenerationResult]:
        """One ``/generate`` call for ``prompts`` (batch positions ``indices``), again for those
        the server aborted (a weight-update pause: up to ``_MAX_REISSUES`` times) and, on another
        worker, for all that a failed call lost (up to ``max_request_attempts``)."""
        pending = dict(zip(indices, prompts, strict=True))
        done: dict[int, GenerationResult] = {}
        failures = reissues = 0
        last_failed: Worker | None = None
        while pending:
            if batch.aborted.is_set():
                for i in pending:
                    done[i] = GenerationResult([], [], "abort", meta={"attempts": failures + reissues})
                return done
            worker = self._acquire(avoid=last_failed)
            target = self.router_url or worker.url
            rids = {i: uuid.uuid4().hex for i in pending}
            for i, rid in rids.items():
                batch.track(i, worker.url, rid)
            error: str | None = None
            try:
                ids, names = list(pending.values()), list(rids.values())
                # one prompt in SGLang's single form (all sglang-router takes), several in its batch form
                body = (generate_payload(ids[0], sampling, names[0]) if len(ids) == 1
                        else generate_payload(ids, sampling, names))
                r = self.http.post(f"{target}/generate", json=body, timeout=self.config.request_timeout_s)
                if r.status_code == 200:
                    for i, result in zip(rids, parse_generate_batch(r.json(), len(rids)), strict=True):
                        if result.finish_reason != "abort" or batch.aborted.is_set():
                            result.meta.update(server=target, attempts=failures + reissues + 1)
                            done[i] = result
                            del pending[i]
                    if pending:  # aborted by the server (a weight-update pause): run them again
                        reissues += 1
                        with self._cond:
                            self.stats["reissued"] += len(pending)
                        if reissues > _MAX_REISSUES:
                            raise SGLangError(f"requests {sorted(pending)} aborted by the server {reissues} times")
                    continue
                if 400 <= r.status_code < 500:
                    raise SGLangError(f"{target}/generate: HTTP {r.status_code}: {r.text[:300]}")
                error = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
                if not self.router_url and isinstance(e, _CONNECTION_LOST):
                    self._set_up(worker, False)  # until the monitor sees it healthy (or restarts it)
            finally:
                for i in rids:
                    batch.untrack(i)
                self._release(worker)
            failures += 1
            with self._cond:
                self.stats["request_failures"] += 1
                self.stats["reissued"] += len(pending)
            log.warning("requests %s on %s failed (%s); re-issuing", sorted(pending), worker.url, error)
            if failures >= self.config.max_request_attempts:
                raise SGLangError(f"requests {sorted(pending)} failed {failures} times, last: {error}")
            last_failed = worker
            self._suspect(worker)
            time.sleep(min(2.0, 0.2 * failures))
        return done

    # ----------------------------------------------------------------- weight sync
    def update_weights(self, checkpoint_dir: str, weight_version: int) -> None:
        """Serve the HF checkpoint at ``checkpoint_dir`` as ``weight_version`` on every worker
        (``weight_sync: disk`` -> each worker reads it; ``distributed`` -> this process reads it
        and broadcasts the tensors)."""
        if self.config.weight_sync == "distributed":
            self.update_weights_from_tensors(iter_checkpoint_tensors(checkpoint_dir), weight_version, checkpoint_dir)
            return
        with self._paused() as urls:
            update_from_disk(self.http, urls, str(checkpoint_dir), str(weight_version))
            self._commit(urls, str(checkpoint_dir), weight_version)

    def update_weights_from_tensors(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: int,
                                    checkpoint_dir: str | None = None) -> None:
        """Broadcast ``named`` (HF parameter names) to every worker over the weight-update group.
        ``checkpoint_dir`` (the same weights on disk) is what a restarted server loads."""
        with self._paused() as urls:
            if self._sender is not None and self._sender.urls != urls:
                self._drop_sender()
            if self._sender is None:
                self._sender = DistributedWeightSender(self.http, urls, self.config.dist_backend,
                                                       bucket_bytes=self.config.bucket_mb << 20)
            try:
                self._sender.send(named, str(weight_version))
            except BaseException:
                self._drop_sender()
                raise
            self._commit(urls, checkpoint_dir, weight_version)

    def _sync_targets(self) -> list[str]:
        """Workers a weight sync must reach: all but launched ones that are down (those restart
        from the newest checkpoint, which the sync records, so they come back current)."""
        return [w.url for w in self.workers if w.up or w.stale or w.server is None]

    def _commit(self, urls: list[str], checkpoint_dir: str | None, weight_version: int) -> None:
        """Check that every synced worker serves ``weight_version``, then record it (and the
        checkpoint holding it, when there is one)."""
        bad = {u: v for u in urls if (v := served_weight_version(self.http, u)) != str(weight_version)}
        if bad:
            raise SGLangError(f"weight sync to version {weight_version} not applied: {bad}")
        self._version = int(weight_version)
        if checkpoint_dir is not None:
            self._disk = (str(checkpoint_dir), int(weight_version))
        for w in self.workers:
            if w.stale and w.url in urls:
                w.stale = False
                self._set_up(w, True)

    def _paused(self):
        engine = self

        class _Pause:
            urls: list[str] = []

            def __enter__(self_inner) -> list[str]:
                engine._sync_lock.acquire()
                engine._syncing.set()
                try:
                    self_inner.urls = engine._sync_targets()
                    if not self_inner.urls:
                        raise SGLangError("weight sync: no SGLang server is up")
                    fan_out(engine.http, self_inner.urls, "/pause_generation", {"mode": engine.config.pause_mode})
                except BaseException:
                    engine._syncing.clear()
                    engine._sync_lock.release()
                    raise
                return self_inner.urls

            def __exit__(self_inner, *exc):
                try:
                    fan_out(engine.http, self_inner.urls, "/continue_generation", {})
                finally:
                    engine._syncing.clear()
                    engine._sync_lock.release()

        return _Pause()

    def _drop_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
