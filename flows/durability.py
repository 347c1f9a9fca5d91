"""Resume support for the run flow: reuse what the lake already holds, repair what a crash left.

The durability order of an iteration (flows/rl.py) is

    lake append -> train -> engine hand-off (+ checkpoint every save_interval, written in the
    background: tmp folder, atomic rename) -> train_steps row (THE commit)
    -> MLflow metrics + model version -> evaluation

(the commit and the MLflow work may run behind, while the next iteration generates: that one
writes nothing before the commit has landed, ``flows.steps.settle_commit``), so after
``kill -9`` the lake says exactly how far the run got: iterations with a train_steps row
are done; an iteration whose trajectories are in the lake but not consumed is re-trained from them
(``recorded_samples``), never regenerated; what comes after the commit (MLflow, registry) is
re-done by ``recover`` if missing. The lake is the write-ahead log of the weights: a resume loads
the newest checkpoint at or below the committed version and re-trains the committed steps above
it on the samples their rows name (``rebuild_committed``), again without generation.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from infra.checkpoints import checkpoint_due, rebuild_chain, stale_folders
from infra.faults import set_iteration
from infra.recovery import (
    claim_run,
    delete_prefetched,
    mark_crashed,
    orphan_servers,
    release_run,
    stop_processes,
    tag_current_flow_run,
)
from infra.runtime import RUNTIMES, Runtime
from rollout.context import rollout_stats_from_commit
from rollout.data import POSITION_METRIC
from rollout.sample import Sample
from tasks.eval import mlflow_key
from tasks.rebuild import retrain_step
from tasks.train import publish_weights, save_checkpoint, wait_for_checkpoints


def recorded_samples(rt: Runtime, iteration: int) -> tuple[list[Sample], dict[str, float]] | None:
    """The iteration's trajectories and rollout stats if a previous process committed them but
    did not train on them (checked for the first iteration of a process only; later ones cannot
    have any). The data position moves to where that rollout left it, as if it had just run."""
    if iteration != rt.start_iteration:
        return None
    # every train row of the iteration, not only those of base_version: with partial rollouts a
    # group finished by an older policy (surplus last time) is kept with its older version
    rows = rt.lake.iteration_rows(rt.run_id, iteration, "train").to_pylist()
    if not rows:
        return None
    rows.sort(key=lambda r: r["sample_index"])
    stats = rollout_stats_from_commit(rt.lake.trajectory_commit_info(rt.run_id, iteration))
    if stats is None or POSITION_METRIC not in stats:
        # rows from before the stats were committed with them (or past the log retention):
        # a plain rollout draws rollout_batch_size prompts
        stats = {POSITION_METRIC: float(rt.data_position + rt.cfg.rollout.rollout_batch_size)}
        rt.report("warning", {"message": f"iteration {iteration}: no rollout stats in the lake; "
                              f"data position assumed {int(stats[POSITION_METRIC])}"})
    rt.data_position = int(stats[POSITION_METRIC])
    rt.report("reuse", {"iteration": iteration, "samples": len(rows)})
    return [Sample.from_row(r) for r in rows], stats


def register_version(rt: Runtime, version: int, iteration: int | None, lake_version: int | None,
                     n_samples: int, saved: bool | None = None) -> None:
    """Weight version ``version`` as an MLflow model version with its lineage tags, registered on
    the tracker's background thread (off the iteration's path; a crash before it is sent is
    repaired by ``register_missing_versions``). The ``checkpoint`` tag is its folder when one is
    saved (``saved``; None: look on disk), else empty: such a version is rebuilt from an older
    checkpoint and the lake (``rebuild_committed``)."""
    saved = rt.checkpoint_dir(version).exists() if saved is None else saved
    tags = {"iteration": "sft" if iteration is None else iteration, "lake_version": lake_version,
            "sample_count": n_samples, "checkpoint": str(rt.checkpoint_dir(version)) if saved else ""}
    rt.tracker.register_weight_version_later(rt.run_id, version, tags)


# what resume needs of the run's train_steps rows (read once, ``committed_steps``)
STEP_COLUMNS = ["iteration", "weight_version", "lake_version", "n_samples", "metrics", "timings"]


def committed_steps(rt: Runtime) -> list[dict]:
    """The run's train_steps rows (``STEP_COLUMNS``): what the lake holds as committed."""
    return rt.lake.read("train_steps", run_id=rt.run_id, columns=STEP_COLUMNS).to_pylist()


