"""Held-out accuracy before/after RL for each advantage estimator, through the real pipeline.

Each estimator is one ``rlake run`` (``python -m infra.cli run configs/quickstart.yaml``) with
``--set trainer.advantage_estimator=<name>`` and its own home; the accuracy comes from the
run's ``evals`` table in the lake. To skip repeating the (identical, seeded) SFT warm-up, pass
``--model-path`` = the v0 checkpoint of a run with ``num_rollout=0`` (that checkpoint is the SFT
output): every run then starts from the same weights with ``sft.enabled=false``.

    python bench/estimators.py --iterations 40 --model-path /tmp/est-sft/runs/sft/checkpoints/v000000 \\
        --set ppo:trainer.critic_lr=0.001

Prints a markdown table and one JSON line. Never asserts on anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer import Lake  # noqa: E402
from trainers.algorithms import ADVANTAGE_ESTIMATORS  # noqa: E402


def run_one(name: str, estimator: str, iterations: int, home: Path, model_path: str | None,
            extra: list[str]) -> dict:
    sets = [f"home={home}", f"run_id={name}", f"num_rollout={iterations}",
            f"eval.eval_interval={max(iterations // 4, 1)}",
            f"trainer.advantage_estimator={estimator}"]
    if model_path:
        sets += [f"model.path={model_path}", "sft.enabled=false"]
    sets += extra
    cmd = [sys.executable, "-m", "infra.cli", "run", "configs/quickstart.yaml"]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "estimator": estimator, "error": proc.stderr[-2000:],
                "command": " ".join(cmd)}
    evals = Lake(str(home / "lake")).read("evals", run_id=name).to_pylist()
    acc = {e["weight_version"]: e["value"] for e in evals if e["metric"] == "accuracy"}
    return {"name": name, "estimator": estimator, "iterations": iterations,
            "before": acc.get(0), "after": acc.get(max(acc)), "curve": dict(sorted(acc.items())),
            "seconds": round(seconds, 1),
            "command": "python -m infra.cli run configs/quickstart.yaml "
                       + " ".join(f"--set {s}" for s in sets)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--estimators", default=",".join(ADVANTAGE_ESTIMATORS))
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--home-prefix", default="/tmp/est-")
    ap.add_argument("--model-path", default=None, help="start from this HF folder, no SFT")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="extra override for all runs (key=value) or one (estimator:key=value)")
    ap.add_argument("--tag", default="", help="suffix for run names/homes (variants)")
    args = ap.parse_args()
    rows = []
    for est in args.estimators.split(","):
        extra = [s.split(":", 1)[1] if ":" in s.split("=", 1)[0] else s for s in args.sets
                 if ":" not in s.split("=", 1)[0] or s.startswith(est + ":")]
        name = est + args.tag
        row = run_one(name, est, args.iterations, Path(f"{args.home_prefix}{name}"),
                      args.model_path, extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| estimator | iterations | accuracy before | accuracy after | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | - | - | error | - |")
        else:
            print(f"| {r['name']} | {r['iterations']} | {r['before']:.3f} | {r['after']:.3f} | "
                  f"{r['seconds']} |")
    print(json.dumps({"bench": "estimators", "rows": [
        {k: r.get(k) for k in ("name", "iterations", "before", "after", "seconds")} for r in rows]}))


if __name__ == "__main__":
    main()
