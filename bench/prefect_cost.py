"""What one iteration's Prefect flow run costs, under different server settings.

    python bench/prefect_cost.py [--iterations 60] [--rounds 2]

Each configuration runs in its own process (Prefect reads its settings at import) with its own
embedded server: a flow ``rl_iteration`` calling 6 tasks that do nothing, as many times as
``--iterations``, with the per-flow-run heartbeat off (as flows/rl.py runs). Configurations are
interleaved over ``--rounds`` so that load drifts hit them alike. Prints per configuration the
median, 90th percentile and max seconds per flow run and how many took over 1 s (the ~2 s
stalls: the server's SQLite answers 503 on a write collision and the client retries after
2**n s), then one JSON line. Compare configurations within one invocation, never across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402

CONFIGS: dict[str, dict[str, str]] = {
    # infra/env.py's OFFLINE_ENV before async mode's change
    "batched_writers": {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
                        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true"},
    # + no automations engine (rlake defines no automations): fewer reads/writes per event
    "no_triggers": {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
                    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true"},
    # + events not stored (flow and task runs still are): the main writer colliding with the
    # client's state writes
    "no_triggers_no_event_store": {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
                                   "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false"},
}


def measure(iterations: int) -> list[float]:
    """In this process: ``iterations`` flow runs of 6 no-op tasks; seconds each."""
    import time

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.settings import temporary_settings

    @task(cache_policy=NO_CACHE)
    def step(i: int) -> int:
        return i

    @flow(name="rl_iteration")
    def iteration(i: int) -> int:
        return sum(step(j) for j in range(6)) + i

    @flow(name="rl_run")
    def run() -> list[float]:
        out = []
        for i in range(iterations + 1):
            start = time.perf_counter()
            iteration(i)
            out.append(time.perf_counter() - start)
        return out[1:]  # the first pays one-off set-up

    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        return run()


def run_config(name: str, iterations: int) -> list[float]:
    from infra.env import OFFLINE_ENV

    home = scratch_dir(f"rlake-prefect-{name}-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({**OFFLINE_ENV, **CONFIGS[name], "PREFECT_HOME": f"{home}/prefect",
                "PYTHONPATH": str(ROOT), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"})
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from bench.prefect_cost import measure; print('RESULT', json.dumps(measure({iterations})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{name}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(line[0][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in args.configs}
    for _ in range(args.rounds):
        for name in args.configs:
            times[name] += run_config(name, args.iterations)
    out = {}
    for name, t in times.items():
        t = sorted(t)
        out[name] = {"median_s": statistics.median(t), "p90_s": t[int(0.9 * (len(t) - 1))],
                     "max_s": t[-1], "over_1s": sum(x > 1.0 for x in t), "n": len(t)}
        print(f"{name:28s} median {out[name]['median_s']:.3f} s  p90 {out[name]['p90_s']:.3f} s  "
              f"max {out[name]['max_s']:.2f} s  over 1 s: {out[name]['over_1s']}/{len(t)}")
    print(json.dumps({"bench": "prefect_cost", "iterations": args.iterations,
                      "rounds": args.rounds, "configs": out}))


if __name__ == "__main__":
    main()
