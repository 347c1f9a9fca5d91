"""How many Prefect API requests one RL iteration makes, and how many of them sit on its path.

    python bench/flow_requests.py [--iterations 6]

Runs the quickstart pipeline in this process (tiny model, short SFT, a few small iterations)
against Prefect's real embedded server and records every HTTP request the process sends to it
(``RequestLog``: a wrapper around httpx's ``send``, nothing is faked). Between two consecutive
``iteration`` events of the run loop it counts

    total     every request sent meanwhile, on any thread (server load)
    critical  those the iteration waits for (tag concurrency leases apart: ``lease``): all but
              those sent from rlake's own background threads (named ``rlake-*``: the flow-run
              prefetcher and reporter, flows/prefetch.py); Prefect's event-loop thread counts,
              the iteration blocks on it (``run_coro_as_sync``)

and prints the median of each over the iterations after the first, the requests of one
iteration by method and path, then one JSON line. Counts are deterministic (no timings).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402

_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class RequestLog:
    """Every request httpx sends from this process while installed: (thread name, "METHOD
    /path") in order, ids in paths replaced by ``{id}`` so that paths group."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def add(self, request) -> None:
        line = f"{request.method} {_ID.sub('{id}', request.url.path)}"
        with self._lock:
            self.requests.append((threading.current_thread().name, line))

    def mark(self) -> int:
        with self._lock:
            return len(self.requests)

    @contextmanager
    def installed(self) -> Iterator[RequestLog]:
        import httpx

        sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send
        log = self

        def send(client, request, *args, **kwargs):
            log.add(request)
            return sync_send(client, request, *args, **kwargs)

        async def asend(client, request, *args, **kwargs):
            log.add(request)
            return await async_send(client, request, *args, **kwargs)

        httpx.Client.send, httpx.AsyncClient.send = send, asend
        try:
            yield self
        finally:
            httpx.Client.send, httpx.AsyncClient.send = sync_send, async_send


def lease(line: str) -> bool:
    """A tag concurrency-slot request of a task run: Prefect sends one per tag set every 5 s at
    most (it caches "no limit" for 5 s), so it lands in some iterations only; counted apart."""
    return "/concurrency_limits/" in line


def off_path(thread: str) -> bool:
    """A request the iteration does not wait for: sent from one of rlake's background threads."""
    return thread.startswith("rlake-")


def per_iteration(log: RequestLog, marks: list[int]) -> list[dict]:
    """For each span between consecutive marks: {"total", "critical", "lines"} (``critical``:
    the requests not ``off_path``; ``lines``: those by "METHOD /path")."""
    out = []
    for start, end in zip(marks, marks[1:], strict=False):
        span = log.requests[start:end]
        on_path = [line for t, line in span if not off_path(t)]
        out.append({"total": len(span), "critical": sum(not lease(x) for x in on_path),
                    "leases": sum(lease(x) for x in on_path), "lines": Counter(on_path)})
    return out


def iteration_requests(home: str, iterations: int = 6) -> tuple[list[dict], dict[str, int], set[str]]:
    """Run a small quickstart (``iterations`` RL iterations) in this process and count each
    iteration's requests (``per_iteration``; the first iteration's span, from the run's first
    event on, is left out: it pays one-off set-up); with the states of its ``rl_iteration`` flow
    runs (``flow_run_states``) and the threads that wrote flow and task runs between the first
    and the last iteration's ends (``writers``)."""
    from infra.config import load_config
    from infra.env import configure_environment

    configure_environment(home)
    from flows.rl import rl_run, set_reporter

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"home={home}", f"num_rollout={iterations}", "sft.steps=5", "sft.stop_at_accuracy=null",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "data.held_out_size=8",
        f"eval.eval_interval={iterations + 1}", "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1"])
    log, marks = RequestLog(), []
    set_reporter(lambda event, payload: marks.append(log.mark()) if event == "iteration" else None)
    try:
        with log.installed():
            rl_run(cfg.model_dump(), run_id="requests")
    finally:
        set_reporter(None)
    return (per_iteration(log, marks), flow_run_states("rl_iteration"),
            writers(log.requests[marks[0]:marks[-1]] if marks else []))


def writers(requests: list[tuple[str, str]]) -> set[str]:
    """The threads (numbered pool threads as one name) that sent writes of flow runs and task runs
    (POST, PATCH: creations, states, updates; not the ``/filter`` reads)."""
    return {re.sub(r"_\d+$", "", thread) for thread, line in requests
            if line.split()[0] in ("POST", "PATCH") and "/filter" not in line
            and line.split()[1].startswith(("/api/flow_runs/", "/api/task_runs/"))}


def flow_run_states(name: str) -> dict[str, int]:
    """How many flow runs of the flow ``name`` are in each state type (e.g. {"COMPLETED": 6})."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    return dict(Counter(r.state_type.value for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    spans, states, writing = iteration_requests(scratch_dir("rlake-requests-"), args.iterations)
    for line, n in sorted(spans[-1]["lines"].items()):
        print(f"{n:3d}  {line}")
    out = {"bench": "flow_requests", "iterations": args.iterations,
           "median_total": statistics.median(s["total"] for s in spans),
           "median_critical": statistics.median(s["critical"] for s in spans),
           "critical": [s["critical"] for s in spans], "leases": [s["leases"] for s in spans],
           "total": [s["total"] for s in spans], "rl_iteration_runs": states,
           "writers": sorted(writing)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
