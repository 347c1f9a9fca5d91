"""Offline replay: a new run that trains on a source run's recorded trajectories, no generation.

    rl_replay(source, iterations A:B, rescore RM):
      starting policy: the source's checkpoint of the first replayed base version if it is on
                       disk, else that version rebuilt from an older source checkpoint and the
                       source's recorded slices (same trainer settings), else the same SFT
                       warm-up as the source (seeded: the same v0)
      for j, source iteration i in enumerate(A..B-1):
        replay_iteration: copy the source rows of iteration i under this run (iteration j,
                          metadata.source_sample_uid), rescored with RM when given
                          -> train (off-policy corrections as configured: the recorded
                          rollout_logprobs are the behaviour policy, e.g. use_tis)
                          -> checkpoint, train_steps row, MLflow, model version

The replay is a run of its own: ``runs.replay_of`` / ``parent_run_id`` name the source, and so does
the MLflow tag ``rlake.replay_of``. With ``--rescore`` the new rewards sit in the replay's rows, so
SQL can join them to the source's on ``metadata.source_sample_uid``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from prefect import flow, tags
from prefect.settings import temporary_settings
from prefect.utilities.annotations import quote

from flows.durability import fail_run, owned_run, register_version, start_or_recover
from flows.rl import FAST_FLOW_SETTINGS, _flat_params, current_reporter, has_eval, sft_warmup
from flows.steps import eval_due, phase, run_iterations, train_and_commit
from infra.checkpoints import rebuild_chain, resume_checkpoint, saved_versions
from infra.config import config_from_dict
from infra.faults import set_iteration
from infra.recovery import run_tag
from infra.runtime import Runtime, runtime_for
from infra.startup import new_run_id, parse_iterations
from rewards.registry import Scorer
from rollout.sample import Sample, Status
from tasks.eval import evaluate
from tasks.lake import write_trajectories
from tasks.rebuild import retrain_step
from tasks.replay import read_replay_slice, read_source_trajectories
from tasks.rollout import score
from tasks.train import publish_weights
from trainers.metrics import rollout_metrics


def source_samples(rows: list[dict], source_run: str) -> list[Sample]:
    """Samples rebuilt from source rows, each remembering its source sample_uid and reward."""
    out = []
    for r in rows:
        s = Sample.from_row(r)
        s.metadata = {**s.metadata, "source_sample_uid": r["sample_uid"], "source_run": source_run,
                      "source_reward": r["reward"]}
        out.append(s)
    return out


def replay_step(rt: Runtime, iteration: int, samples: list[Sample], rescore: bool,
                total: int) -> dict[str, float]:
    """One replay iteration (the module docstring's loop body): ``samples`` (the source's
    iteration, rebuilt by ``source_samples``) rescored if asked, written under this run, trained
    on and committed; evaluated every ``eval_interval`` and after the last of ``total``."""
    start = time.perf_counter()
    timings: dict[str, float] = {"generate": 0.0}
    set_iteration(iteration)
    rt.seed_iteration(iteration)
    base_version = rt.trainer.weight_version
    failed = 0
    if rescore:
        for s in samples:  # score() only scores samples without a reward
            s.status = Status.COMPLETED if s.finish_reason == "stop" else Status.TRUNCATED
            s.reward, s.reward_detail = None, {}
        with phase(timings, "score"):
            failed = score(rt, quote(samples))
    with phase(timings, "lake_write"):
        write_trajectories(rt, quote(samples), iteration)
    stats = {**rollout_metrics(samples, 0.0), "rollout/failed": float(failed)}
    metrics = train_and_commit(rt, iteration, base_version, stats, timings, read_slice=read_replay_slice,
                               total=total)
    timings["total"] = time.perf_counter() - start
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    if eval_due(rt, iteration + 1, total):  # the last one too: its metrics carry the result
        metrics["eval/accuracy"] = evaluate(rt, iteration + 1)["accuracy"]
    return metrics


def _start_policy(rt: Runtime, source_run: str, base: int) -> str:
    """The source's weights at version ``base``: its checkpoint if saved, else rebuilt from the
    lake (``_rebuild_source``), else the SFT warm-up (seeded: the source's v0); published as v0."""
    root = rt.home / "runs" / source_run / "checkpoints"
    source_dir = root / f"v{base:06d}"
    if source_dir.exists():
        rt.trainer.load(str(source_dir))
        rt.trainer.weight_version = 0
        publish_weights(rt, 0)
        return f"checkpoint {source_dir}"
    rebuilt = _rebuild_source(rt, source_run, root, base)
    if rebuilt is not None:
        return rebuilt
    if rt.cfg.sft.enabled and rt.cfg.sft.steps > 0:
        sft_warmup(rt)
        return f"SFT warm-up (the source has no checkpoint of v{base} and it cannot be rebuilt)"
    publish_weights(rt, 0)
    return "base model"


def _rebuild_source(rt: Runtime, source_run: str, root: Path, base: int) -> str | None:
    """The source's version ``base`` where no checkpoint of it was saved (save_interval): load
    the source's newest checkpoint below it and re-train the source's committed steps up to it
    on their samples in the lake (no generation). Only when this run trains with the source's
    trainer settings and seed, else the result would not be the source's weights (None)."""
    row = rt.lake.get_run(source_run)
    source_cfg = config_from_dict(json.loads(row["config"])) if row else None
    start = resume_checkpoint(saved_versions(root), base)
    if source_cfg is None or start is None or (source_cfg.trainer, source_cfg.seed) != (rt.cfg.trainer, rt.cfg.seed):
        return None
    try:
        chain = rebuild_chain(rt.lake.read("train_steps", run_id=source_run).to_pylist(), start, base)
    except ValueError:
        return None
    rt.trainer.load(str(root / f"v{start:06d}"))
    for step in chain:
        rt.seed_iteration(step["iteration"])
        retrain_step(rt, step, run_id=source_run)
    rt.trainer.weight_version = 0
    publish_weights(rt, 0)
    return (f"checkpoint {root / f'v{start:06d}'} + iterations {[s['iteration'] for s in chain]} "
            f"of {source_run} re-trained from the lake")


@flow(name="rl_replay")
def rl_replay(source_run: str, config: dict, run_id: str | None = None, iterations: str | None = None,
              rescore: str | None = None, resume: bool = False) -> dict:
    """Replay ``source_run``'s trajectories (``iterations`` A:B) into a new run, or, with
    ``resume``, continue the replay run ``run_id`` from its last committed iteration (after a
    crash: same durability rules as ``rl_run``); see the module doc."""
    with temporary_settings(updates=FAST_FLOW_SETTINGS):
        cfg = config_from_dict(config)
        run_id = run_id or new_run_id()
        # the CLI opens the runtime before the first flow, while Prefect's server starts
        rt = runtime_for(cfg, run_id, resume, replay=True)
        with owned_run(rt):
            rt.reporter = current_reporter()
            if rescore:  # an rm_type name, or a module:function path
                rt.reward_fn = rescorer(rt.cfg, rescore)
            rt.tracker.start(run_id, params=_flat_params(rt.cfg),
                             tags={"rlake.run_id": run_id, "rlake.replay_of": source_run,
                                   "rlake.replay_iterations": iterations or "all",
                                   "rlake.rescore": rescore or ""}, mlflow_run_id=rt.mlflow_run_id)
            note = {"iterations": iterations, "rescore": rescore}
            row = {"run_id": run_id, "config": rt.cfg.model_dump_json(),
                   "mlflow_run_id": rt.tracker.run_id, "replay_of": source_run,
                   "parent_run_id": source_run, "notes": json.dumps(note)}
            rt.lake.upsert_run({**row, "status": "running"})
            try:
                start_or_recover(rt, resume)
                with tags(run_tag(run_id)):
                    n_iterations = replay_iterations(rt, source_run, iterations, rescore is not None)
                rt.lake.upsert_run({**row, "status": "completed"})
                rt.tracker.finish("FINISHED")
            except BaseException as err:
                fail_run(rt, err)  # as a run's: each record attempted, the error kept
                raise
        return {"run_id": run_id, "replay_of": source_run, "iterations": n_iterations,
                "home": str(rt.home), "lake_uri": rt.cfg.resolved_lake_uri, "mlflow_uri": rt.tracker.uri}


def replay_iterations(rt: Runtime, source_run: str, iterations: str | None, rescore: bool) -> int:
    """Replay source iterations A..B-1 as this run's iterations 0.., from ``rt.start_iteration``
    on (0 unless resumed); evaluate at the start, every eval_interval and at the end. Each is a
    ``replay_iteration`` flow run whose parameters name it (run, iteration, source iteration):
    its samples reach it in memory, they are in the lake (as Prefect parameters they were
    ~190 KB per flow run of the quickstart, in Prefect's database)."""
    first, stop = parse_iterations(iterations)
    source = read_source_trajectories(rt, source_run, first, stop).to_pylist()
    if not source:
        raise ValueError(f"run '{source_run}' has no train trajectories in iterations "
                         f"{iterations or 'all'}")
    by_iter: dict[int, list[dict]] = {}
    for r in source:
        by_iter.setdefault(r["iteration"], []).append(r)
    order = sorted(by_iter)
    if rt.start_iteration == 0 and not rt.checkpoint_dir(0).exists():
        base = min(r["weight_version"] for r in by_iter[order[0]])
        rt.tracker.set_tags({"rlake.replay_start": _start_policy(rt, source_run, base)})
        register_version(rt, 0, None, None, 0)
    if eval_due(rt, rt.start_iteration, len(order)) and not has_eval(rt, rt.trainer.weight_version):
        _report_eval(rt, rt.start_iteration)
    rt.report("rl_start", {"start": rt.start_iteration, "total": len(order)})

    @flow(name="replay_iteration", validate_parameters=False)  # rlake passes them itself
    def replay_iteration(run_id: str, iteration: int, source_iteration: int) -> dict[str, float]:
        samples = source_samples(by_iter[source_iteration], source_run)
        return replay_step(rt, iteration, samples, rescore, total=len(order))

    def parameters(j: int) -> dict:
        return {"run_id": rt.run_id, "iteration": j, "source_iteration": order[j]}

    run_iterations(rt, replay_iteration, rt.report, stop=len(order), parameters=parameters)
    if not has_eval(rt, rt.trainer.weight_version):
        _report_eval(rt, len(order))
    return len(order)


def _report_eval(rt: Runtime, iteration: int) -> None:
    rt.report("eval", {"iteration": iteration, "accuracy": evaluate(rt, iteration)["accuracy"]})


def rescorer(cfg, rescore: str) -> Scorer:
    """The run's Scorer with its reward replaced: an ``rm_type`` name or a ``module:function``
    path (slime's ``fn(cfg, sample)`` shape, like ``custom_rm_path``)."""
    base = Scorer.from_config(cfg)
    custom = ":" in rescore
    return dataclasses.replace(base, rm_type=base.rm_type if custom else rescore,
                               custom_rm_path=rescore if custom else None)
