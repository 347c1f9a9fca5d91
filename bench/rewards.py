"""Cost of scoring a batch with a cheap custom reward: in threads vs in worker processes.

A ``custom_rm_path`` function runs in worker processes (``rewards/workers.py``) so a call past
``reward_timeout_s`` can be killed. This measures what that costs for a cheap reward: the same
batch scored by ``run_concurrently`` (threads, the old way) and by ``RewardWorkers`` (warm
processes: started before the timed rounds, as they are after a run's first iteration), and the
built-in ``countdown`` reward in threads for scale.

    python bench/rewards.py --samples 256 --rounds 5 --workers 8

Prints a markdown table and one JSON line (median seconds per batch, and the ratio
process/thread). Never asserts on anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.concurrent import run_concurrently  # noqa: E402
from rewards.registry import Scorer  # noqa: E402
from rewards.workers import RewardWorkers  # noqa: E402
from rollout.sample import Sample  # noqa: E402

CHEAP = "bench.rewards:cheap_reward"


def cheap_reward(cfg, sample) -> float:
    """A custom reward as cheap as the built-in exact match."""
    return float(sample.response.strip() == (sample.label or ""))


def _samples(n: int) -> list[Sample]:
    return [Sample(group_index=i // 8, index=i, prompt="1+2=", prompt_token_ids=[1, 2, 3], label="3",
                   response=str(i % 4), metadata={"numbers": [3, 5, 7], "target": 22})
            for i in range(n)]


def _median(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    samples = _samples(args.samples)
    threads = _median(lambda: run_concurrently([partial(cheap_reward, None, s) for s in samples],
                                               30.0, args.workers), args.rounds)
    pool = RewardWorkers(CHEAP, None, args.workers)
    try:
        start = time.perf_counter()
        pool.map(samples[:args.workers], 120.0)  # start the workers (not timed per batch)
        startup = time.perf_counter() - start
        processes = _median(lambda: pool.map(samples, 30.0), args.rounds)
    finally:
        pool.close()
    countdown = Scorer(rm_type="countdown", max_workers=args.workers)
    builtin = _median(lambda: countdown.outcomes(samples, 30.0, args.workers), args.rounds)
    rows = {"custom, threads": threads, "custom, worker processes": processes,
            "countdown (built-in), threads": builtin}
    print(f"| {args.samples} samples, {args.workers} workers | median s/batch | per sample (ms) |")
    print("|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.4f} | {1000 * seconds / args.samples:.3f} |")
    print(f"worker start-up (once per run): {startup:.2f} s")
    print(json.dumps({"samples": args.samples, "workers": args.workers, "threads_s": threads,
                      "processes_s": processes, "builtin_threads_s": builtin,
                      "startup_s": startup, "ratio_process_over_thread": processes / threads}))


if __name__ == "__main__":
    main()
