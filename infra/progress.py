"""Live progress of a run in the terminal (rich), fed by the flows' reporter events."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infra.config import RunConfig


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
        elif event == "eval":
            self.last_acc = p["accuracy"]
            self.console.print(f"  eval after iteration {p['iteration']}: held-out accuracy "
                               f"[bold]{p['accuracy']:.3f}[/]")
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
            if "eval/accuracy" in p:
                self.__call__("eval", {"iteration": p["iteration"] + 1, "accuracy": p["eval/accuracy"]})
            acc = "" if self.last_acc is None else f" | acc {self.last_acc:.3f}"
            info = (f"reward {p['rollout/reward_mean']:.3f}{acc} | kl {p.get('train/ppo_kl', 0):.4f}"
                    f" | {p['rollout/tokens_per_s']:.0f} tok/s | {p['time/total']:.2f} s/it")
            self.progress.update(self.rl_task, completed=p["iteration"] + 1, info=info)


def run_with_progress(cfg: RunConfig, run_id: str | None, resume: bool, console: Console) -> dict:
    from flows.rl import rl_run, set_reporter

    reporter = RichReporter(console)
    set_reporter(reporter)
    console.print("[dim]starting Prefect's embedded server and the run (first start takes ~10-30 s)[/]")
    with reporter.progress:
        summary = rl_run(cfg.model_dump(), run_id=run_id, resume=resume)
    summary["accuracy"] = accuracy_before_after(summary["lake_uri"], summary["run_id"], cfg)
    return summary


def accuracy_before_after(lake_uri: str, run_id: str, cfg: RunConfig) -> dict:
    from buffer import Lake

    evals = Lake(lake_uri, cfg.storage_options or None).read("evals", run_id=run_id).to_pylist()
    acc = sorted((e["weight_version"], e["value"]) for e in evals if e["metric"] == "accuracy")
    return {"before": acc[0][1], "after": acc[-1][1]} if acc else {}
