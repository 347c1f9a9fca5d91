"""What ``rlake run`` / ``rlake resume`` do before the first flow, in an order that is cheap to
fail and safe to kill:

    check(cfg)                   config, files, paths: seconds, before anything slow starts
    EmbeddedServer.start         Prefect's API server starts in its own process (~4 s) ...
    refuse_existing / load_row   ... while a run id names one run forever (run) / must exist
                                 (resume: the server starts once it is found); one whose run
                                 failed at start-up having written nothing but its row is free
                                 again (``wrote_nothing``)
    record_run                   the runs row (status running) first: a kill -9 from here on
                                 leaves a run `rlake resume` continues
    open_runtime                 ... while this one builds the model, data, MLflow store
    EmbeddedServer.wait          then the first flow runs, watched: if that server ends
                                 under the run, the run ends at once (``server_lost``)

A new run's server is spawned before the lake's code is imported (pyarrow, deltalake: ~0.4 s):
the server's start is the startup's path (2026-12-07, docs/operations.md, Startup).

Nothing here imports Prefect: its settings are read when it is first imported, after the
server's URL is in the environment.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from infra.checks import (  # noqa: F401 - the checks' names, imported from here before the split
    StartupError,
    check,
    check_data,
    check_device,
    check_lake_uri,
    check_reward_names,
    describe_os_error,
    not_a_model_folder,
    unreadable_model_file,
)
from infra.config import RunConfig, check_run_id, config_from_dict
from infra.data_digest import changed_prompt_data, prompt_data_digest
from infra.faults import fault_point
from infra.paths import place_options
from infra.quick_exit import release_named_semaphores

if TYPE_CHECKING:
    from infra.prefect_server import EmbeddedServer

DEFAULT_HOME = "./rlake-home"
SERVER_LOST_EXIT = 1  # the CLI's code for a failed command


def open_lake(cfg: RunConfig):
    """The run's lake; a failure to open or read it names ``lake_uri``."""
    from buffer import Lake

    return Lake(cfg.resolved_lake_uri, cfg.storage_options or None)


def get_run_row(lake, cfg: RunConfig, run_id: str) -> dict | None:
    try:
        return lake.get_run(run_id)
    except OSError as err:
        raise StartupError(f"lake_uri '{cfg.resolved_lake_uri}': {describe_os_error(err)}") from None
    except Exception as err:  # noqa: BLE001 - deltalake raises its own error types
        raise StartupError(f"lake_uri '{cfg.resolved_lake_uri}': cannot read the lake: "
                           f"{str(err).splitlines()[0]}") from None


def resume_command(run_id: str, cfg: RunConfig) -> str:
    """The command that continues ``run_id`` (the options it needs, no more), shell-quoted: a
    home with a space gave a command that did not run as printed (review, 2026-11-29)."""
    return _with_place(["rlake", "resume", run_id], cfg)


def _with_place(args: list[str], cfg: RunConfig) -> str:
    """``args`` with the ``--home`` (not the default one) and ``--lake`` options ``cfg`` needs,
    shell-quoted."""
    return shlex.join([*args, *place_options(cfg.home, cfg.lake_uri, with_home=cfg.home != DEFAULT_HOME)])


def start_again_command(run_id: str, cfg: RunConfig) -> str:
    """``rlake run CONFIG --run-id RUN_ID`` with the home and lake options ``run_id`` needs."""
    return _with_place(["rlake", "run", "CONFIG", "--run-id", run_id], cfg)


def wrote_nothing(lake, cfg: RunConfig, run_id: str, row: dict | None) -> bool:
    """Whether run ``run_id`` failed at start-up having written nothing but its ``runs`` row:
    status failed, no MLflow run, no row in any other lake table, no checkpoint folder.
    Such a run may be started again under its id (``refuse_existing``): what failed after the
    record (a prompt longer than the model takes, a model that does not load) is in its
    recorded config or data, which ``rlake resume`` reuses, so the id was lost for good
    (review, 2026-11-29). A run that wrote anything keeps its id forever."""
    if row is None or row.get("status") != "failed" or row.get("mlflow_run_id"):
        return False
    checkpoints = Path(cfg.home) / "runs" / run_id / "checkpoints"
    if checkpoints.exists() and any(checkpoints.iterdir()):
        return False
    try:
        return not any(lake.read(table, run_id=run_id, columns=["run_id"]).num_rows
                       for table in lake.tables() if table != "runs")
    except Exception:  # noqa: BLE001 - unreadable: not known to be empty, so the id stays taken
        return False


