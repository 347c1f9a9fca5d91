"""The RL run as Prefect flows: ``rl_run`` -> ``sft_warmup`` (once) -> ``rl_iteration`` x N.

    rl_iteration(run, i):
      generate_rollouts(prompts i, weights v)    -> samples
      score(samples)                             -> rewards
      write_rollout(samples)  (submitted)        -> lake commit (+ filtered, aborted, partial rows)
      read_training_slice(run, v, max_staleness) -> unconsumed samples, version >= v - k
                                                    (from the rows being written, after step 1)
      train(slice)                               -> weights v+1, metrics (while the commit lands)
      publish_weights(v+1)                       -> HF checkpoint, engine updated
      record_train_step + log_metrics            -> train_steps row (the durable point, after the
                                                    rows' commit), MLflow; behind (on its own
                                                    thread) while iteration i+1 generates
      register weight version                    -> MLflow model version (lineage tags)
      evaluate (every eval_interval)             -> evals rows

The part from the slice read on is ``flows.steps.train_and_commit`` (shared with replay). On a
resume, ``flows.durability`` reuses trajectories already in the lake and repairs what a crash left
(docs/operations.md); ``infra.faults`` points mark where a test may kill the process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from prefect import flow, tags
from prefect.settings import temporary_settings
from prefect.utilities.annotations import quote

from flows.async_run import rollout_process, run_async
from flows.durability import (
    fail_run,
    owned_run,
    recorded_samples,
    register_version,
    start_or_recover,
)
from flows.durability import update_run_row as _update_run
from flows.steps import (
    commits_behind,
    eval_due,
    landed,
    phase,
    run_iterations,
    settle_commit,
    train_and_commit,
)
from infra.affinity import training_cores
from infra.config import RunConfig, config_from_dict, flat_config, megatron_world_size
from infra.faults import fault_point, set_iteration
from infra.interrupts import flow_call
from infra.modeling import resolve_device
from infra.recovery import run_tag
from infra.runtime import Runtime, runtime_for
from rollout.sample import Status
from tasks.eval import evaluate
from tasks.lake import read_training_slice, written_slice
from tasks.rollout import generate_rollouts, rollout_table, score, write_rollout
from tasks.sft import sft_train
from tasks.train import publish_weights
from trainers.metrics import rollout_metrics

# Measured on these machines: heartbeats off + batched server writers make a flow run per
# iteration cost ~0.2 s instead of ~1.2 s (docs/design.md). Only settable this way.
FAST_FLOW_SETTINGS = {"flows.heartbeat_frequency": None}


def sft_warmup(rt: Runtime) -> dict[str, float]:
    """Supervised warm-up (loss_type: sft) to a middling accuracy; publishes weight version 0.
    One ``sft_warmup`` flow run; the runtime reaches it by closure (a flow's parameters go to
    the Prefect API, so only the run id is one)."""

    @flow(name="sft_warmup")
    def warmup(run_id: str) -> dict[str, float]:
        metrics = sft_train(rt)
        publish_weights(rt, 0)
        return metrics

    return flow_call(warmup, rt.run_id)


def sync_iteration(rt: Runtime, iteration: int) -> dict[str, float]:
    """Sync mode's iteration ``iteration`` (the module docstring's ``rl_iteration``)."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    base_version = rt.trainer.weight_version
    set_iteration(iteration)
    rt.seed_iteration(iteration)
    recorded = recorded_samples(rt, iteration)  # a resume after the lake append
    read_slice = read_training_slice
    if recorded is not None:
        samples, rollout_stats = recorded
        timings["generate"] = 0.0
        failed = sum(s.status == Status.FAILED for s in samples)
        fault_point("after_lake_append")
    else:
        with phase(timings, "generate"):
            rollout = generate_rollouts(rt, iteration)  # dynamic sampling / partial rollouts inside
            samples, rollout_stats = rollout.samples, rollout.stats
        # the previous iteration committed behind while this one generated: its train_steps row
        # lands before anything of this iteration is written (a resume starts after it)
        with phase(timings, "commit_wait"):
            settle_commit(rt)
        fault_point("during_generate")
        with phase(timings, "score"):
            failed = score(rt, quote(samples))
        with phase(timings, "lake_write"):
            rows = rollout_table(rt, rollout, iteration)  # train + filtered/aborted/partial rows
            written = write_rollout.submit(rt, quote(rows), rollout.commit_info())
        # after the process's first step, which consumed every unconsumed train row in its range
        # (each step consumes its whole slice), the slice is this rollout's own rows: train
        # while they commit
        if iteration > rt.start_iteration:
            read_slice = written_slice(rows, lambda: landed(rt, written.result))
        else:
            landed(rt, written.result)
    stats = {**rollout_metrics(samples, timings["generate"]), "rollout/failed": float(failed),
             **rollout_stats}
    evaluating = eval_due(rt, iteration + 1, rt.cfg.num_rollout)
    metrics = train_and_commit(rt, iteration, base_version, stats, timings, read_slice,
                               behind=commits_behind(rt, iteration, evaluating))
    timings["total"] = time.perf_counter() - start
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    if evaluating:
        metrics["eval/accuracy"] = evaluate(rt, iteration + 1)["accuracy"]
    return metrics


@flow(name="rl_run")
def rl_run(config: dict, run_id: str | None = None, resume: bool = False) -> dict:
    """A whole run: warm-up once, then iterations from the last durable one to ``num_rollout``."""
    with temporary_settings(updates=FAST_FLOW_SETTINGS):
        return run_pipeline(config_from_dict(config), run_id, resume)


