"""Sync vs async: a job's RL phase (the quickstart's, or `--config`) from one SFT checkpoint, per seed.

    python bench/async.py [--iterations 100] [--seeds 1 2 3] [--rounds 1] [--max-staleness 1]
                          [--checkpoint PATH] [--config configs/gpu.yaml] [--set key=value ...]

Without ``--checkpoint`` it first runs the config's SFT warm-up once (``num_rollout=0``).
Each (seed, mode) run starts from that checkpoint (``sft.enabled=false``), evaluates held-out
greedy accuracy at the start and the end only, and is timed from the run's own progress events:
s/iteration is the median gap between consecutive iterations' ends (iteration 0, which pays
the rollout process's first batch, is left out), the RL wall runs from the start of the RL phase
to the last iteration's end. Prints one line per run, then one JSON line.
Timings on a shared machine are noisy: compare the two modes within one invocation. Each seed's
sync and async runs are a pair, run back to back; ``--rounds N`` runs the seeds N times, the
order within each pair swapped every round, and the JSON line adds each pair's async/sync and
their median, which the host's drift moves less than the ratio of the two modes' medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scratch import scratch_dir  # noqa: E402
from bench.served import embedded_prefect  # noqa: E402
from infra.env import configure_environment  # noqa: E402


def warm_checkpoint(config: Path, home: Path, overrides: list[str]) -> Path:
    """The config's SFT warm-up alone (or the one ``home`` holds already); returns its weight
    version 0."""
    from flows.rl import rl_run
    from infra.config import load_config

    checkpoint = home / "runs" / "warmup" / "checkpoints" / "v000000"
    if not (checkpoint / "config.json").exists():
        cfg = load_config(config, [f"home={home}", "num_rollout=0", *overrides])
        rl_run(cfg.model_dump(), run_id="warmup")
    return checkpoint


def run_once(config: Path, home: Path, checkpoint: Path, mode: str, seed: int, iterations: int,
             k: int, overrides: list[str]) -> dict:
    """One RL phase; returns its figures (see the module docstring)."""
    from buffer import Lake
    from flows import rl
    from infra.config import load_config

    run_id = f"{mode}-s{seed}"
    cfg = load_config(config, [
        f"home={home}", f"model.path={checkpoint}", "sft.enabled=false", f"seed={seed}",
        f"num_rollout={iterations}", f"eval.eval_interval={iterations}", f"mode={mode}",
        f"trainer.max_staleness={k if mode == 'async' else 0}", *overrides])
    events: list[tuple[str, float]] = []
    rl.set_reporter(lambda event, payload: events.append((event, time.perf_counter())))
    start = time.perf_counter()
    try:
        rl.rl_run(cfg.model_dump(), run_id=run_id)
    finally:
        rl.set_reporter(None)
    total = time.perf_counter() - start
    rl_start = next(t for e, t in events if e == "rl_start")
    ends = [t for e, t in events if e == "iteration"]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    lake = Lake(cfg.resolved_lake_uri)
    acc = sorted((e["weight_version"], e["value"]) for e in lake.read("evals", run_id=run_id).to_pylist()
                 if e["metric"] == "accuracy" and e["dataset"] == "held_out")
    steps = lake.read("train_steps", run_id=run_id,
                      columns=["n_samples", "staleness_mean", "staleness_max"]).to_pylist()
    wall = ends[-1] - rl_start
    return {"mode": mode, "seed": seed, "iterations": len(ends),
            "s_per_iteration_median": statistics.median(gaps) if gaps else None,
            "rl_wall_s": wall, "run_wall_s": total,
            "samples_per_s": sum(s["n_samples"] for s in steps) / wall,
            "accuracy_start": acc[0][1], "accuracy_end": acc[-1][1],
            "staleness_mean": statistics.fmean(s["staleness_mean"] for s in steps),
            "staleness_max": max(s["staleness_max"] for s in steps)}


def summarize(runs: list[dict]) -> dict:
    """Per mode: the median over seeds of each figure; and async/sync of s/iteration."""
    out: dict = {}
    for mode in ("sync", "async"):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {key: statistics.median(r[key] for r in mine)
                     for key in ("s_per_iteration_median", "samples_per_s", "rl_wall_s",
                                 "accuracy_start", "accuracy_end", "staleness_mean",
                                 "staleness_max")}
        out[mode]["accuracy_end_per_seed"] = [r["accuracy_end"] for r in mine]
    out["async_over_sync_s_per_iteration"] = (out["async"]["s_per_iteration_median"]
                                              / out["sync"]["s_per_iteration_median"])
    pairs = pair_ratios(runs)
    out["async_over_sync_pairs"] = [round(r, 4) for r in pairs]
    out["async_over_sync_pairs_median"] = statistics.median(pairs) if pairs else None
    return out


def pair_ratios(runs: list[dict]) -> list[float]:
    """async/sync s/iteration of each (round, seed) pair, in run order."""
    pairs: dict[tuple[int, int], dict[str, float]] = {}
    for r in runs:
        pairs.setdefault((r["round"], r["seed"]), {})[r["mode"]] = r["s_per_iteration_median"]
    return [p["async"] / p["sync"] for p in pairs.values() if p.get("sync") and p.get("async")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the seeds this many times, each pair's order swapped per round")
    parser.add_argument("--max-staleness", type=int, default=1, help="k for the async runs")
    parser.add_argument("--checkpoint", type=Path, help="an SFT checkpoint (HF folder) to start from")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml",
                        help="the job (default: the quickstart; configs/gpu.yaml on a GPU)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override for every run, e.g. rollout.rollout_batch_size=16")
    parser.add_argument("--home", type=Path, help="a new state folder, kept (default: a temporary one, removed at the end; a run id is never reused)")
    args = parser.parse_args()
    home = Path(args.home or scratch_dir("rlake-bench-async-")).resolve()
    with embedded_prefect(home):  # the server a run of the CLI has
        configure_environment(home)
        measure(args, home)


def measure(args: argparse.Namespace, home: Path) -> None:
    """The runs of ``main``'s arguments, one line each, then the JSON line."""
    checkpoint = args.checkpoint or warm_checkpoint(args.config, home / "warmup",
                                                    args.overrides)
    runs = []
    for rnd in range(args.rounds):
        for seed in args.seeds:
            # alternated, so load drifts hit both modes alike; the order swapped each round
            for mode in ("sync", "async") if rnd % 2 == 0 else ("async", "sync"):
                r = {**run_once(args.config, home / f"r{rnd}-{mode}-s{seed}", checkpoint, mode, seed,
                                args.iterations, args.max_staleness, args.overrides), "round": rnd}
                runs.append(r)
                _print_run(r)
    print(json.dumps({"bench": "async", "config": str(args.config),
                      "iterations": args.iterations, "seeds": args.seeds, "rounds": args.rounds,
                      "max_staleness": args.max_staleness, "checkpoint": str(checkpoint),
                      **summarize(runs), "runs": runs}))


def _print_run(r: dict) -> None:
    print(f"{r['mode']:5s} seed {r['seed']}: {r['s_per_iteration_median']:.3f} s/it, "
          f"{r['samples_per_s']:.0f} samples/s, RL wall {r['rl_wall_s']:.1f} s, accuracy "
          f"{r['accuracy_start']:.3f} -> {r['accuracy_end']:.3f}, staleness mean "
          f"{r['staleness_mean']:.2f} max {r['staleness_max']:.0f}", flush=True)


if __name__ == "__main__":
    main()
