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
import math
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
from infra.paths import absolute_paths
from infra.recovery import claim_run, release_run, run_owner

MAINTENANCE = "lake-maintenance"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ROOT = Path(__file__).resolve().parents[1]
# an interval schedule's bounds: below 1 s Prefect's scheduler makes runs faster than any run
# starts; NaN, inf and 1e20 s broke `rlake serve` (its rescan died on an OverflowError: review,
# 2026-11-29)
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 366 * 86400.0


@flow(name="scheduled_run")
def scheduled_run(config: dict, run_id: str, base: str | None = None) -> dict:
    """Start ``run_id`` if the lake has never seen it, continue it if it is unfinished, else
    nothing (it is complete, or another process runs it). ``base``: the folder ``rlake deploy``
    ran in (relative paths of a run recorded by ``rlake run`` there mean paths under it)."""
    # a spec recorded before ``rlake deploy`` checked --run-id: '../../x y' made the run's
    # folder outside the home (review, 2026-11-29)
    check_run_id(run_id)
    cfg = config_from_dict(config)
    lake = Lake(cfg.resolved_lake_uri, cfg.storage_options or None)
    row = lake.get_run(run_id)
    check_recorded_config(cfg, run_id, row, base=base)
    if row is not None and row["status"] == "completed":
        return {"run_id": run_id, "status": "completed", "action": "none"}
    run_dir = Path(cfg.home).resolve() / "runs" / run_id
    # the tick claims the run folder, then looks again: two ticks starting at once both found no
    # owner (``run_owner``) and the second failed in rl_run's own claim, with a traceback and a
    # Failed flow run (review, 2026-11-29); rl_run's claim nests in this one
    try:
        claim_run(run_dir)
    except ValueError:  # another live process (the previous tick, a `rlake resume`) runs it
        owner = run_owner(run_dir)
        return {"run_id": run_id, "status": "running",
                "action": f"none (process {owner or 'another'} runs it)"}
    try:
        row = lake.get_run(run_id)  # the other tick may have started or finished it meanwhile
        check_recorded_config(cfg, run_id, row, base=base)
        if row is not None and row["status"] == "completed":
            return {"run_id": run_id, "status": "completed", "action": "none"}
        summary = rl_run(config, run_id=run_id, resume=row is not None)
    finally:
        release_run(run_dir)
    return {**summary, "action": "resumed" if row is not None else "started"}


def check_recorded_config(cfg: RunConfig, run_id: str, row: dict | None,
                          base: str | Path | None = None) -> None:
    """Refuse a deployment whose run the lake holds (``row``) with another config: it would be
    continued with the config it was started with (a resume reads it from the lake), and the
    deployment's own would be ignored without a word (e.g. ``--run-id`` naming a run started
    by ``rlake run``). A run whose length a resume changed (``--num-rollout``) goes to its
    recorded length. ``base``: where the recorded config's relative paths are taken from (the
    deployment's own are absolute: ``absolute_paths``)."""
    if row is None:
        return
    # a length changed by `rlake resume --num-rollout` (infra.extend) is the run's from then on
    changed_length = "num_rollout_changes" in json.loads(row.get("notes") or "{}")
    recorded = json.loads(row["config"])
    if base is not None:
        recorded = absolute_paths(recorded, base)
    differences = config_differences(config_from_dict(recorded), cfg,
                                     ignore=("home", "run_id", *(("num_rollout",) if changed_length else ())))
    if differences:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more"
                                              if len(differences) > 5 else "")
        raise ConfigError(f"run '{run_id}' is in the lake with another config (recorded -> "
                          f"deployment's: {shown}); a deployment continues a run with the config "
                          "it was started with: name another run (--run-id) or deploy that config")


def spec_dir(home: str | Path) -> Path:
    return Path(home).resolve() / "deployments"


def check_schedule(cron: str | None, interval: float | None) -> None:
    """Exactly one of cron / interval, and that one valid: an interval is a number of seconds
    from ``MIN_INTERVAL_S`` to ``MAX_INTERVAL_S`` (366 days)."""
    if (cron is None) == (interval is None):
        raise ValueError("give exactly one of --cron EXPR or --interval SECONDS")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int | float)
                                 or not math.isfinite(interval)
                                 or not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S):
        raise ValueError(f"--interval must be from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:.0f} "
                         f"seconds (366 days), got {interval}")
    if cron is not None:
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=cron)
        except ValueError:
            raise ValueError(f"--cron '{cron}' is not a valid cron expression") from None