_REPORTER = None


def set_reporter(reporter) -> None:
    """Where live progress goes (the CLI's rich display); a plain callable(event, payload)."""
    global _REPORTER
    _REPORTER = reporter


def current_reporter():
    """The callable ``set_reporter`` gave (runs and replays report to it), or None."""
    return _REPORTER


def run_pipeline(cfg: RunConfig, run_id: str | None, resume: bool) -> dict:
    # the CLI opens the runtime before the first flow, while Prefect's server starts
    rt = runtime_for(cfg, run_id, resume)
    with owned_run(rt):
        rt.reporter = _REPORTER
        reporter = rt.report
        try:
            rt.tracker.start(rt.run_id, params=_flat_params(rt.cfg),
                             tags={"rlake.run_id": rt.run_id}, mlflow_run_id=rt.mlflow_run_id)
            if resume:  # MLflow's params keep their first value: a changed length (infra.extend)
                rt.tracker.set_tags({"rlake.num_rollout": rt.cfg.num_rollout})
            _update_run(rt, "running")
            start_or_recover(rt, resume)
            # every subflow run carries the tag; async mode's rollout process starts now, so
            # that its start-up overlaps the warm-up
            with tags(run_tag(rt.run_id)), rollout_process(rt) as producer, run_cores(rt.cfg):
                if rt.start_iteration == 0 and not rt.checkpoint_dir(0).exists():
                    if rt.cfg.sft.enabled and rt.cfg.sft.steps > 0:
                        reporter("sft_start", {"steps": rt.cfg.sft.steps})
                        sft_warmup(rt)
                    else:
                        publish_weights(rt, 0)
                    register_version(rt, 0, None, None, 0)
                if eval_due(rt, rt.start_iteration, rt.cfg.num_rollout) and \
                        not has_eval(rt, rt.trainer.weight_version):
                    acc = evaluate(rt, rt.start_iteration)["accuracy"]
                    reporter("eval", {"iteration": rt.start_iteration, "accuracy": acc})
                reporter("rl_start", {"start": rt.start_iteration, "total": rt.cfg.num_rollout})
                if rt.cfg.mode == "async":  # the rollout side runs ahead in its own process
                    run_async(rt, reporter, producer)
                else:
                    run_sync(rt, reporter)
            _update_run(rt, "completed")
            rt.tracker.finish("FINISHED")
            return {"run_id": rt.run_id, "home": str(rt.home), "lake_uri": rt.cfg.resolved_lake_uri,
                    "mlflow_uri": rt.tracker.uri, "checkpoints": str(rt.checkpoint_root)}
        except BaseException as err:
            fail_run(rt, err)
            raise


def pins_cores(cfg: RunConfig, device: str) -> bool:
    """Whether a run pins its processes (``pin_cores``, infra/affinity.py: the training process
    on ``torch_threads`` cores of its own, its child processes on the others). Never with Ray
    (it places its own workers), nor where Megatron trains in ranks of its own (world > 1: the
    training would be on the helpers' cores). Async mode: yes (the rollout side is one of the
    children). Sync mode: only where every child is a helper (Prefect's server, the MLflow
    tracker, a custom reward function's workers: started during the run, they go on the helpers'
    cores too, ``infra.spawned.in_launcher``), i.e. the torch engine and trainer on ``device``
    cpu. An SGLang engine's servers do a sync run's generation in children of their own, which
    the helpers' cores would starve; a pinned sync run on a GPU, or with Megatron, is untested."""
    if not cfg.pin_cores or cfg.cluster.ray_address is not None:
        return False
    if cfg.trainer.backend == "megatron" and megatron_world_size(cfg.trainer) > 1:
        return False
    if cfg.mode == "async":
        return True
    return cfg.rollout.engine == "torch" and cfg.trainer.backend == "torch" and device == "cpu"


@contextmanager
def run_cores(cfg: RunConfig) -> Iterator[None]:
    """The run's processes pinned while the block runs (``pins_cores``), as they were after. Sync
    mode's train step ran ~20 ms slower unpinned than async's pinned (the helpers took turns on
    its core): pinned, sync's iteration is 0.905x over 8 alternated pairs (``bench/paired.py
    --mode sync --b pin_cores=false``, docs/async-log.md, 2026-12-02)."""
    with training_cores(cfg.torch_threads) if pins_cores(cfg, resolve_device(cfg.device)) \
            else nullcontext():
        yield


def run_sync(rt: Runtime, reporter) -> None:
    """Iterations ``rt.start_iteration .. num_rollout - 1``, one ``rl_iteration`` flow run each
    (parameters run id and iteration; the runtime reaches it by closure)."""

    # rlake passes (run_id, iteration) itself: no pydantic model built per call to check them
    # (~0.75 ms of the training process's CPU an iteration)
    @flow(name="rl_iteration", validate_parameters=False)
    def rl_iteration(run_id: str, iteration: int) -> dict[str, float]:
        return sync_iteration(rt, iteration)

    run_iterations(rt, rl_iteration, reporter)


def has_eval(rt: Runtime, version: int) -> bool:
    evals = rt.lake.read("evals", run_id=rt.run_id, columns=["weight_version"])
    return version in set(evals.column("weight_version").to_pylist())


def _flat_params(cfg: RunConfig) -> dict[str, str]:
    return {key: str(value) for key, value in flat_config(cfg).items()}
