"""Live progress of a run in the terminal (rich), fed by the flows' reporter events."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.config import RunConfig


def accuracy_text(accuracy: float) -> str:
    """An eval accuracy as shown: NaN (every reward of the set failed, tasks/eval.py) is
    "none", not "nan" (the iteration line showed "acc nan")."""
    return "none" if accuracy != accuracy else f"{accuracy:.3f}"


class RichReporter:
    """Turns (event, payload) from the pipeline into two progress bars and a line per eval."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=console)
        self.sft_task = self.rl_task = None
        self.last_acc: float | None = None

    def __call__(self, event: str, p: dict) -> None:
        if event == "sft_start":
            self.sft_task = self.progress.add_task("SFT warm-up", total=p["steps"], info="")
        elif event == "sft_step" and self.sft_task is not None:
            acc = p.get("sft/train_accuracy")
            info = f"loss {p['sft/sft_loss']:.3f}" + ("" if acc is None else f" | train acc {acc:.3f}")
            self.progress.update(self.sft_task, completed=p["step"], info=info)
        elif event == "rl_start":
            self.rl_task = self.progress.add_task("RL iterations", total=p["total"],
                                                  completed=p["start"], info="")
        elif event == "eval" and p["accuracy"] is not None:  # None: no eval set (tasks/eval.py)
            self.last_acc = p["accuracy"]
            score = accuracy_text(p["accuracy"])
            score += " (its rewards failed)" if score == "none" else ""
            # ``iteration``: how many iterations trained the evaluated weights (the evals row's)
            done = f"{p['iteration']} iteration" + ("" if p["iteration"] == 1 else "s")
            self.console.print(f"  eval after {done}: held-out accuracy [bold]{score}[/]")
        elif event == "warning":
            self.console.print(f"  [yellow]warning:[/] {p['message']}")
        elif event == "reuse":
            self.console.print(f"  iteration {p['iteration']}: reusing its {p['samples']} samples "
                               "already in the lake (no generation)")
        elif event == "rebuild":
            self.console.print(f"  rebuilt weight version {p['from'] + len(p['iterations'])} from "
                               f"checkpoint v{p['from']}: re-trained iterations {p['iterations']} "
                               "on their samples in the lake (no generation)")
        elif event == "iteration" and self.rl_task is not None:
            if p.get("eval/accuracy") is not None:
                self.__call__("eval", {"iteration": p["iteration"] + 1, "accuracy": p["eval/accuracy"]})
            acc = "" if self.last_acc is None else f" | acc {accuracy_text(self.last_acc)}"
            # a replay generates nothing: no tokens/s
            speed = f" | {p['rollout/tokens_per_s']:.0f} tok/s" if p.get("rollout/tokens_per_s") else ""
            # a batch reused from the lake whose commit holds no rollout stats has no reward
            reward = f"{p['rollout/reward_mean']:.3f}" if "rollout/reward_mean" in p else "-"
            info = (f"reward {reward}{acc} | kl {p.get('train/ppo_kl', 0):.4f}"
                    f"{speed} | {p['time/total']:.2f} s/it")
            self.progress.update(self.rl_task, completed=p["iteration"] + 1, info=info)


def _no_prefect_errors_on_console(record: logging.LogRecord) -> bool:
    """Prefect's own error records (a failed flow's traceback): the CLI prints the error in one
    line, and the records still reach Prefect's API (the flow run's logs)."""
    return not (record.name.startswith("prefect") and record.levelno >= logging.ERROR)


