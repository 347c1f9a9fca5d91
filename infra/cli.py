"""The ``rlake`` command line: run, resume, status, sql (and lake maintenance); replay, lineage,
report, deploy, serve (infra/ops_cli.py)."""

# ruff: noqa: E402 - the third-party and rlake imports come after the Ctrl-C guard (_guard_imports)
from __future__ import annotations

import errno
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated


def _interrupted_while_importing(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler
    """Ctrl-C while this module imports (typer, rich, the lake: about a second), before ``main``
    handles it: the line and exit status of a later Ctrl-C, not a traceback (review, 2026-11-29).
    SystemExit, not KeyboardInterrupt: nothing on the way out prints it."""
    print("interrupted", flush=True)
    raise SystemExit(130)


def _guard_imports() -> Callable[[int, object], object] | int | None:
    """Install ``_interrupted_while_importing`` in place of Python's own Ctrl-C handler (another,
    or an ignored SIGINT, is left alone); returns the handler to put back (None: nothing to)."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            return signal.signal(signal.SIGINT, _interrupted_while_importing)
    except ValueError:  # imported outside the main thread: signals cannot be set there
        pass
    return None


_SIGINT_BEFORE_IMPORTS = _guard_imports()

import typer
from rich.console import Console
from rich.markup import escape

from infra import quick_exit
from infra.config import load_config
from infra.lake_cli import check_lake, lake_app, sql_command, without_backtrace
from infra.ui_cli import ui_command

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="rlake: RL post-training with a versioned trajectory lake.")
console = Console()
err_console = Console(stderr=True)
STATE = {"debug": False}
HomeOpt = Annotated[str, typer.Option("--home", help="state folder (lake, MLflow, checkpoints)")]


@app.callback()
def main_options(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    STATE["debug"] = debug


@app.command()
def run(config: Annotated[Path | None, typer.Argument(help="YAML config")] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", help="override: key.sub=value")] = None,
        run_id: Annotated[str | None, typer.Option("--run-id")] = None) -> None:
    """Start a run: SFT warm-up, then RL iterations, each a Prefect flow run."""
    cfg = load_config(config, set_ or [])
    from infra.progress import run_with_progress

    # `is not None`: --run-id "" (an unset $ID) is refused, not taken as no id (review, 2026-11-29)
    summary = run_with_progress(cfg, run_id if run_id is not None else cfg.run_id, resume=False,
                                console=console, debug=STATE["debug"], started=_resumable(cfg))
    _print_summary(summary)


@app.command()
def resume(run_id: str, home: HomeOpt = "./rlake-home",
           lake_uri: Annotated[str | None, typer.Option("--lake", help="lake URI (default: HOME/lake)")] = None,
           num_rollout: Annotated[int | None, typer.Option(
               "--num-rollout", help="train to N iterations from now on (recorded with the run; "
                                     "at least its committed ones)")] = None,
           set_: Annotated[list[str] | None, typer.Option("--set", hidden=True)] = None) -> None:
    """Continue RUN_ID from its last completed iteration (read from the lake); --num-rollout N
    trains a finished run further (or stops an unfinished one earlier)."""
    if set_:  # taken only to say why: "No such option: --set" read as a typo (review, 2026-11-29)
        raise ValueError(f"--set {set_[0]}: a run's settings are fixed at its record (a resume "
                         "reads them from the lake); only its length may change (--num-rollout). "
                         "To train with other settings start a new run, or `rlake replay "
                         f"{run_id} --set ...` to train them on its recorded trajectories")
    overrides = [f"home={home}"] + ([f"lake_uri={lake_uri}"] if lake_uri else [])
    cfg = load_config(None, overrides)
    from infra.startup import load_row, open_lake

    row = load_row(open_lake(cfg), cfg, run_id)
    if row.get("replay_of"):
        if num_rollout is not None:
            from infra.extend import set_num_rollout

            set_num_rollout(None, run_id, row, num_rollout)  # refused: a replay's length is its source's
        from infra.ops_cli import resume_replay

        return resume_replay(row, cfg.home, debug=STATE["debug"])
    from infra.progress import run_with_progress

    summary = run_with_progress(cfg, run_id, resume=True, console=console, debug=STATE["debug"],
                                started=_resumable(cfg), num_rollout=num_rollout)
    _print_summary(summary)


def _resumable(cfg) -> Callable[[str], None]:
    """What remembers how to resume the run once it has its id: an interrupt names it."""
    def started(run_id: str) -> None:
        from infra.startup import resume_command

        STATE["resume_command"] = resume_command(run_id, cfg)
    return started


@app.command()
def status(run_id: Annotated[str | None, typer.Argument()] = None,
           home: Annotated[str | None, typer.Option(
               "--home", help="state folder (lake, MLflow, checkpoints) [default: ./rlake-home]")] = None,
           lake_uri: Annotated[str | None, typer.Option("--lake", help="lake URI (default: HOME/lake)")] = None) -> None:
    """List runs, or show one run's iterations, weight versions and evaluations."""
    from infra.status import show_status

    if lake_uri is None:
        home = home or "./rlake-home"
        if not Path(home).is_dir():  # not "no runs": a typo in the path
            raise ValueError(f"no rlake home at {home} (--home): the folder does not exist")
    else:  # as `sql --lake`: a typo (or a home) read as a lake of no runs
        check_lake(lake_uri)
    # --lake alone: no home, so no run folder whose lock tells a live run from a killed one
    show_status(console, lake_uri or str(Path(home) / "lake"), run_id, home)


from infra.ops_cli import register as _register_ops  # noqa: E402 - replay, lineage, report, deploy, serve

_register_ops(app, debug=lambda: STATE["debug"])


def _print_summary(summary: dict) -> None:
    from infra.progress import print_summary

    print_summary(console, summary)


app.command("sql")(sql_command)
app.command("ui")(ui_command)
app.add_typer(lake_app, name="lake")


# the exit status a shell reports for a tool that a closed pipe stopped (`rlake status | head -1`)
PIPE_CLOSED = 128 + signal.SIGPIPE


def main() -> None:
    """The console script: every failure exits non-zero (2 usage / refused input, 1 other errors,
    130 Ctrl-C); one ``error:`` line, the traceback only with ``--debug``. Output into a pipe
    closed early (``| head -1``) stops the command quietly, as a Unix tool: exit status 141."""
    from infra.interrupts import note_interrupts

    note_interrupts()
    Console.on_broken_pipe = _raise_broken_pipe
    try:
        code = _run_command()
        if code == 130:
            _interrupted()
    except BrokenPipeError:  # the error or "interrupted" line met the closed pipe (Ctrl-C ends `| tee` too)
        code = PIPE_CLOSED
    quick_exit.exit_code = code
    sys.exit(code)


def _run_command() -> int:
    """Run the command line's command; its exit code."""
    try:
        # standalone_mode=False hands back ``typer.Exit`` codes (and Ctrl-C as 130) as the return
        # value instead of exiting: an ignored return value is how failures used to exit 0.
        return exit_code(app(standalone_mode=False))
    except KeyboardInterrupt:
        return 130
    except typer.Exit as exit_:
        return exit_.exit_code
    except SystemExit as exit_:
        if _stopped_by_closed_pipe(exit_):
            return PIPE_CLOSED
        raise
    except Exception as err:  # noqa: BLE001 - one clear line unless --debug
        # a Ctrl-C that landed inside Prefect's engine can come out as another error
        # ("Task run is not set"): still an interrupt
        from infra.interrupts import interrupt_noted

        return 130 if interrupt_noted() else _fail(err)


def _raise_broken_pipe(console: Console) -> None:  # noqa: ARG001 - rich's hook signature
    """rich's hook for a write into a closed pipe (``Console.on_broken_pipe``, documented to be
    replaced): its own exits 1 at once; raised instead, as by ``print`` and ``typer.echo``, the
    error reaches typer's handling of a closed pipe (``_stopped_by_closed_pipe``)."""
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def _stopped_by_closed_pipe(exit_: SystemExit) -> bool:
    """Whether typer ended the command because its output pipe closed: it exits 1 then, with
    sys.stdout wrapped in click's PacifyFlushWrapper (quiet flushes at exit; typer/core.py)."""
    return exit_.code == 1 and "PacifyFlushWrapper" in type(sys.stdout).__name__


def exit_code(result: object) -> int:
    """The process exit code for what ``app(standalone_mode=False)`` returned: an int is an exit
    code (from ``typer.Exit``); a command's ordinary return value (None, data) is success."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _command_name() -> str:
    """The command given (``run``, ``status``...): the first argument that is not an option."""
    return next((a for a in sys.argv[1:] if not a.startswith("-")), "")


def _interrupted() -> None:
    command = _command_name()
    resume = STATE.get("resume_command", "rlake resume RUN_ID")  # RUN_ID: stopped before it had one
    hint = (f": `{escape(resume)}` continues from the last completed iteration"
            if command in ("run", "resume") else "")
    # soft_wrap: the command stays on one line, to be copied as it is
    console.print(f"[yellow]interrupted[/]{hint}", soft_wrap=True, highlight=False)


def _click_errors(name: str) -> tuple[type, ...]:
    """``name`` from click, typer, and the copy of click that typer ships (what typer raises)."""
    import click
    import typer.exceptions

    try:
        from typer._click import exceptions as typer_click
    except ImportError:  # a typer without its own click
        typer_click = click.exceptions
    found = (getattr(m, name, None) for m in (click.exceptions, typer.exceptions, typer_click))
    return tuple(c for c in found if isinstance(c, type))


def _fail(err: BaseException) -> int:
    if isinstance(err, _click_errors("Abort")):  # click's name for Ctrl-C / EOF at a prompt
        return 130
    if isinstance(err, _click_errors("ClickException")):
        err.show()
        return err.exit_code
    if STATE["debug"] or "--debug" in sys.argv:
        err_console.print_exception()
    else:
        # soft_wrap: the message stays one line however long (a path, a URI)
        # --debug is an option of rlake, not of the command: where a user adds it (the end of
        # the line) it was a usage error (review, 2026-11-29)
        debug = escape(f"rlake --debug {_command_name() or 'COMMAND'} ...")
        message = escape(without_backtrace(str(err)))  # a Rust backtrace: only with --debug
        err_console.print(f"[bold red]error:[/] {message}  ({debug} for the traceback)",
                          soft_wrap=True, highlight=False)
    return 1


if _SIGINT_BEFORE_IMPORTS is not None:  # imported: ``main`` (or the importer) handles Ctrl-C now
    signal.signal(signal.SIGINT, _SIGINT_BEFORE_IMPORTS)

if __name__ == "__main__":
    main()