def refuse_existing(lake, cfg: RunConfig, run_id: str) -> None:
    """A run id names one run forever: a new run with an id the lake (or the home) already holds
    is refused before anything of it is touched, unless that run failed at start-up having
    written nothing but its row (``wrote_nothing``): then the new run takes the id over."""
    row = get_run_row(lake, cfg, run_id)
    run_dir = Path(cfg.home) / "runs" / run_id
    if row is None and not (run_dir / "checkpoints").exists():
        return
    if wrote_nothing(lake, cfg, run_id, row):
        return
    what = f"status {row['status']}" if row else "a run folder without a runs row"
    raise StartupError(f"run '{run_id}' already exists ({what}); a run id names one run: continue "
                       f"it with `{resume_command(run_id, _owner_config(cfg, row))}`, or start a "
                       "new run with another id")


def _owner_config(cfg: RunConfig, row: dict | None) -> RunConfig:
    """``cfg`` with the home the existing run ``row`` recorded: in a lake shared by several
    homes the id may belong to another home, whose resume is the one that works (the hint named
    the refused run's home, where the resume found no checkpoint: review, 2026-11-29)."""
    recorded = json.loads(row.get("config") or "{}").get("home") if row else None
    if not recorded or Path(recorded).resolve() == Path(cfg.home).resolve():
        return cfg
    return cfg.model_copy(update={"home": recorded})


def load_row(lake, cfg: RunConfig, run_id: str) -> dict:
    row = get_run_row(lake, cfg, run_id)
    if row is None:
        raise StartupError(f"no run '{run_id}' in the lake at {cfg.resolved_lake_uri} "
                           "(`rlake status` lists the runs)")
    return row


def parse_iterations(spec: str | None) -> tuple[int, int | None]:
    """A replay's ``--iterations``: ``"A:B"`` -> (A, B) with A inclusive, B exclusive (Python
    slice); ``"A:"`` -> (A, None); ``"A"`` -> (A, A + 1); None -> (0, None)."""
    if not spec:
        return 0, None
    first, sep, stop = spec.partition(":")
    try:
        a = int(first) if first.strip() else 0
        b = (int(stop) if stop.strip() else None) if sep else a + 1
    except ValueError:
        raise StartupError(f"--iterations '{spec}' must look like A:B (e.g. 0:10)") from None
    if a < 0 or (b is not None and b <= a):
        raise StartupError(f"--iterations '{spec}': need 0 <= A < B")
    return a, b


def check_replay(lake, cfg: RunConfig, source_run: str, iterations: str | None,
                 rescore: str | None) -> None:
    """A replay's own arguments, before anything starts (a replay failing on them later left a
    failed run behind): ``--iterations`` A:B holding some of ``source_run``'s train
    trajectories, ``--rescore`` an ``rm_type`` or a loadable ``module:function`` taking
    ``custom_rm_path``'s arguments."""
    import pyarrow.compute as pc

    first, stop = parse_iterations(iterations)
    recorded = lake.read("trajectories", run_id=source_run, columns=["iteration", "kind"])
    train = sorted(set(recorded.filter(pc.equal(recorded.column("kind"), "train"))
                       .column("iteration").to_pylist()))
    if not [i for i in train if i >= first and (stop is None or i < stop)]:
        has = f"it has iterations {train[0]}..{train[-1]}" if train else "it has none"
        raise StartupError(f"run '{source_run}' has no train trajectories in iterations "
                           f"{iterations or 'all'} ({has})")
    if not rescore:
        return
    from rewards.registry import resolve_rm_type
    from rollout.functions import SIGNATURES, load_function

    try:
        if ":" in rescore:
            load_function(rescore, len(SIGNATURES["custom_rm_path"]), "--rescore")
        else:
            resolve_rm_type(rescore, cfg.rollout.rm_url)
    except ValueError as err:
        message = str(err).replace("(or set custom_rm_path)", "(or a module:function)")
        raise StartupError(message if message.startswith("--rescore") else
                           f"--rescore '{rescore}': {message}") from None


def record_run(lake, cfg: RunConfig, run_id: str) -> None:
    """The runs row, status running, before anything slow: from here a kill -9 leaves a run
    that ``rlake resume`` continues (it reads the config from this row, its local paths
    absolute: a resume from another folder read a relative model.path or prompt file there)."""
    from infra.paths import absolute_paths

    now = datetime.now(UTC)
    config = json.dumps(absolute_paths(json.loads(cfg.model_dump_json()), Path.cwd()))
    # read before the try: a prompt file gone since check_data is not the lake's error
    notes = json.dumps({"pid": os.getpid(), "prompt_data": prompt_data_digest(cfg.data.prompt_data)})
    try:
        lake.upsert_run({"run_id": run_id, "config": config, "status": "running",
                         "created_at": now, "updated_at": now, "notes": notes})
    except OSError as err:
        raise StartupError(f"lake_uri '{cfg.resolved_lake_uri}': {describe_os_error(err)}") from None


