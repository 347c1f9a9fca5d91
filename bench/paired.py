"""Two configurations of one mode, in alternated pairs: how much faster is B than A, per iteration.

    python bench/paired.py --b pin_cores=false [--a key=value ...] [--mode async] [--pairs 8]
                           [--iterations 60] [--checkpoint PATH]

Whole ``bench/async.py`` invocations minutes apart differ by 10-20% on a shared 2-core host as
its speed drifts (docs/async-log.md, 2026-11-29 and 2026-12-01), so a lever of a few per cent
cannot be seen across them. Here both configurations run in one process, in pairs, the order
swapped each pair, each pair on the same seed (1, 2, 3 in turn), from one SFT checkpoint
(``bench/async.py``'s ``run_once``: the median gap between iteration ends). Prints each run,
then one JSON line: each side's median and the pairs' B/A ratios with their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from bench.served import embedded_prefect  # noqa: E402
from infra.env import configure_environment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", action="append", default=[], help="config override of side A")
    parser.add_argument("--b", action="append", default=[], help="config override of side B")
    parser.add_argument("--mode", choices=["sync", "async"], default="async")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--max-staleness", type=int, default=1, help="k in async mode")
    parser.add_argument("--checkpoint", type=Path, help="an SFT checkpoint (HF folder) to start from")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    args = parser.parse_args()
    home = Path(scratch_dir("rlake-bench-paired-")).resolve()
    with embedded_prefect(home):  # the server a run of the CLI has
        configure_environment(home)
        measure(args, home)


def measure(args: argparse.Namespace, home: Path) -> None:
    import importlib

    bench_async = importlib.import_module("bench.async")  # ``async`` is a keyword
    checkpoint = args.checkpoint or bench_async.warm_checkpoint(args.config, home / "warmup", [])
    sides = {"a": args.a, "b": args.b}
    medians: dict[str, list[float]] = {"a": [], "b": []}
    for pair in range(args.pairs):
        seed = 1 + pair % 3
        for side in ("ab" if pair % 2 == 0 else "ba"):
            run = bench_async.run_once(args.config, home / f"pair{pair}-{side}", checkpoint,
                                       args.mode, seed, args.iterations, args.max_staleness,
                                       sides[side])
            medians[side].append(run["s_per_iteration_median"])
            print(f"pair {pair} seed {seed} {side.upper()}: {run['s_per_iteration_median']:.4f} "
                  f"s/it", flush=True)
    ratios = [b / a for a, b in zip(medians["a"], medians["b"], strict=True)]
    print(json.dumps({"bench": "paired", "mode": args.mode, "a": args.a, "b": args.b,
                      "pairs": args.pairs, "iterations": args.iterations,
                      "checkpoint": str(checkpoint),
                      "a_s_per_iteration_median": statistics.median(medians["a"]),
                      "b_s_per_iteration_median": statistics.median(medians["b"]),
                      "b_over_a_pairs": [round(r, 4) for r in ratios],
                      "b_over_a_median": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
