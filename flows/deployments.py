"""Scheduled deployments: ``rlake deploy`` records them, ``rlake serve`` serves them.

    rlake deploy CONFIG --name nightly --cron "0 3 * * *"   -> {home}/deployments/nightly.json
    rlake serve                                              -> Prefect server on 127.0.0.1 (DB in
                                                                {home}/prefect) + a runner serving
                                                                every recorded deployment and the
                                                                built-in lake-maintenance one

A deployment's flow, ``scheduled_run``, starts its rlake run the first time and continues it
(resume) on later ticks until it is complete; a tick that finds the run owned by a live process
(the previous tick, ``owner.pid``) does nothing. (Prefect's deployment ``concurrency_limit`` is
not used: on this loaded machine its lease was lost during provisioning and every run
cancelled.) Deployments recorded while ``rlake serve`` runs are picked up within seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow

from buffer import Lake
from flows.maintenance import lake_maintenance
from flows.rl import rl_run
from infra.config import ConfigError, RunConfig, check_run_id, config_differences, config_from_dict
from infra.recovery import run_owner

MAINTENANCE = "lake-maintenance"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ROOT = Path(__file__).resolve().parents[1]


@flow(name="scheduled_run")
def scheduled_run(config: dict, run_id: str) -> dict:
    """Start ``run_id`` if the lake has never seen it, continue it if it is unfinished, else
    nothing (it is complete)."""
    # a spec recorded before ``rlake deploy`` checked --run-id: '../../x y' made the run's
    # folder outside the home (review, 2026-11-29)
    check_run_id(run_id)
    cfg = config_from_dict(config)
    row = Lake(cfg.resolved_lake_uri, cfg.storage_options or None).get_run(run_id)
    check_recorded_config(cfg, run_id, row)
    if row is not None and row["status"] == "completed":
        return {"run_id": run_id, "status": "completed", "action": "none"}
    owner = run_owner(Path(cfg.home).resolve() / "runs" / run_id)
    if owner is not None:  # the previous tick is still at it
        return {"run_id": run_id, "status": "running", "action": f"none (process {owner} runs it)"}
    summary = rl_run(config, run_id=run_id, resume=row is not None)
    return {**summary, "action": "resumed" if row is not None else "started"}


def check_recorded_config(cfg: RunConfig, run_id: str, row: dict | None) -> None:
    """Refuse a deployment whose run the lake holds (``row``) with another config: it would be
    continued with the config it was started with (a resume reads it from the lake), and the
    deployment's own would be ignored without a word (e.g. ``--run-id`` naming a run started
    by ``rlake run``). A run whose length a resume changed (``--num-rollout``) goes to its
    recorded length."""
    if row is None:
        return
    # a length changed by `rlake resume --num-rollout` (infra.extend) is the run's from then on
    changed_length = "num_rollout_changes" in json.loads(row.get("notes") or "{}")
    differences = config_differences(config_from_dict(json.loads(row["config"])), cfg,
                                     ignore=("home", "run_id", *(("num_rollout",) if changed_length else ())))
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more"
                                              if len(differences) > 5 else "")
        raise ConfigError(f"run '{run_id}' is in the lake with another config (recorded -> "
                          f"deployment's: {shown}); a deployment continues a run with the config "
                          "it was started with: name another run (--run-id) or deploy that config")


def spec_dir(home: str | Path) -> Path:
    return Path(home).resolve() / "deployments"


def save_spec(home: str | Path, name: str, config: dict, run_id: str, cron: str | None,
              interval: float | None) -> Path:
    """Record a deployment (one JSON file per name); exactly one of cron / interval."""
    if not NAME_RE.match(name):
        raise ValueError(f"--name '{name}': use letters, digits, '-', '_' or '.' (max 64)")
    if name == MAINTENANCE:
        raise ValueError(f"--name '{name}' is the built-in maintenance deployment")
    if (cron is None) == (interval is None):
        raise ValueError("give exactly one of --cron EXPR or --interval SECONDS")
    if interval is not None and interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {interval}")
    if cron is not None:
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=cron)
        except ValueError:
            raise ValueError(f"--cron '{cron}' is not a valid cron expression") from None
    path = spec_dir(home) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "config": config, "run_id": run_id, "cron": cron,
                                "interval": interval}, indent=1))
    return path


def load_specs(home: str | Path) -> list[dict]:
    folder = spec_dir(home)
    out = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            out.append(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from None
    return out


async def build_deployments(home: str | Path, maintenance_interval: float | None,
                            skip: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """(key, RunnerDeployment) for every recorded spec, plus lake maintenance (None: not
    served); the key is the spec it was built from, and names whose key is in ``skip`` (already
    served as is) are left out."""
    wanted = {spec["name"]: (json.dumps(spec, sort_keys=True), spec) for spec in load_specs(home)}
    if maintenance_interval:
        wanted[MAINTENANCE] = (f"every {maintenance_interval}", None)
    out = []
    for name, (key, spec) in wanted.items():
        if (skip or {}).get(name) == key:
            continue
        if spec is None:
            lake_uri = str(Path(home).resolve() / "lake")
            deployment = await lake_maintenance.ato_deployment(
                name=MAINTENANCE, interval=maintenance_interval, parameters={"lake_uri": lake_uri},
                tags=["rlake"])
        else:
            # not the rlake-run tag: a resume marks RUNNING flow runs with that tag Crashed, and
            # the tick's own flow run is RUNNING while it resumes
            deployment = await scheduled_run.ato_deployment(
                name=name, cron=spec["cron"], interval=spec["interval"],
                parameters={"config": spec["config"], "run_id": spec["run_id"]},
                tags=["rlake", f"rlake-deployment:{spec['run_id']}"])
        out.append((key, deployment))
    return out


def serve_forever(home: str | Path, api_url: str, maintenance_interval: float | None,
                  limit: int = 1, rescan_s: float = 5.0) -> None:
    """Serve the deployments against ``api_url`` until SIGTERM / Ctrl-C (then return).

    At most ``limit`` flow runs execute at once (each is a process that loads the stack): ticks
    that come due meanwhile wait their turn instead of piling up processes. The deployments
    folder is read again every ``rescan_s`` seconds: a deployment recorded (or changed) by
    ``rlake deploy`` meanwhile is registered and served without a restart."""
    os.environ["PREFECT_API_URL"] = api_url
    # flow runs execute in subprocesses that import flows/*.py: they need this checkout importable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                               if p)

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if not load_specs(home) and not maintenance_interval:
        raise ValueError("nothing to serve: no deployments recorded and maintenance is off")
    try:
        asyncio.run(_serve(home, maintenance_interval, limit, rescan_s))
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:
        # Prefect's Runner swaps in its own SIGTERM handler (sys.exit(0)) while it starts; a
        # SIGTERM then surfaces as SystemExit(0) wrapped by the task group: still a clean stop
        if group.split(is_clean_stop)[1] is not None:
            raise


def is_clean_stop(err: BaseException) -> bool:
    """A stop asked for by a signal: KeyboardInterrupt, or SystemExit with code 0."""
    return isinstance(err, KeyboardInterrupt) or (isinstance(err, SystemExit) and not err.code)


async def _serve(home: str | Path, maintenance_interval: float | None, limit: int,
                 rescan_s: float) -> None:
    import anyio
    from prefect.runner import Runner

    loop = asyncio.get_running_loop()
    stop_asked = asyncio.Event()

    class CleanStopRunner(Runner):
        """Prefect's Runner whose SIGTERM handler asks the event loop to stop it. Prefect's own
        calls ``sys.exit(0)`` from inside whatever coroutine is running: its clean-up (pausing
        the deployments) was then cancelled half-way, with a cancel-scope RuntimeError."""

        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            loop.call_soon_threadsafe(stop_asked.set)

    runner = CleanStopRunner(name="rlake-serve", limit=limit)
    served: dict[str, str] = {}  # deployment name -> the spec it was registered from

    async def register_new() -> None:
        for key, deployment in await build_deployments(home, maintenance_interval, skip=served):
            await runner.aadd_deployment(deployment)
            served[deployment.name] = key
            print(f"serving deployment '{deployment.name}'", flush=True)

    async def rescan() -> None:
        while True:
            await anyio.sleep(rescan_s)
            try:
                await register_new()
            except ValueError as err:  # a bad spec file: say so, keep serving the others
                print(f"deployments: {err}", flush=True)

    async def stop_when_asked(group: anyio.abc.TaskGroup) -> None:
        await stop_asked.wait()
        if runner.started:
            await runner.astop()  # its start() returns once its loops have wound down
        else:
            group.cancel_scope.cancel()

    # Ctrl-C stops as SIGTERM does: the KeyboardInterrupt raised inside whatever coroutine ran
    # cancelled the runner's clean-up (pausing the deployments) half-way, printing an asyncio
    # "unhandled exception during asyncio.run() shutdown" and two cancel-scope tracebacks
    # (review, 2026-11-29); as a loop signal handler it only asks the loop to stop the runner
    with sigint_asks(loop, stop_asked):
        await register_new()
        async with anyio.create_task_group() as group:
            group.start_soon(rescan)
            group.start_soon(stop_when_asked, group)
            await runner.start()
            group.cancel_scope.cancel()


@contextmanager
def sigint_asks(loop: asyncio.AbstractEventLoop, stop_asked: asyncio.Event) -> Iterator[None]:
    """SIGINT sets ``stop_asked`` (in ``loop``) while inside; the handler before is put back."""
    before = signal.getsignal(signal.SIGINT)
    loop.add_signal_handler(signal.SIGINT, stop_asked.set)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)  # it installs Python's default handler ...
        signal.signal(signal.SIGINT, before)  # ... not the CLI's (infra/cli.py _note_interrupts)
