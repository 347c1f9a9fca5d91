"""Supervision of an SGLangEngine's servers and router: what keeps a rollout going when one of
them dies or hangs.

One monitor thread per server probes ``/health_generate``; a dead or hung server the engine
launched is restarted on the same port from the newest checkpoint (so it comes back at the
current weight version; on another port if its own was taken meanwhile, the router told), and
the requests it lost are re-issued by the engine. A router the engine launched has a monitor of
its own (``/health``): one that exited or stopped answering is started again in front of the
same servers; one that exited is also started again as soon as a request through it fails.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rollout.sglang.batch import Worker
from rollout.sglang.client import SGLangError, healthy, served_weight_version
from rollout.sglang.server import (
    ManagedProcess,
    SGLangServer,
    move_router_worker,
    ready_or_moved,
    wait_ready,
)
from rollout.sglang.weight_sync import update_from_disk

log = logging.getLogger(__name__)


class ServerSupervision:
    """The health half of ``SGLangEngine`` (a mixin: it works on the engine's own state — its
    ``workers``, ``router``, ``config``, ``http``, locks, ``stats`` and the newest weights on disk
    ``_disk`` — and calls back its ``_start_router`` and ``_drop_sender``)."""

    def _suspect(self, worker: Worker) -> None:
        """A request failed on ``worker`` (on any worker, behind a router): check it now, and
        the router too (``_revive_router``: one that exited is started again before the request
        is re-issued; a hung one is the router monitor's)."""
        for w in self.workers if self.router_url else [worker]:
            w.wake.set()
        if self.router is not None:
            self._revive_router()

    def _revive_router(self, hung: ManagedProcess | None = None) -> None:
        """Start the router this engine launched again, in front of the workers, on its port
        (another if that one was taken meanwhile): when its process exited, or when it is
        ``hung`` (that process, found not answering by ``_router_monitor_loop``: stopped first,
        which fails the requests waiting on it). Requests sent through it fail until then and
        are re-issued (``_request``)."""
        with self._router_lock:
            router = self.router
            if router is None or self._closed or (router is not hung if hung else router.alive()):
                return  # not launched, closed, or started again meanwhile
            if hung:
                log.warning("the sglang-router at %s does not answer (%d probes); starting it again",
                            self.router_url, self.config.health_failures)
            else:
                log.warning("the sglang-router at %s exited (code %s); starting it again",
                            self.router_url, router.proc.returncode)
            router.stop()  # its process group and its temporary folder
            # those up now: one down meanwhile is restarting (the router finds it later)
            self._start_router(int(self.router_url.rsplit(":", 1)[1]),
                               healthy_workers=sum(w.up for w in self.workers))
            with self._cond:
                self.stats["router_restarts"] += 1

    def _router_monitor_loop(self) -> None:
        """The launched router's own monitor: probe its ``/health`` every
        ``health_interval_s``; exited, or ``health_failures`` probes in a row unanswered within
        ``health_timeout_s`` (hung: its requests would wait ``request_timeout_s``) -> start it
        again. The probe is the router's own (it asks no server): a slow server does not fail it.
        Failures count per router process: a new one starts from none."""
        failures, probed = 0, None
        while not self._stop.wait(self.config.health_interval_s):
            # under the lock: never a router a revival has launched and not yet seen ready (its
            # probes are refused while it starts: it was taken for a hung one, in CI, 2026-11-28)
            with self._router_lock:
                router, url = self.router, self.router_url
            if router is not probed:
                failures, probed = 0, router
            try:
                if not router.alive():
                    self._revive_router()
                    continue
                ok = healthy(self.http, url, self.config.health_timeout_s, generate=False)
                failures = 0 if ok else failures + 1
                if failures >= self.config.health_failures:
                    failures = 0
                    self._revive_router(hung=router)
            except Exception:  # noqa: BLE001 - the monitor must survive to try again
                log.exception("health check / restart of the sglang-router %s failed", url)

    def _monitor_loop(self, w: Worker) -> None:
        """One thread per worker: probe every ``health_interval_s`` (or when woken)."""
        while not self._stop.is_set():
            w.wake.wait(timeout=self.config.health_interval_s)
            w.wake.clear()
            if self._stop.is_set():
                return
            try:
                self._check(w)
            except Exception:  # noqa: BLE001 - the monitor must survive to try again
                log.exception("health check / restart of %s failed", w.url)

    def _check(self, w: Worker) -> None:
        """Dead (launched process gone) -> restart now; ``health_failures`` failed
        ``/health_generate`` probes in a row (hung) -> restart; healthy -> mark up."""
        dead = w.server is not None and not w.server.alive()
        if not dead:
            if self._syncing.is_set():
                return  # generation is paused on purpose: a probe would time out
            ok = healthy(self.http, w.url, self.config.health_timeout_s)
            if self._syncing.is_set():
                return
            w.failures = 0 if ok else w.failures + 1
            if ok or w.failures < self.config.health_failures:
                self._set_up(w, (ok or w.up) and not w.stale)
                return
        self._set_up(w, False)
        if w.server is not None:
            self._restart(w)

    def _restart(self, w: Worker) -> None:
        """Relaunch ``w`` on its port from the newest checkpoint at the current version; if a
        sync landed meanwhile, bring it to that version from disk; then put it back in service.
        A port another process took while the server was down (or loading) is left for a new
        free one: the worker's URL follows, and a router is told (it knows servers by URL)."""
        log.warning("restarting SGLang server %s (pid %s)", w.url, w.server.pid)
        path, version = self._disk
        w.server.relaunch(path, str(version))
        w.server, _ = ready_or_moved(
            w.server, w.server.spec.port, lambda port: SGLangServer(replace(w.server.spec, port=port)),
            lambda server, _port: wait_ready(server, server.url, self.config.startup_timeout_s))
        # under the lock: a router revived meanwhile starts with the workers' URLs, so it must
        # not read them between the move and the new URL (down meanwhile: no request was sent)
        with self._router_lock:
            if self.router_url and w.server.url != w.url:
                move_router_worker(self.router_url, w.url, w.server.url, self.config.startup_timeout_s)
            w.url = w.server.url
        with self._sync_lock:
            path, version = self._disk
            if served_weight_version(self.http, w.url) != str(version):
                update_from_disk(self.http, [w.url], path, str(version))
            served = served_weight_version(self.http, w.url)
            if served != str(version):
                raise SGLangError(f"{w.url} restarted at weight version {served}, expected {version}")
            self._drop_sender()  # the old group lost a rank; the next distributed sync rebuilds it
            w.failures = 0
            w.restarts += 1
            with self._cond:
                self.stats["restarts"] += 1
            # weights pushed from tensors with no checkpoint on disk: out of rotation until a sync
            w.stale = version != self._version
            if w.stale:
                log.warning("%s is back at version %s < %s: idle until the next weight sync",
                            w.url, version, self._version)
            self._set_up(w, not w.stale)

    def _set_up(self, w: Worker, up: bool) -> None:
        with self._cond:
            w.up = up
            self._cond.notify_all()