def relog_missing_metrics(rt: Runtime, steps: list[dict]) -> list[int]:
    """Re-log to MLflow the metrics of committed iterations (``steps``: ``committed_steps``) a
    crash kept from being logged (the train_steps row holds them: ``metrics`` and ``timings``
    JSON). Returns those iterations."""
    logged = rt.tracker.logged_steps("weight_version")
    missing = [s for s in steps if s["iteration"] not in logged]
    for s in missing:
        metrics = json.loads(s["metrics"] or "{}")
        timings = json.loads(s["timings"] or "{}")
        rt.tracker.log_metrics({**metrics, **{f"time/{k}": v for k, v in timings.items()}},
                               s["iteration"])
    return sorted(s["iteration"] for s in missing)


def relog_missing_evals(rt: Runtime) -> list[int]:
    """Re-log to MLflow the evaluations the lake holds (``evals`` rows) that a crash kept from
    being logged (an evaluation's metrics wait in the tracker until a flush; a resume does not
    evaluate a version again once its rows are in). Returns the steps re-logged."""
    rows = rt.lake.read("evals", run_id=rt.run_id,
                        columns=["iteration", "dataset", "metric", "value"]).to_pylist()
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r["iteration"], {})[mlflow_key(r["dataset"], r["metric"])] = r["value"]
    logged: dict[str, set[int]] = {}  # each key's logged steps, read once
    missing = []
    for step, metrics in sorted(by_step.items()):
        for key in metrics.keys() - logged.keys():
            logged[key] = rt.tracker.logged_steps(key)
        lost = {k: v for k, v in metrics.items() if step not in logged[k]}
        if lost:
            rt.tracker.log_metrics(lost, step)
            missing.append(step)
    return missing


def register_missing_versions(rt: Runtime, steps: list[dict]) -> list[int]:
    """Register committed weight versions (``steps``: ``committed_steps``) missing from the
    MLflow registry. A version whose checkpoint was due has it, as in a run never interrupted:
    on disk, or written again by ``rebuild_committed`` after this (a crash lost the write)."""
    done = rt.tracker.registered_weight_versions(rt.run_id)
    added = []
    if 0 not in done and rt.checkpoint_dir(0).exists():
        register_version(rt, 0, None, None, 0)
        added.append(0)
    for s in steps:
        if s["weight_version"] not in done:
            due = checkpoint_due(s["iteration"], rt.cfg.num_rollout, rt.cfg.save_interval)
            register_version(rt, s["weight_version"], s["iteration"], s["lake_version"],
                             s["n_samples"] or 0, saved=True if due else None)
            added.append(s["weight_version"])
    return added


def recover(rt: Runtime, own_flow_run: str | None) -> dict:
    """After a crash: stop the dead process's Prefect server, delete the flow runs it created
    ahead for its next iterations (never started), mark its other flow runs Crashed, and
    re-do the post-commit work it lost (MLflow metrics, evaluations' metrics, model versions).
    Returns what it did."""
    done = {"stopped_servers": [], "deleted_prefetched_runs": [], "crashed_flow_runs": [],
            "relogged": [], "registered": []}
    home = os.environ.get("PREFECT_HOME")
    if home:
        done["stopped_servers"] = stop_processes(orphan_servers(home))
    steps = committed_steps(rt)
    # before mark_crashed: never started (a committed iteration's run did, whatever its state)
    done["deleted_prefetched_runs"] = delete_prefetched(rt.run_id, {s["iteration"] for s in steps})
    done["crashed_flow_runs"] = mark_crashed(rt.run_id, exclude={own_flow_run} if own_flow_run else None)
    done["relogged"] = relog_missing_metrics(rt, steps)
    done["relogged_evals"] = relog_missing_evals(rt)
    done["registered"] = register_missing_versions(rt, steps)
    done["removed_stale_checkpoints"] = remove_stale_checkpoints(rt)
    done["rebuilt"] = rebuild_committed(rt)
    rt.tracker.set_tags({"rlake.last_resume": json.dumps(done)})
    rt.report("recovered", done)
    return done


