"""Rollout tasks: generate (with dynamic sampling / partial rollouts), score, write to the lake."""

from __future__ import annotations

import pyarrow as pa

from buffer.schema import rows_to_table
from infra.runtime import Runtime
from rollout.context import RolloutContext, RolloutOutput, score_unscored
from rollout.sample import Sample, Status
from tasks.step import step_task


def rollout_context(rt: Runtime) -> RolloutContext:
    return RolloutContext(cfg=rt.cfg, engine=rt.engine, tokenizer=rt.tokenizer, dataset=rt.dataset,
                          scorer=rt.reward_fn, sampling=rt.sampling(), data_position=rt.data_position,
                          lake=rt.lake, run_id=rt.run_id)


@step_task(name="generate_rollouts")
def generate_rollouts(rt: Runtime, iteration: int) -> RolloutOutput:
    """rollout_batch_size groups x n_samples_per_prompt samples with the current weights,
    starting at the run's data position (advanced by the prompts this iteration drew)."""
    ctx = rollout_context(rt)
    out = rt.rollout(ctx, iteration)
    rt.data_position = ctx.data_position
    out.stats["data/skipped_too_long"] = float(rt.dataset.skipped_too_long)
    out.stats.update(engine_counters(rt.engine))
    return out


def engine_counters(engine) -> dict[str, float]:
    """The engine's own counters as metrics, ``<engine name>/<counter>`` (SGLang's: servers and
    routers restarted, requests failed and re-issued), each counted since the engine started
    (in this process: a resume starts from 0); none for an engine without ``stats``."""
    return {f"{engine.name}/{k}": float(v) for k, v in getattr(engine, "stats", {}).items()}


@step_task(name="score")
def score(rt: Runtime, samples: list[Sample]) -> int:
    """Rewards in place for samples not scored yet, rewards set already checked as scored ones
    are (``score_unscored``); returns how many samples' reward failed."""
    score_unscored(samples, rt.reward_fn)
    return sum(s.status == Status.FAILED and "error" in s.reward_detail for s in samples)


def rollout_table(rt: Runtime, rollout: RolloutOutput, iteration: int) -> pa.Table:
    """Every sample of the iteration (train, filtered, aborted/partial) as ``trajectories`` rows,
    ``created_at`` stamped: the table ``write_rollout`` appends."""
    return rows_to_table("trajectories", rollout.rows(rt.run_id, iteration, rt.engine.name,
                                                      rt.cfg.rollout.partial_rollout))


@step_task(name="write_rollout", retries=2, retry_delay_seconds=1)
def write_rollout(rt: Runtime, rows: pa.Table, commit_info: dict[str, str]) -> int | None:
    """One Delta commit with the iteration's ``rollout_table`` and the rollout's stats in
    ``commit_info`` (data position included, for a resume that reuses these rows); idempotent on
    sample_uid, so a retry or resume never duplicates. Returns the commit's version (None: every
    row was there already)."""
    return rt.lake.append_trajectories(rows, commit_info=commit_info)
