"""Operations commands of the ``rlake`` CLI: replay, lineage, report, deploy, serve.

``register(app)`` adds them to the Typer app of ``infra.cli`` (passed in, so ``python -m infra.cli``
registers on the app it runs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from infra.config import apply_overrides, config_from_dict, read_config_file

console = Console()
HomeOpt = Annotated[str, typer.Option("--home", help="state folder (lake, MLflow, checkpoints)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override: key.sub=value")]
LakeOpt = Annotated[str | None, typer.Option("--lake", help="lake URI (default: HOME/lake)")]
# lineage's and report's name for --lake before 2026-11-29: still taken, no longer shown
OldLakeOpt = Annotated[str | None, typer.Option("--lake-uri", hidden=True)]


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested mappings (lists and scalars replace)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def _yaml_mapping(path: Path | None) -> dict[str, Any]:
    return {} if path is None else read_config_file(path)


def lake_option(lake: str | None, lake_uri: str | None) -> str | None:
    """The lake given as ``--lake`` or by its old name ``--lake-uri`` (None: HOME/lake)."""
    if lake is not None and lake_uri is not None and lake != lake_uri:
        raise typer.BadParameter(f"--lake {lake} and --lake-uri {lake_uri}: give one (--lake-uri is "
                                 "the old name of --lake)")
    return lake if lake is not None else lake_uri


def _lake(home: str, lake_uri: str | None):
    from buffer import Lake

    return Lake(lake_uri or str(Path(home) / "lake"))


def register(app: typer.Typer, debug: Callable[[], bool] = lambda: False) -> None:  # noqa: C901 - one nested function per command
    """``debug()``: whether ``--debug`` was given (tracebacks on the console)."""

    @app.command()
    def replay(source_run: str, home: HomeOpt = "./rlake-home",
               iterations: Annotated[str | None, typer.Option("--iterations", help="A:B (B exclusive)")] = None,
               rescore: Annotated[str | None, typer.Option("--rescore", help="reward fn (rm_type) to score again")] = None,
               config: Annotated[Path | None, typer.Option("--config", help="YAML merged over the source's config")] = None,
               set_: SetOpt = None, run_id: Annotated[str | None, typer.Option("--run-id")] = None,
               lake_uri: LakeOpt = None) -> None:
        """Train a new run from SOURCE_RUN's recorded trajectories (no generation)."""
        lake = _lake(home, lake_uri)
        row = lake.get_run(source_run)
        if row is None:
            raise ValueError(f"no run '{source_run}' in the lake at {lake.uri} (--lake; default "
                             "HOME/lake)")
        data = deep_merge(json.loads(row["config"]), _yaml_mapping(config))
        # the replay reads its source where it was found and writes beside it: the source's
        # recorded lake_uri may name a path of another machine, or its home's (review, 2026-11-29)
        data = apply_overrides({**data, "home": home, "run_id": None, "lake_uri": lake_uri},
                               set_ or [])
        from infra.paths import absolute_paths

        # recorded absolute, as `rlake run` records its config: a resume from elsewhere finds them
        cfg = config_from_dict(absolute_paths(data, Path.cwd()))
        from infra.progress import replay_with_progress
        from infra.startup import check_new_run_id, check_replay, new_run_id

        check_replay(lake, cfg, source_run, iterations, rescore)
        run_id = run_id or new_run_id()
        check_new_run_id(run_id)
        console.print(f"[dim]replaying {source_run} (iterations {iterations or 'all'}) as run {run_id}[/]")
        summary = replay_with_progress(cfg, source_run, run_id, iterations, rescore, resume=False,
                                       console=console, debug=debug())
        print_replay_summary(summary)

    @app.command()
    def lineage(run_id: str, version: Annotated[int, typer.Option("--version", help="weight version")],
                home: HomeOpt = "./rlake-home", samples: Annotated[int, typer.Option("--samples", min=0)] = 10,
                lake: LakeOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False,
                lake_uri: OldLakeOpt = None) -> None:
        """Which iterations and samples trained weight version V, and which versions generated them."""
        from infra.lineage import format_lineage, version_lineage

        info = version_lineage(_lake(home, lake_option(lake, lake_uri)), run_id, version,
                               checkpoint_root=Path(home) / "runs" / run_id / "checkpoints")
        if as_json:
            print(json.dumps(info, default=str))
            return
        for line in format_lineage(info, run_id, samples):
            console.print(line, highlight=False)

    @app.command()
    def report(run_id: str, out: Annotated[Path, typer.Option("--out")] = Path("report.html"),
               home: HomeOpt = "./rlake-home",
               lake: LakeOpt = None, lake_uri: OldLakeOpt = None) -> None:
        """HTML report + PNG figures of a run, from the lake."""
        from infra.lake_cli import check_out
        from infra.report import write_report

        lake = lake_option(lake, lake_uri)
        # the figures go beside the HTML (OUT-reward.png ...): checking OUT covers them too; a
        # folder got five PNGs beside it before failing (review, 2026-11-29)
        check_out(out, lake or str(Path(home) / "lake"))
        for path in write_report(_lake(home, lake), run_id, out, home):  # home: the run's status
            console.print(f"wrote {path}")

    @app.command()
    def deploy(config: Annotated[Path, typer.Argument(help="YAML config")],
               name: Annotated[str, typer.Option("--name")],
               cron: Annotated[str | None, typer.Option("--cron")] = None,
               interval: Annotated[float | None, typer.Option("--interval", help="seconds")] = None,
               run_id: Annotated[str | None, typer.Option("--run-id", help="default: the name")] = None,
               set_: SetOpt = None) -> None:
        """Record a deployment that starts, then continues, a run on a schedule (served by `rlake serve`)."""
        from infra.config import load_config

        loaded = load_config(config, set_ or [])
        from flows.deployments import check_recorded_config, check_schedule, save_spec
        from infra.paths import absolute_paths
        from infra.startup import check_new_run_id, get_run_row, open_lake

        check_schedule(cron, interval)  # before anything is read: --interval nan is refused at once
        if run_id is not None:  # '../../x y' made serve write outside the home (review, 2026-11-29)
            check_new_run_id(run_id)
        # the run executes in serve's folder, not this one: its home and local paths are recorded
        # absolute (a relative home put the run's lake, MLflow store and folder under serve's
        # folder: review, 2026-11-29)
        base = Path.cwd()
        cfg = config_from_dict(absolute_paths(loaded.model_dump(), base))
        run = run_id if run_id is not None else cfg.run_id or name
        row = get_run_row(open_lake(cfg), cfg, run)
        check_recorded_config(cfg, run, row, base=base)  # fail now, not at every tick
        if row is not None and row["status"] == "completed":
            console.print(f"[yellow]run {run} is complete: serve pauses the deployment (no ticks)[/]")
        path = save_spec(cfg.home, name, cfg.model_dump(), run, cron, interval, base=base)
        when = f"cron '{cron}'" if cron else f"every {interval:g} s"
        console.print(f"deployment [bold]{name}[/] (run {run}, {when}) recorded in {path}")
        console.print(f"serve it: rlake serve --home {cfg.home}   (a running serve picks it up)")

    @app.command()
    def serve(home: HomeOpt = "./rlake-home",
              maintenance_interval: Annotated[float, typer.Option(
                  "--maintenance-interval", min=0,
                  help="seconds between lake compact+vacuum (0: off)")] = 6 * 3600,
              port: Annotated[int | None, typer.Option("--port", min=1, max=65535)] = None,
              limit: Annotated[int, typer.Option("--limit", min=1, help="flow runs at once")] = 1) -> None:
        """Start (or reuse) a Prefect server on 127.0.0.1 for HOME and serve rlake's deployments."""
        import os
        import signal

        from infra.env import configure_environment
        from infra.prefect_server import (
            ensure_server,
            lock_serve,
            server_info,
            starter_gone,
            stop_server,
        )
        from infra.ui_cli import raise_interrupt

        # SIGTERM at any moment (even while the server starts) is a clean stop, exit status 0
        signal.signal(signal.SIGTERM, raise_interrupt)
        started = False
        lock = None
        try:
            # one serve per home, for its whole life (released on any exit, kill -9 included)
            lock = lock_serve(home)
            configure_environment(home)
            info = server_info(home)
            # a server whose starter is gone (killed before servers died with their starter)
            # is this serve's to stop
            started = info is None or starter_gone(info)
            url = ensure_server(home, port)
            # Prefect reads its settings once, at import: point it at the server before
            # importing it (else it would start an embedded server of its own)
            os.environ["PREFECT_API_URL"] = url
            from flows.deployments import serve_forever

            how = "started" if info is None else (
                "adopted: its starter is gone, stopped with this serve" if started else "already running")
            console.print(f"Prefect server: {url} ({how})")
            serve_forever(home, url, maintenance_interval or None, limit)
        except KeyboardInterrupt:
            console.print("stopping")
        finally:
            if started:
                stop_server(home)
                console.print("Prefect server stopped")
            if lock is not None:
                lock.close()  # releases the serve lock


def print_replay_summary(summary: dict) -> None:
    console.print(f"replay run [bold]{summary['run_id']}[/] of {summary['replay_of']}: "
                  f"{summary['iterations']} iterations trained")
    console.print(f"  rlake report {summary['run_id']} --home {summary['home']} --out report.html")


def resume_replay(row: dict, home: str, debug: bool = False) -> None:
    """``rlake resume`` of a replay run: the same source iterations and rescoring, continued
    from the last committed iteration (``runs.notes`` holds what the replay was asked)."""
    from infra.progress import replay_with_progress

    note = json.loads(row.get("notes") or "{}")
    cfg = config_from_dict({**json.loads(row["config"]), "home": home})
    console.print(f"[dim]resuming replay {row['run_id']} of {row['replay_of']}[/]")
    summary = replay_with_progress(cfg, row["replay_of"], row["run_id"], note.get("iterations"),
                                   note.get("rescore"), resume=True, console=console,
                                   debug=debug)
    print_replay_summary(summary)