def save_spec(home: str | Path, name: str, config: dict, run_id: str, cron: str | None,
              interval: float | None, base: str | Path | None = None) -> Path:
    """Record a deployment (one JSON file per name); exactly one of cron / interval (checked
    by ``check_schedule``). ``base``: the folder ``rlake deploy`` ran in (``scheduled_run``)."""
    if not NAME_RE.match(name):
        raise ValueError(f"--name '{name}': use letters, digits, '-', '_' or '.' (max 64)")
    if name == MAINTENANCE:
        raise ValueError(f"--name '{name}' is the built-in maintenance deployment")
    check_schedule(cron, interval)
    path = spec_dir(home) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = {"name": name, "config": config, "run_id": run_id, "cron": cron, "interval": interval}
    if base is not None:
        spec["base"] = str(base)
    path.write_text(json.dumps(spec, indent=1))
    return path


def read_specs(home: str | Path) -> list[tuple[Path, dict | Exception]]:
    """(path, spec) for every recorded deployment, in name order; a spec that cannot be read or
    is not a mapping with a name is (path, the error), for the caller to report."""
    folder = spec_dir(home)
    out: list[tuple[Path, dict | Exception]] = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            spec = json.loads(path.read_text())
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError("not a deployment (a JSON object with a name)")
            out.append((path, spec))
        except (OSError, ValueError) as err:
            out.append((path, ValueError(f"not valid JSON: {err}") if isinstance(
                err, json.JSONDecodeError) else err))
    return out


def load_specs(home: str | Path) -> list[dict]:
    out = []
    for path, spec in read_specs(home):
        if isinstance(spec, Exception):
            raise ValueError(f"{path}: {spec}")
        out.append(spec)
    return out


async def build_deployment(spec: dict):
    """The RunnerDeployment of one recorded spec; a ValueError (or another error) when the spec
    cannot be served (a bad schedule or run id written by hand: it is reported, not served)."""
    check_schedule(spec.get("cron"), spec.get("interval"))
    check_run_id(spec.get("run_id"))
    if not isinstance(spec.get("config"), dict):
        raise ValueError("its 'config' is not a mapping")
    parameters = {"config": spec["config"], "run_id": spec["run_id"]}
    if spec.get("base"):
        parameters["base"] = spec["base"]
    # not the rlake-run tag: a resume marks RUNNING flow runs with that tag Crashed, and the
    # tick's own flow run is RUNNING while it resumes
    return await scheduled_run.ato_deployment(
        name=spec["name"], cron=spec["cron"], interval=spec["interval"], parameters=parameters,
        tags=["rlake", f"rlake-deployment:{spec['run_id']}"])


async def maintenance_deployment(home: str | Path, maintenance_interval: float):
    lake_uri = str(Path(home).resolve() / "lake")
    return await lake_maintenance.ato_deployment(
        name=MAINTENANCE, interval=maintenance_interval, parameters={"lake_uri": lake_uri},
        tags=["rlake"])