def mark_failed(lake, run_id: str) -> None:
    """A run that failed before its pipeline started (which marks failures itself)."""
    try:
        lake.upsert_run({"run_id": run_id, "status": "failed", "updated_at": datetime.now(UTC)})
    except Exception:  # noqa: BLE001 - best effort: the original error is what the user needs
        pass


def check_new_run_id(run_id: str) -> None:
    """``--run-id`` as ``config.check_run_id`` allows it (a StartupError: one line, nothing
    written yet)."""
    try:
        check_run_id(run_id)
    except ValueError as e:
        raise StartupError(f"--run-id: {e}") from None


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


@contextmanager
def prepared_run(cfg: RunConfig, run_id: str | None, resume: bool,
                 num_rollout: int | None = None) -> Iterator[tuple[str, RunConfig]]:
    """Everything before the first flow, in the order of the module docstring; yields the run
    id and the config its runtime holds (the recorded one: a resume's ``cfg`` names only the
    home and lake) with the runtime open (``infra.runtime.RUNTIMES``) and Prefect's server
    answering. On the way out the server is stopped and a runtime the pipeline never took is
    closed.
    ``num_rollout`` (a resume's ``--num-rollout``) is recorded as the run's once this process
    owns it (``infra.extend.set_num_rollout``)."""
    from infra.env import set_environment
    from infra.recovery import claim_run, release_run

    home = set_environment(cfg.home, cfg.torch_threads)
    check(cfg)
    with ExitStack() as servers:  # Prefect's server, stopped on the way out
        if not resume:
            if run_id is None:  # --run-id "" is refused, not a made-up id (review, 2026-11-29)
                run_id = cfg.run_id or new_run_id()
            check_new_run_id(run_id)
            # spawned before the lake's code is imported and read (~0.5 s of its start's path)
            server = servers.enter_context(embedded_server(cfg))
        lake = open_lake(cfg)
        if resume:
            row = load_row(lake, cfg, run_id)
            # once the run is known to exist: a mistyped resume starts no server in that home
            server = servers.enter_context(embedded_server(cfg))
            recorded = config_from_dict(json.loads(row["config"]))
            check_data(recorded, new_run=False)
            changed = changed_prompt_data(json.loads(row.get("notes") or "{}").get("prompt_data"),
                                          recorded.data.prompt_data)
            if changed:
                raise StartupError(f"run '{run_id}': {changed}")
        else:
            refuse_existing(lake, cfg, run_id)
        run_dir = home / "runs" / run_id
        claim_run(run_dir)  # a live owner from the start: `rlake status` does not call it interrupted
        try:
            if resume and num_rollout is not None:  # after the claim: never under a live owner
                from infra.extend import LengthError, set_num_rollout

                try:
                    set_num_rollout(lake, run_id, row, num_rollout)
                except LengthError as err:
                    raise StartupError(str(err)) from None
            if not resume:
                # a run started again after a start-up failure (``wrote_nothing``): its base model
                # is rebuilt, a complete folder there would be used as it is (another model.tiny)
                shutil.rmtree(run_dir / "base_model", ignore_errors=True)
                record_run(lake, cfg, run_id)
                fault_point("after_run_recorded")

            opened: list[RunConfig] = []

            def open_pipeline() -> None:
                from infra.runtime import open_runtime

                try:
                    opened.append(open_runtime(cfg, run_id, resume).cfg)
                except BaseException as e:
                    if resume:
                        raise
                    mark_failed(lake, run_id)
                    if isinstance(e, Exception):
                        raise StartupError(failed_at_start(lake, cfg, run_id, e)) from e
                    raise
                import flows.rl  # noqa: F401 - Prefect's client side imports while its server starts

            with prefect_served(cfg, run_id, open_pipeline, server):
                yield run_id, opened[0]
        finally:
            try:
                servers.close()  # the server stopped before the run is released, as before
            finally:
                release_run(run_dir)


def failed_at_start(lake, cfg: RunConfig, run_id: str, err: Exception) -> str:
    """The error line of a new run that failed after its record, before its first iteration:
    how to go on under its id. What failed is often its recorded config or data, which
    ``rlake resume`` reuses (so it failed again: review, 2026-11-29): a run that wrote nothing
    but its row is started again with ``rlake run`` (``wrote_nothing``); else the resume."""
    try:
        row = lake.get_run(run_id)
    except Exception:  # noqa: BLE001 - unreadable now: the resume's wording, the error itself first
        row = None
    # how to go on first: the error can span lines (torch's state_dict errors do)
    failed = f"run '{run_id}' is recorded as failed before its first iteration"
    if wrote_nothing(lake, cfg, run_id, row):
        return (f"{failed} (nothing of it was written but its runs row: once mended, "
                f"`{start_again_command(run_id, cfg)}` starts it again under this id): {err}")
    return (f"{failed} (if the cause is outside its recorded config and data, "
            f"`{resume_command(run_id, cfg)}` continues it; else start a new run with another "
            f"--run-id): {err}")


