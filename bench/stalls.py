"""Multi-second stalls between iterations: run the quickstart's RL phase several times and, when
no iteration ends for ``--stall-s`` seconds, dump every thread of the run's process and of its
children (Prefect's server, the MLflow tracker, async mode's rollout process) while it lasts:
each thread's state as the kernel sees it (three samples 1 s apart: CPU ticks, ``wchan``, kernel
stack), then the Python stacks.

    python bench/stalls.py --checkpoint CKPT [--runs 6] [--iterations 150] [--set mode=async ...]

Found with it (2026-11-27, docs/async-log.md): about one iteration in ~1000 ended
~60-75 s late, the training loop waiting for a Prefect request the server did not answer for
that long: its event loop was blocked freeing an errored aiosqlite cursor whose connection
waited in SQLite's busy handler (fixed in infra/prefect_app.py; no gap over 1 s in 40 runs
since, at Prefect's own 60 s busy timeout).
The runs share one embedded server, as a run of the CLI has (``infra.prefect_server``; its
log is ``prefect/embedded-server.log`` in the homes' folder, removed at the end; set
``PREFECT_SERVER_LOGGING_LEVEL=WARNING`` to see its errors there).

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

from bench.served import embedded_prefect  # noqa: E402
from infra.affinity import child_pids  # noqa: E402
from infra.env import configure_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def thread_states(pids: list[int]) -> str:
    """Each thread of ``pids`` as the kernel sees it: state (R running, S sleeping, D in I/O),
    user and system CPU ticks, where it sleeps (``wchan``) and its kernel stack (as root). A
    Python stack alone cannot tell a thread that computes from one the kernel holds."""
    lines = []
    for pid in pids:
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                name = (task / "comm").read_text().strip()
                wchan = (task / "wchan").read_text().strip()
                try:
                    stack = (task / "stack").read_text().strip().replace("\n", " | ")
                except OSError:
                    stack = "-"
            except OSError:
                continue
            lines.append(f"{pid}/{task.name} {name!r} state {fields[0]} utime {fields[11]} "
                         f"stime {fields[12]} wchan {wchan} stack {stack}")
    return "\n".join(lines) + "\n"


def dump_all(folder: Path) -> None:
    """Every thread of this process (faulthandler) and of its children (``thread_states``, then
    5 s of ``py-spy record``, ``py-spy dump --native`` and ``--locals``, where py-spy is installed) into
    ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "training_process.txt", "w") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
    pids = [os.getpid(), *child_pids(os.getpid())]
    with open(folder / "kernel_threads.txt", "w") as out:
        for sample in range(3):  # 1 s apart: whose CPU ticks grow while nothing is answered
            out.write(f"-- sample {sample}\n" + thread_states(pids))
            out.flush()
            time.sleep(1.0)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    records = [subprocess.Popen([py_spy, "record", "--duration", "5", "--rate", "50", "--format", "raw",
                                 "--output", str(folder / f"record-{pid}.txt"), "--pid", str(pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for pid in pids[1:]]  # where each child's time goes while nothing is answered
    for record in records:
        record.wait(timeout=60)
    for pid in pids[1:]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            text = ""
            for how in ("--native", "--locals"):  # C frames (a lock, a sleep), then Python's
                dump = subprocess.run([py_spy, "dump", how, "-p", str(pid)], capture_output=True,
                                      text=True, timeout=60)
                text += f"== py-spy dump {how}\n" + dump.stdout + dump.stderr
        except (OSError, subprocess.SubprocessError) as err:
            command, text = f"pid {pid}", repr(err)
        (folder / f"child-{pid}.txt").write_text(command + "\n\n" + text)


def one_run(home: Path, iterations: int, checkpoint: str, overrides: list[str], stall_s: float,
            dumps: Path) -> dict:
    """One run of ``iterations`` from ``checkpoint``; the gaps between iterations' ends."""
    from infra.config import load_config

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"home={home}", f"num_rollout={iterations}", f"eval.eval_interval={iterations + 1}",
        f"model.path={checkpoint}", "sft.enabled=false", *overrides])
    configure_environment(home, cfg.torch_threads)
    from flows.rl import rl_run, set_reporter  # after: Prefect reads its settings at import

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
    homes = Path(tempfile.mkdtemp(prefix="rlake-stalls-homes-"))
    results = []
    try:
        with embedded_prefect(homes):  # the server a run of the CLI has, shared by the runs
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