def quiet_prefect_errors() -> None:
    """Keep Prefect's error tracebacks off the console (``--debug`` shows them)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(_no_prefect_errors_on_console)


@contextmanager
def live_display(console: Console, run_id: str, debug: bool) -> Iterator[None]:
    """Inside: the pipeline's events on a live display (``RichReporter``), Prefect's error
    tracebacks off the console unless ``debug``, and every flow run tagged with the run from
    its creation (a kill -9 at any moment leaves a flow run resume can find)."""
    from prefect import tags

    from flows.rl import set_reporter
    from infra.recovery import run_tag

    if not debug:
        quiet_prefect_errors()
    reporter = RichReporter(console)
    set_reporter(reporter)
    with reporter.progress, tags(run_tag(run_id)):
        yield


def run_with_progress(cfg: RunConfig, run_id: str | None, resume: bool, console: Console,
                      debug: bool = False, started: Callable[[str], None] | None = None,
                      num_rollout: int | None = None) -> dict:
    """Check, record and open the run (``infra.startup.prepared_run``: Prefect's server starts
    meanwhile), then run its flow with a live display; ``started(run_id)`` once the run holds
    its id (a new run's may be made up here), before anything of it is recorded: a Ctrl-C
    during start-up named ``rlake resume RUN_ID`` though the run was recorded under a made-up
    id the user never saw (review, 2026-11-29). ``num_rollout``: a resume's new run length
    (``infra.extend``)."""
    from infra.startup import new_run_id, prepared_run

    if not resume and run_id is None:
        run_id = cfg.run_id or new_run_id()
    if started is not None:
        started(run_id)
    with prepared_run(cfg, run_id, resume, num_rollout) as (run_id, run_cfg):
        from flows.rl import rl_run

        # the run's own config: a resume's ``cfg`` is the defaults with its home and lake, and
        # its flow runs showed seed 0 and relative paths in Prefect (review, 2026-11-29)
        with live_display(console, run_id, debug):
            summary = rl_run(run_cfg.model_dump(), run_id=run_id, resume=resume)
    summary["accuracy"] = accuracy_before_after(summary["lake_uri"], summary["run_id"], run_cfg)
    return summary


def replay_with_progress(cfg: RunConfig, source_run: str, run_id: str, iterations: str | None,
                         rescore: str | None, resume: bool, console: Console,
                         debug: bool = False) -> dict:
    """``rlake replay`` (or the resume of a replay run): as ``run_with_progress``, with
    ``infra.startup.prepared_replay`` and ``flows.replay.rl_replay``."""
    from infra.startup import prepared_replay

    with prepared_replay(cfg, run_id, resume):
        from flows.replay import rl_replay

        with live_display(console, run_id, debug):
            return rl_replay(source_run, cfg.model_dump(), run_id=run_id, iterations=iterations,
                             rescore=rescore, resume=resume)


def accuracy_before_after(lake_uri: str, run_id: str, cfg: RunConfig) -> dict:
    from buffer import Lake

    evals = Lake(lake_uri, cfg.storage_options or None).read("evals", run_id=run_id).to_pylist()
    acc = sorted((e["weight_version"], e["value"]) for e in evals if e["metric"] == "accuracy")
    return {"before": acc[0][1], "after": acc[-1][1]} if acc else {}


def rlake_invocation() -> str:
    """How to call this rlake without activating its virtualenv: the ``rlake`` script next to
    this interpreter (the venv's bin/), else this interpreter with ``-m infra.cli``."""
    script = Path(sys.executable).parent / "rlake"  # not resolved: the venv's bin, not the base
    if script.is_file():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m infra.cli"


def next_commands(summary: dict) -> list[str]:
    """Commands to look at a finished run, each runnable as printed from any folder."""
    rlake, run_id = rlake_invocation(), shlex.quote(summary["run_id"])
    home = shlex.quote(str(Path(summary["home"]).resolve()))
    lake_uri = str(summary["lake_uri"])
    if "://" not in lake_uri:  # a local lake given relative: absolute, for any folder
        lake_uri = str(Path(lake_uri).resolve())
    lake = shlex.quote(lake_uri)
    # a lake of its own (not HOME/lake): status and report read HOME/lake unless told
    own_lake = "" if lake_uri == str(Path(summary["home"]).resolve() / "lake") else f" --lake {lake}"
    # this run's rows only: a lake may hold other runs (replays, a shared lake). In double
    # quotes: a run id is letters, digits, '.', '_', '-' (config.check_run_id), nothing a shell
    # expands, and shlex's quoting of the SQL's own quotes was unreadable
    query = ('"SELECT iteration, avg(reward) AS reward FROM trajectories '
             f"WHERE run_id = '{summary['run_id']}' AND kind = 'train' GROUP BY 1 ORDER BY 1\"")
    return [f"{rlake} status {run_id} --home {home}{own_lake}",
            f"{rlake} sql {query} --lake {lake}",
            f"{rlake} report {run_id} --home {home}{own_lake} --out report.html",
            f"{rlake} ui mlflow --home {home}",
            f"{rlake} ui prefect --home {home}"]


def print_summary(console: Console, summary: dict) -> None:
    """The end-of-run summary. Commands are printed with ``soft_wrap``: rich never breaks one
    across lines (at 80 columns it did, mid-path), so a copy of the line is the whole command."""
    console.print()
    console.rule("[bold]rlake run finished")
    acc = summary.get("accuracy", {})
    if acc:
        console.print(f"held-out greedy accuracy: before RL [bold]{acc['before']:.3f}[/]  ->  "
                      f"after RL [bold green]{acc['after']:.3f}[/]  ({acc['after'] - acc['before']:+.3f})")
    for label, key in (("run id", "run_id"), ("lake", "lake_uri"), ("MLflow", "mlflow_uri"),
                       ("checkpoints", "checkpoints")):
        console.print(f"{label + ':':<13} {summary[key]}", soft_wrap=True, highlight=False, markup=False)
    console.print("\nlook at it:")
    for command in next_commands(summary):
        console.print(f"  {command}", soft_wrap=True, highlight=False, markup=False)