def remove_stale_checkpoints(rt: Runtime) -> list[str]:
    """Delete what a crash left in the checkpoint folder that no resume may trust (``*.tmp``
    writes, versions above the commit): a later crash could otherwise find an old folder at or
    below a newer commit. Runs once this process owns the run. Returns the names removed."""
    stale = stale_folders(rt.checkpoint_root, rt.committed_version())
    for path in stale:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as err:  # reported as removed before (review, 2026-11-29)
            if path.name.endswith(".tmp"):  # never trusted, and written over by its next save
                rt.warn(f"could not delete the unfinished checkpoint write {path}: {err}")
                continue
            raise RuntimeError(f"could not delete {path}, a checkpoint above the committed "
                               f"weight version that a later resume could trust: {err}; "
                               "delete it, then resume") from err
    return [p.name for p in stale if not p.exists()]


def rebuild_committed(rt: Runtime) -> dict:
    """Bring the trainer from the checkpoint it was loaded from (``resume_point``) to the
    committed version: re-train each committed step after it, in order, on exactly the samples
    its ``train_steps`` row names, read from the lake (no generation), seeded as the run seeds
    that iteration, writing the due checkpoints the crash lost; then hand the weights to the
    engine. Returns {"from": v, "iterations": [...],
    "mismatched": [...]}: with ``deterministic``, an iteration whose re-trained loss terms differ
    from the recorded ones is named there (and reported as a warning)."""
    start, committed = rt.trainer.weight_version, rt.committed_version()
    if start >= committed:
        return {"from": start, "iterations": [], "mismatched": []}
    steps = rt.lake.read("train_steps", run_id=rt.run_id).to_pylist()
    chain = rebuild_chain(steps, start, committed)
    mismatched = []
    for step in chain:
        set_iteration(step["iteration"])
        rt.seed_iteration(step["iteration"])
        if not retrain_step(rt, step) and rt.cfg.deterministic:
            mismatched.append(step["iteration"])
        if checkpoint_due(step["iteration"], rt.cfg.num_rollout, rt.cfg.save_interval):
            # the crash lost this due checkpoint (a write in flight): write it again
            save_checkpoint(rt, rt.checkpoint_dir(step["weight_version"]), background=True)
    publish_weights(rt, committed, save=False)
    done = {"from": start, "iterations": [s["iteration"] for s in chain], "mismatched": mismatched}
    rt.report("rebuild", done)
    if mismatched:
        rt.report("warning", {"message": f"rebuilt iterations {mismatched} trained to other loss "
                              "values than recorded: the rebuilt weights may differ"})
    return done


def close_runtime(rt: Runtime) -> None:
    """Free what the runtime holds: the engine (servers), the trainer (its processes), the reward
    worker processes, its entry in ``RUNTIMES``; a checkpoint still being written is waited for
    first (its error raised)."""
    try:
        wait_for_checkpoints(rt)
    finally:
        rt.engine.shutdown()
        if hasattr(rt.trainer, "close"):
            rt.trainer.close()
        for scorer in [rt.reward_fn, *(e.scorer for e in getattr(rt, "eval_sets", None) or [])]:
            if hasattr(scorer, "close"):  # custom reward functions' worker processes
                scorer.close()
        if hasattr(rt.tracker, "close"):  # the MLflow helper process (infra.tracker_process)
            rt.tracker.close()
        if rt.spawned is not None:  # async mode's rollout process, never started (a failure)
            rt.spawned.stop()
            rt.spawned = None
        RUNTIMES.pop(rt.run_id, None)


