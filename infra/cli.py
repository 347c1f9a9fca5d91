"""The ``rlake`` command line: run, resume, status, sql (and lake maintenance); replay, lineage,
report, deploy, serve (infra/ops_cli.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.config import ConfigError, load_config
from infra.lake_cli import lake_app, sql_command

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rlake: RL post-training with a versioned trajectory lake.")
console = Console()
STATE = {"debug": False}
HomeOpt = Annotated[str, typer.Option("--home", help="state folder (lake, MLflow, checkpoints)")]


@app.callback()
def main_options(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    STATE["debug"] = debug


def _prepare(home: str, threads: int = 1) -> None:
    from infra.env import configure_environment

    configure_environment(home, threads)


@app.command()
def run(config: Annotated[Path | None, typer.Argument(help="YAML config")] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", help="override: key.sub=value")] = None,
        run_id: Annotated[str | None, typer.Option("--run-id")] = None) -> None:
    """Start a run: SFT warm-up, then RL iterations, each a Prefect flow run."""
    cfg = load_config(config, set_ or [])
    from infra.progress import run_with_progress

    summary = run_with_progress(cfg, run_id or cfg.run_id, resume=False, console=console,
                                debug=STATE["debug"])
    _print_summary(summary)


@app.command()
def resume(run_id: str, home: HomeOpt = "./rlake-home",
           lake_uri: Annotated[str | None, typer.Option("--lake", help="lake URI (default: HOME/lake)")] = None) -> None:
    """Continue RUN_ID from its last completed iteration (read from the lake)."""
    overrides = [f"home={home}"] + ([f"lake_uri={lake_uri}"] if lake_uri else [])
    cfg = load_config(None, overrides)
    from infra.startup import load_row, open_lake

    row = load_row(open_lake(cfg), cfg, run_id)
    if row.get("replay_of"):
        from infra.ops_cli import resume_replay

        _prepare(cfg.home, cfg.torch_threads)
        return resume_replay(row, cfg.home)
    from infra.progress import run_with_progress

    summary = run_with_progress(cfg, run_id, resume=True, console=console, debug=STATE["debug"])
    _print_summary(summary)


@app.command()
def status(run_id: Annotated[str | None, typer.Argument()] = None, home: HomeOpt = "./rlake-home",
           lake_uri: Annotated[str | None, typer.Option("--lake", help="lake URI (default: HOME/lake)")] = None) -> None:
    """List runs, or show one run's iterations, weight versions and evaluations."""
    from infra.status import show_status

    show_status(console, lake_uri or str(Path(home) / "lake"), run_id, home)


from infra.ops_cli import register as _register_ops  # noqa: E402 - replay, lineage, report, deploy, serve

_register_ops(app)


def _print_summary(summary: dict) -> None:
    home = summary["home"]
    console.print()
    console.rule("[bold]rlake run finished")
    acc = summary.get("accuracy", {})
    if acc:
        console.print(f"held-out greedy accuracy: before RL [bold]{acc['before']:.3f}[/]  ->  "
                      f"after RL [bold green]{acc['after']:.3f}[/]  ({acc['after'] - acc['before']:+.3f})")
    console.print(f"run id:       {summary['run_id']}")
    console.print(f"lake:         {summary['lake_uri']}")
    console.print(f"MLflow:       {summary['mlflow_uri']}")
    console.print(f"checkpoints:  {summary['checkpoints']}")
    console.print("\nlook at it:")
    console.print(f"  rlake status {summary['run_id']} --home {home}")
    console.print(f"  rlake sql \"SELECT iteration, avg(reward) AS reward FROM trajectories WHERE "
                  f"kind = 'train' GROUP BY 1 ORDER BY 1\" --lake {summary['lake_uri']}")
    console.print(f"  mlflow ui --backend-store-uri {summary['mlflow_uri']}   (then open http://127.0.0.1:5000)")
    console.print(f"  PREFECT_HOME={home}/prefect prefect server start   (then open http://127.0.0.1:4200)")


app.command("sql")(sql_command)
app.add_typer(lake_app, name="lake")


def main() -> None:
    try:
        app(standalone_mode=False)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        _fail(err)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: `rlake resume RUN_ID` continues from the last completed iteration")
        sys.exit(130)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except Exception as err:  # noqa: BLE001 - one clear line unless --debug
        _fail(err)


def _fail(err: BaseException) -> None:
    import click

    if isinstance(err, click.exceptions.ClickException):
        err.show()
        sys.exit(err.exit_code)
    if STATE["debug"] or "--debug" in sys.argv:
        console.print_exception()
    else:
        console.print(f"[bold red]error:[/] {err}  (--debug for the traceback)", soft_wrap=True)
    sys.exit(1)


if __name__ == "__main__":
    main()

