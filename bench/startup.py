"""Startup to the first RL iteration, measured from outside through the real CLI.

    python bench/startup.py [--repo PATH] [--repeats 3] [--held-out 500] [--running-server]
                            [--set key=value ...]

A short SFT run makes a checkpoint once; then each repeat starts ``rlake run`` from it
(``model.path``, SFT off, one RL iteration) on a fresh home and measures

    startup = (start of iteration 0) - (moment the command was launched)

where the start of iteration 0 is its ``train_steps`` row's ``created_at`` minus the phases it
records before it (``timings``), and

    first step = (iteration 0's commit) - (launch)

which compares across modes (async mode's iteration 0 starts by waiting for the rollout
process's first batch: its ``wait_rollout`` phase). ``--set`` overrides every RL run's config
(e.g. ``--set mode=async --set trainer.max_staleness=1``). ``--repo`` runs another checkout's code (e.g. the old one, for a ratio
measured on the same machine at the same time). ``--running-server`` also measures, alternating
with the default, runs pointed at a Prefect server already running (``PREFECT_API_URL``, as a
cluster profile or a running ``prefect server start`` gives): no server start on their path.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SMALL = ["--set", "rollout.rollout_batch_size=32", "--set", "rollout.n_samples_per_prompt=8"]


def rlake(repo: Path, args: list[str], home: Path, api_url: str | None = None) -> float:
    """Run the CLI from ``repo`` (against the server at ``api_url``, if given, else its own
    embedded one); returns the launch time (epoch seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(PYTHONPATH=str(repo), OMP_NUM_THREADS="1", PREFECT_HOME=str(home / "prefect"),
               # a loaded machine: the old code's embedded server gave up after 120 s here
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="900")
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"rlake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return start


def first_iteration(home: Path, run_id: str) -> tuple[float, float]:
    """(start, commit) of iteration 0, epoch seconds."""
    sys.path.insert(0, str(HERE))
    from buffer import Lake

    row = [r for r in Lake(str(home / "lake")).read("train_steps", run_id=run_id).to_pylist()
           if r["iteration"] == 0][0]
    committed = row["created_at"].replace(tzinfo=UTC).timestamp()
    return committed - sum(json.loads(row["timings"]).values()), committed


@contextmanager
def running_server(tmp: Path, wanted: bool) -> Iterator[str | None]:
    """A Prefect server (``prefect server start``, its own state folder) for the runs that
    measure startup against a running one; stopped at the end."""
    if not wanted:
        yield None
        return
    sys.path.insert(0, str(HERE))
    from infra.env import set_environment
    from infra.prefect_server import ensure_server, stop_server

    set_environment(tmp / "server-home")
    try:
        yield ensure_server(tmp / "server-home")
    finally:
        stop_server(tmp / "server-home")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=HERE)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--held-out", type=int, default=500)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--running-server", action="store_true",
                    help="also measure runs against a Prefect server started beforehand")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="config override for every RL run, e.g. mode=async")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp), args.running_server) as url:
        base = Path(tmp) / "sft-home"
        rlake(args.repo, ["run", "configs/quickstart.yaml", "--run-id", "sft", "--set", f"home={base}",
                          "--set", "num_rollout=0", "--set", f"sft.steps={args.sft_steps}",
                          "--set", "sft.stop_at_accuracy=null",
                          "--set", f"data.held_out_size={args.held_out}"], base)
        ckpt = base / "runs" / "sft" / "checkpoints" / "v000000"
        startups: dict[str | None, list[float]] = {None: [], url: []} if url else {None: []}
        first_steps: list[float] = []
        overrides = [x for o in args.overrides for x in ("--set", o)]
        for i in range(args.repeats):
            for server in startups:  # alternated: the same machine state for both
                name = f"rl{i}{'-running' if server else ''}"
                home = Path(tmp) / f"home-{name}"
                launched = rlake(args.repo, [
                    "run", "configs/quickstart.yaml", "--run-id", name, "--set", f"home={home}",
                    "--set", f"model.path={ckpt}", "--set", "sft.enabled=false",
                    "--set", "num_rollout=1", "--set", f"data.held_out_size={args.held_out}",
                    *SMALL, *overrides], home, server)
                start, committed = first_iteration(home, name)
                startups[server].append(start - launched)
                if server is None:
                    first_steps.append(committed - launched)
    embedded = startups[None]
    extra = {}
    if url:
        extra = {"startup_running_server_s": [round(s, 2) for s in startups[url]],
                 "median_startup_running_server_s": round(statistics.median(startups[url]), 2)}
    print(json.dumps({"repo": str(args.repo), "startup_s": [round(s, 2) for s in embedded],
                      "median_startup_s": round(statistics.median(embedded), 2),
                      "first_step_s": [round(s, 2) for s in first_steps],
                      "median_first_step_s": round(statistics.median(first_steps), 2),
                      "overrides": args.overrides, **extra,
                      "note": "fresh home each repeat (its Prefect database copied from the "
                              "template the SFT run left in the cache, infra/prefect_db.py); "
                              "includes the initial held-out evaluation"}))


if __name__ == "__main__":
    main()
