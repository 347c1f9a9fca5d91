"""Rollout tasks: generate samples with the engine, score them with the reward registry."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.runtime import Runtime
from rewards.registry import score_samples
from rollout.rollout import generate_samples, make_samples
from rollout.sample import Sample


@task(name="generate_rollouts", cache_policy=NO_CACHE)
def generate_rollouts(rt: Runtime, iteration: int) -> list[Sample]:
    """rollout_batch_size prompts x n_samples_per_prompt samples with the current weights."""
    r = rt.cfg.rollout
    prompts = rt.dataset.take(iteration * r.rollout_batch_size, r.rollout_batch_size)
    samples = make_samples(prompts, rt.tokenizer, r.n_samples_per_prompt, rt.dataset.source)
    return generate_samples(rt.engine, rt.tokenizer, samples, rt.sampling())


@task(name="score", cache_policy=NO_CACHE)
def score(rt: Runtime, samples: list[Sample]) -> int:
    """Rewards in place; returns the number of samples whose reward function failed."""
    return score_samples(samples, rt.reward_fn)
