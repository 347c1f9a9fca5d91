"""What the SGLang engine hands out and keeps per server: a submitted batch's handle
(``RolloutBatch``), a server as the engine sees it (``Worker``), and how a batch is cut into
``/generate`` calls."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.engine import GenerationResult
from rollout.sglang.client import SGLangError, post
from rollout.sglang.server import SGLangServer

if TYPE_CHECKING:
    from rollout.sglang.engine import SGLangEngine


def request_chunks(n: int, request_batch_size: int, workers: int) -> list[list[int]]:
    """Prompt indices ``0..n-1`` cut into consecutive ``/generate`` calls of ``size`` prompts
    (the last may be shorter), small enough that every worker gets one:

        size = max(1, min(request_batch_size, ceil(n / workers)))
    """
    size = max(1, min(request_batch_size, math.ceil(n / max(1, workers))))
    return [list(range(lo, min(lo + size, n))) for lo in range(0, n, size)]


def cancel_if_cancelled(prompt_futures: list[Future], call: Future) -> None:
    """A call the shutdown cancelled before it ran leaves none of its prompts waiting."""
    if call.cancelled():
        for future in prompt_futures:
            future.cancel()


@dataclass
class Worker:
    """One SGLang server as the engine sees it."""

    url: str
    server: SGLangServer | None = None  # None: an external server (given by URL)
    up: bool = True
    inflight: int = 0
    failures: int = 0
    restarts: int = 0
    stale: bool = False  # restarted behind the served version, no checkpoint to reload: next sync
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass
class RolloutBatch:
    """Handle on a submitted batch: results in prompt order, or abort what is still running."""

    engine: SGLangEngine
    futures: list[Future] = field(default_factory=list)
    aborted: threading.Event = field(default_factory=threading.Event)
    _live: dict[int, tuple[str, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, index: int, url: str, rid: str) -> None:
        with self._lock:
            self._live[index] = (url, rid)

    def untrack(self, index: int) -> None:
        with self._lock:
            self._live.pop(index, None)

    def abort(self) -> int:
        """Abort every request not finished yet (they return ``finish_reason='abort'`` with the
        tokens generated so far; unsent ones return empty). Returns how many were live."""
        self.aborted.set()
        with self._lock:
            live = list(self._live.values())
        for _url, rid in live:
            for w in self.engine.workers:  # the router may have placed it anywhere
                try:
                    post(self.engine.http, w.url, "/abort_request", {"rid": rid}, 10.0)
                except SGLangError:
                    pass
        return len(live)

    def as_completed(self) -> Iterator[tuple[int, GenerationResult]]:
        """(prompt index, result) as each finishes."""
        index = {f: i for i, f in enumerate(self.futures)}
        for f in as_completed(self.futures):
            yield index[f], f.result()

    def results(self) -> list[GenerationResult]:
        return [f.result() for f in self.futures]
