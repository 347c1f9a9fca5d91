"""Multi-second stalls between iterations: run the quickstart's RL phase several times and, when
no iteration ends for ``--stall-s`` seconds, dump every thread of the run's process and of its
children (Prefect's server, the MLflow tracker, async mode's rollout process) while it lasts.

    python bench/stalls.py --checkpoint CKPT [--runs 6] [--iterations 150] [--set mode=async ...]

Found with it (2026-11-27, docs/operations.md, Async mode): about one iteration in ~900 ends
~60 s late, the training loop waiting for a Prefect request the embedded server answers only
after its SQLite busy timeout. Set ``PREFECT_SERVER_LOGGING_LEVEL=WARNING`` to see the server's
errors (Prefect's ephemeral server, started for the first run, writes to this process's output).

Prints a line per run, then one JSON line: the runs' slowest iteration gaps and where their
dumps are.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra.affinity import child_pids  # noqa: E402
from infra.env import configure_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def dump_all(folder: Path) -> None:
    """Every thread of this process (faulthandler) and of its children (``py-spy dump
    --locals``, where py-spy is installed) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "training_process.txt", "w") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    for pid in child_pids(os.getpid()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            dump = subprocess.run([py_spy, "dump", "--locals", "-p", str(pid)], capture_output=True,
                                  text=True, timeout=60)
            text = dump.stdout + dump.stderr
        except (OSError, subprocess.SubprocessError) as err:
            command, text = f"pid {pid}", repr(err)
        (folder / f"child-{pid}.txt").write_text(command + "\n\n" + text)


def one_run(home: Path, iterations: int, checkpoint: str, overrides: list[str], stall_s: float,
            dumps: Path) -> dict:
    """One run of ``iterations`` from ``checkpoint``; the gaps between iterations' ends."""
    from flows.rl import rl_run, set_reporter
    from infra.config import load_config

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"home={home}", f"num_rollout={iterations}", f"eval.eval_interval={iterations + 1}",
        f"model.path={checkpoint}", "sft.enabled=false", *overrides])
    configure_environment(home, cfg.torch_threads)
    ends: list[tuple[int, float]] = []
    done = threading.Event()
    stalls: list[str] = []

    def on_event(event: str, payload: dict) -> None:
        if event == "iteration":
            ends.append((payload["iteration"], time.monotonic()))

    def watch() -> None:
        dumped_after = None
        while not done.wait(0.5):
            if not ends or ends[-1][0] == dumped_after:
                continue
            iteration, when = ends[-1]
            if time.monotonic() - when > stall_s:
                dumped_after = iteration
                folder = dumps / f"after-{iteration}"
                dump_all(folder)
                stalls.append(str(folder))

    watcher = threading.Thread(target=watch, name="stall-watch", daemon=True)
    watcher.start()
    set_reporter(on_event)
    try:
        rl_run(cfg.model_dump(), run_id="stalls")
    finally:
        set_reporter(None)
        done.set()
        watcher.join()
    gaps = sorted(((b - a, i) for (_, a), (i, b) in zip(ends, ends[1:], strict=False)), reverse=True)
    return {"slowest": [[i, round(g, 3)] for g, i in gaps[:3]], "over_1s": sum(g > 1 for g, _ in gaps),
            "dumps": stalls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="an SFT checkpoint (HF folder)")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--stall-s", type=float, default=5.0,
                        help="no iteration for this long: dump every thread")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=None, help="folder for the dumps (default: a new one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="rlake-stalls-"))
    homes = Path(tempfile.mkdtemp(prefix="rlake-stalls-homes-"))  # Prefect's in the first one
    results = []
    try:
        for run in range(args.runs):
            results.append(one_run(homes / f"run-{run}", args.iterations, args.checkpoint,
                                   args.overrides, args.stall_s, out / f"run-{run}"))
            result = results[-1]
            print(f"run {run}: slowest gaps {result['slowest']}, over 1 s: {result['over_1s']}"
                  + (f", dumps: {result['dumps']}" if result["dumps"] else ""), flush=True)
    finally:
        shutil.rmtree(homes, ignore_errors=True)
    print(json.dumps({"bench": "stalls", "iterations": args.iterations, "runs": results,
                      "out": str(out)}))


if __name__ == "__main__":
    main()