def drain_prefect_clients(timeout_s: float = 10.0) -> None:
    """Send what Prefect's client still queues (flow and task run logs, events) now, while the
    run's own server answers: left for Prefect's exit hook, it went to a server already
    stopped, and each batch retried for ~60 s (a run at ``PREFECT_LOGGING_LEVEL=DEBUG`` took
    77 s to exit instead of 10, 2026-11-26)."""
    for module, name in (("prefect.logging.handlers", "APILogWorker"),
                         ("prefect.events.worker", "EventsWorker")):
        worker = getattr(sys.modules.get(module), name, None)  # never started: nothing queued
        if worker is not None:
            worker.drain_all(timeout=timeout_s)


@contextmanager
def owned_run(rt: Runtime) -> Iterator[Runtime]:
    """This process owns the run while inside: the run folder is claimed first (a second live
    process stops here, before anything marks the run), then released and the runtime closed
    whatever happens."""
    try:
        claim_run(rt.run_dir)
    except ValueError:
        close_runtime(rt)
        raise
    try:
        yield rt
    finally:
        release_run(rt.run_dir)
        close_runtime(rt)


def update_run_row(rt: Runtime, status: str, **extra) -> None:
    """The run's ``runs`` row: config, status, its MLflow run."""
    rt.lake.upsert_run({"run_id": rt.run_id, "config": rt.cfg.model_dump_json(), "status": status,
                        "mlflow_run_id": rt.tracker.run_id,
                        "updated_at": datetime.now(UTC), **extra})


def stop_status(err: BaseException | None) -> tuple[str, str]:
    """(runs row status, MLflow run status) of a run ended by ``err``: "interrupted"/KILLED when
    it was stopped (Ctrl-C, or the SIGTERM Prefect turns into ``TerminationSignal``: `rlake
    serve` stopping its flow runs), "failed"/FAILED for anything else. After a Ctrl-C the CLI
    noted (``infra.interrupts``) any error is the interrupt's, as the CLI's exit code says (130):
    in async mode the Ctrl-C also ends the rollout process, and the training side may see that
    first ("the rollout process exited"; a CI run recorded such a run failed)."""
    from prefect.exceptions import TerminationSignal

    from infra.interrupts import interrupt_noted

    if isinstance(err, KeyboardInterrupt | TerminationSignal) or interrupt_noted():
        return "interrupted", "KILLED"
    return "failed", "FAILED"


def fail_run(rt: Runtime, err: BaseException | None = None) -> None:
    """The failure path of a run or a replay, whatever ended it (a full disk, a bad lake, an
    exception in SFT, a Ctrl-C): the MLflow run is closed and the runs row marked
    (``stop_status``: a run stopped by the user read "failed" before 2026-11-29), each attempted
    even if the other cannot be written (a replay's own failure path wrote the row unguarded, so
    a lake it could not write lost the MLflow run's close and the error that ended it). The
    caller re-raises (Prefect then marks the flow run Failed)."""
    row_status, mlflow_status = stop_status(err)
    try:
        rt.tracker.finish(mlflow_status)
    except Exception as e:  # noqa: BLE001 - the original error is what the user needs
        rt.report("warning", {"message": f"could not close the MLflow run: {e}"})
    try:
        update_run_row(rt, row_status)
    except Exception as e:  # noqa: BLE001
        rt.report("warning", {"message": f"could not mark the run {row_status} in the lake: {e}"})


def start_or_recover(rt: Runtime, resume: bool) -> None:
    """Tag this flow run with the run; on a resume, first repair what the crash left
    (``recover``)."""
    own_flow_run = tag_current_flow_run(rt.run_id)
    if resume:
        recover(rt, own_flow_run)