@contextmanager
def prepared_replay(cfg: RunConfig, run_id: str, resume: bool) -> Iterator[str]:
    """``prepared_run`` for a replay (``flows.replay.rl_replay``, which records its run row
    itself): a new replay's id refused if a run holds it, the run folder claimed, the runtime
    opened while Prefect's server starts, the server watched; yields the run id."""
    from infra.env import set_environment
    from infra.recovery import claim_run, release_run

    home = set_environment(cfg.home, cfg.torch_threads)
    if not resume:  # under the source's id (or any run's) it would overwrite that run
        refuse_existing(open_lake(cfg), cfg, run_id)
    run_dir = home / "runs" / run_id
    claim_run(run_dir)
    try:
        def open_replay() -> None:
            from infra.runtime import open_runtime

            open_runtime(cfg, run_id, resume=resume, replay=True)
            import flows.replay  # noqa: F401 - as prepared_run's flows.rl

        with embedded_server(cfg) as server, prefect_served(cfg, run_id, open_replay, server):
            yield run_id
    finally:
        release_run(run_dir)


@contextmanager
def embedded_server(cfg: RunConfig) -> Iterator[EmbeddedServer | None]:
    """Prefect's embedded server (``infra.prefect_server.EmbeddedServer``) spawned now, or None
    where the run uses one already running; on the way out, Prefect's clients drained (while it
    still answers) and the server stopped."""
    from infra.prefect_server import EmbeddedServer

    server = EmbeddedServer.start(cfg.home)
    try:
        yield server
    finally:
        if server is not None:
            drain_prefect_clients_if_used()
            server.stop()


@contextmanager
def prefect_served(cfg: RunConfig, run_id: str, meanwhile: Callable[[], None],
                   server: EmbeddedServer | None) -> Iterator[None]:
    """``meanwhile()`` (the slow part of startup) while ``server`` (``embedded_server``) starts,
    then the server waited for and watched while inside: if it ends under the run, the process
    ends (``server_lost``). On the way out a runtime the flow never took is closed."""
    from infra.env import configure_environment
    from infra.prefect_server import ServerWatch, run_server_liveness

    watch = None
    try:
        configure_environment(cfg.home, cfg.torch_threads)
        meanwhile()
        fault_point("before_first_flow")
        if server is not None:
            server.wait()
        liveness = run_server_liveness(server, cfg.home)
        if liveness is not None:
            alive, what = liveness
            watch = ServerWatch(alive, lambda: server_lost(what, run_id, cfg))
        yield
    finally:
        if watch is not None:
            watch.stop()
        _close_unused_runtime(run_id)


def server_lost(what: str, run_id: str, cfg: RunConfig) -> None:
    """The Prefect server the run uses ended under it (its ``rlake serve`` stopped, a crash):
    end this process now, as a kill -9 would, with one line saying how to continue.

    Waiting would not end the run: every Prefect call retries for ~60 s, the iteration's queued
    state writes one after another, and Prefect's events worker logs each lost event in full
    (2026-11-26: a run whose ``rlake serve`` was stopped still hung 4 min later). A kill -9 at
    any moment leaves the lake and the checkpoints consistent (what every resume test kills),
    and the run's helpers end with it (the MLflow helper on its pipe's end, async mode's rollout
    process and Prefect's embedded server by PR_SET_PDEATHSIG)."""
    message = (f"\nerror: {what} ended while run {run_id} ran: the run stops here, as after a "
               f"crash (the lake and checkpoints are consistent); "
               f"`{resume_command(run_id, cfg)}` continues it\n")
    try:
        sys.stdout.flush()
        sys.stderr.write(message)
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: nothing to tell
        pass
    release_named_semaphores()
    os._exit(SERVER_LOST_EXIT)


def drain_prefect_clients_if_used() -> None:
    """Let Prefect's clients send the records they hold, where this process used Prefect (before
    its server stops)."""
    if "flows.durability" in sys.modules:  # Prefect was used: its client may hold records
        from flows.durability import drain_prefect_clients

        drain_prefect_clients()


def _close_unused_runtime(run_id: str) -> None:
    runtime = sys.modules.get("infra.runtime")
    if runtime is not None and run_id in runtime.RUNTIMES:
        from flows.durability import close_runtime

        close_runtime(runtime.RUNTIMES[run_id])