async def build_deployments(home: str | Path, maintenance_interval: float | None,
                            skip: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """(key, RunnerDeployment) for every recorded spec, plus lake maintenance (None: not
    served); the key is the spec it was built from, and names whose key is in ``skip`` (already
    served as is) are left out. The first spec that cannot be built raises (``_serve`` builds
    them one by one instead, reporting each bad one)."""
    out = []
    for spec in load_specs(home):
        key = spec_key(spec)
        if (skip or {}).get(spec["name"]) != key:
            out.append((key, await build_deployment(spec)))
    if maintenance_interval and (skip or {}).get(MAINTENANCE) != f"every {maintenance_interval}":
        out.append((f"every {maintenance_interval}",
                    await maintenance_deployment(home, maintenance_interval)))
    return out


def spec_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


def run_complete(spec: dict) -> bool:
    """Whether the lake records the spec's run as completed (its ticks would do nothing)."""
    cfg = config_from_dict(spec["config"])
    row = Lake(cfg.resolved_lake_uri, cfg.storage_options or None).get_run(spec["run_id"])
    return row is not None and row["status"] == "completed"


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
    if not read_specs(home) and not maintenance_interval:
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
    specs: dict[str, dict] = {}  # deployment name -> its spec (served ones)
    ids: dict[str, Any] = {}  # deployment name -> its id on the server
    said: dict[str, str] = {}  # deployment name -> the last problem reported (said once)
    paused: set[str] = set()  # deployments paused here because their run is complete

    def say_once(name: str, message: str) -> None:
        if said.get(name) != message:
            said[name] = message
            print(message, flush=True)

    async def register_new() -> None:
        """Serve every spec not served as it is now; a spec that fails (a bad file written by
        hand, an interval the scheduler cannot hold) is reported with its path, once per
        content, and the others are served: it never brings the serve down (an OverflowError
        in the rescan did: review, 2026-11-29)."""
        if maintenance_interval and MAINTENANCE not in served:
            ids[MAINTENANCE] = await runner.aadd_deployment(
                await maintenance_deployment(home, maintenance_interval))
            served[MAINTENANCE] = f"every {maintenance_interval}"
            print(f"serving deployment '{MAINTENANCE}'", flush=True)
        for path, spec in read_specs(home):
            name = spec.get("name") if isinstance(spec, dict) else None
            name = name if isinstance(name, str) else path.stem
            try:
                if isinstance(spec, Exception):
                    raise spec
                if name == MAINTENANCE:
                    raise ValueError(f"'{MAINTENANCE}' is the built-in maintenance deployment")
                key = spec_key(spec)
                if served.get(name) == key:
                    continue
                ids[name] = await runner.aadd_deployment(await build_deployment(spec))
            except Exception as err:  # noqa: BLE001 - reported; the other deployments go on
                say_once(name, f"deployments: {path}: not served: {type(err).__name__}: {err}")
                continue
            served[name], specs[name] = key, spec
            paused.discard(name)  # registering it again unpaused it
            said.pop(name, None)
            print(f"serving deployment '{name}'", flush=True)

    async def pause_complete() -> None:
        """Pause a served deployment whose run is complete (its ticks would only start a
        process that does nothing: ~10-20 s each here, delaying the other deployments), and
        resume one whose run is no longer complete (``rlake resume --num-rollout``)."""
        from prefect import get_client

        for name, spec in list(specs.items()):
            try:
                complete = await anyio.to_thread.run_sync(run_complete, spec)
                if not complete and name not in paused:
                    continue
                async with get_client() as client:
                    if complete and name in paused:
                        await drop_scheduled_runs(client, ids[name])
                    elif complete:
                        await client.pause_deployment(ids[name])
                        paused.add(name)
                        print(f"deployment '{name}': run {spec['run_id']} is complete: paused "
                              "(no more ticks)", flush=True)
                    elif name in paused:
                        await client.resume_deployment(ids[name])
                        paused.discard(name)
                        print(f"deployment '{name}': run {spec['run_id']} is not complete: "
                              "resumed", flush=True)
            except Exception as err:  # noqa: BLE001 - reported; the serve goes on
                say_once(f"{name} (pause)", f"deployments: '{name}': could not check its run: "
                                            f"{type(err).__name__}: {err}")

    async def drop_scheduled_runs(client, deployment_id) -> None:
        """Delete the Scheduled flow runs of a paused deployment. Prefect's pause deletes them,
        but its scheduler service may insert the runs it planned from before the pause just
        after (100 were left on a loaded CI machine, 2026-11-29), and each would start a flow-run
        process that does nothing."""
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            flow_run_filter=FlowRunFilter(state=dict(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
        for run in runs:
            await client.delete_flow_run(run.id)

    async def rescan() -> None:
        while True:
            await anyio.sleep(rescan_s)
            try:
                await register_new()
                await pause_complete()
            except Exception as err:  # noqa: BLE001 - e.g. the deployments folder unreadable
                print(f"deployments: {type(err).__name__}: {err}", flush=True)

    async def stop_when_asked() -> None:
        await stop_asked.wait()
        # never cancel the runner's start half-way: cancelled inside its __aenter__, the task
        # groups it had entered stay open and exiting ours raised "Attempted to exit a cancel
        # scope that isn't the current tasks's current cancel scope" (CI, 2026-12-02: a SIGTERM
        # 1 s after the serve said it was serving, on a slow host); once started, astop winds it
        # down (pausing the deployments, as a stop asked earlier, while registering, does too)
        # and its start() returns
        while not runner.started:
            await anyio.sleep(0.05)
        await runner.astop()

    # Ctrl-C and SIGTERM only ask the loop to stop the runner: raised inside whatever coroutine
    # ran, their KeyboardInterrupt cancelled the runner's clean-up (pausing the deployments)
    # half-way, printing an asyncio "unhandled exception during asyncio.run() shutdown" and two
    # cancel-scope tracebacks (review, 2026-11-29). The runner's start swaps in its own SIGTERM
    # handler: CleanStopRunner.handle_sigterm asks the same.
    with signals_ask(loop, stop_asked, (signal.SIGINT, signal.SIGTERM)):
        await register_new()
        await pause_complete()
        async with anyio.create_task_group() as group:
            group.start_soon(rescan)
            group.start_soon(stop_when_asked)
            await runner.start()
            group.cancel_scope.cancel()


@contextmanager
def signals_ask(loop: asyncio.AbstractEventLoop, stop_asked: asyncio.Event,
                signums: tuple[int, ...]) -> Iterator[None]:
    """Each of ``signums`` sets ``stop_asked`` (in ``loop``) while inside; the handlers before
    are put back."""
    before = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        loop.add_signal_handler(signum, stop_asked.set)
    try:
        yield
    finally:
        for signum, handler in before.items():
            loop.remove_signal_handler(signum)  # it installs Python's default handler ...
            signal.signal(signum, handler)  # ... not the CLI's (infra/interrupts.note_interrupts)
