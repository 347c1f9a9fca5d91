"""Evaluation sets and their rollouts (slime's eval datasets).

Each ``EvalSet`` has its prompts, reward, ``n_samples_per_eval_prompt`` and sampling. The default
eval rollout generates ``n`` samples per prompt in one batched engine call and scores them;
``eval_function_path`` (``fn(ctx, eval_set) -> groups``) replaces it. Eval samples go to the lake
with ``kind = 'eval'`` and ``metadata["eval_dataset"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rewards.registry import Scorer
from rollout.context import (
    RolloutContext,
    check_samples,
    checked_groups,
    group_samples,
    refuse_pending,
)
from rollout.data import load_prompt_file
from rollout.engine import SamplingParams
from rollout.functions import call_named
from rollout.rollout import generate_samples, make_samples
from rollout.sample import Sample


@dataclass
class EvalSet:
    name: str
    records: list[dict]
    source: str
    scorer: Any
    n_samples: int
    sampling: SamplingParams


def build_eval_sets(cfg, held_out: list[dict] | None, held_out_source: str) -> list[EvalSet]:
    """Load every configured eval set (files read and rewards resolved now: errors come before
    any generation). ``path: null`` is the built-in held-out set."""
    out = []
    for ds in cfg.eval.datasets:
        if ds.path is None:
            if not held_out:
                raise ValueError(f"eval dataset '{ds.name}' has no path and there is no built-in "
                                 "held-out set (data.task is null): give it a path")
            records, source = held_out, f"{held_out_source}:{ds.name}"
        else:
            records, source = load_prompt_file(ds.path, *prompt_file_keys(ds, cfg.data)), ds.path
        temperature = ds.temperature if ds.temperature is not None else (
            0.0 if cfg.eval.greedy else cfg.rollout.rollout_temperature)
        sampling = SamplingParams(max_new_tokens=ds.max_response_len or cfg.rollout.rollout_max_response_len,
                                  temperature=temperature, top_p=ds.top_p)
        out.append(EvalSet(name=ds.name, records=records, source=source,
                           scorer=Scorer.from_config(cfg, rm_type=ds.rm_type),
                           n_samples=ds.n_samples_per_eval_prompt, sampling=sampling))
    return out


def prompt_file_keys(ds, data) -> tuple[str, str | None, str | None, str | None]:
    """(input_key, label_key, metadata_key, tool_key) of an eval set's file: its own, else the
    training data's (``data.*``)."""
    return (ds.input_key or data.input_key, ds.label_key or data.label_key,
            ds.metadata_key or data.metadata_key, data.tool_key)


def default_eval_rollout(ctx: RolloutContext, eval_set: EvalSet) -> list[list[Sample]]:
    """``n`` samples for every prompt of the set, generated in one batched call."""
    samples = make_samples(list(enumerate(eval_set.records)), ctx.tokenizer, eval_set.n_samples,
                           eval_set.source, apply_chat_template=ctx.cfg.data.apply_chat_template)
    if ctx.generate_fn is None:
        generate_samples(ctx.engine, ctx.tokenizer, samples, eval_set.sampling)
    else:
        ctx.generate(samples)
    return group_samples(samples)


EVAL_KEY = "eval.eval_function_path"


def eval_fn_groups(out: object, path: str | None, eval_set: EvalSet,
                   vocab_size: int | None = None) -> list[list[Sample]]:
    """The groups an ``eval_function_path`` function returned, checked: a list of groups
    (``checked_groups``) of generated samples (none 'pending': 500 never-generated samples were
    scored and recorded as accuracy 0, review 2026-11-29), each sample's tokens within the
    vocabulary and the set's budget (``check_samples``)."""
    where = f"{EVAL_KEY} '{path}' returned"
    groups = checked_groups(out, where, "expected a list of groups "
                            f"(lists of Sample), one per prompt of eval set '{eval_set.name}'")
    refuse_pending(groups, where)
    check_samples((s for g in groups for s in g), where, eval_set.sampling.max_new_tokens, vocab_size)
    return groups


def run_eval_set(ctx: RolloutContext, eval_set: EvalSet, eval_fn=None) -> list[list[Sample]]:
    """Generate + score one eval set; every group has ``n_samples`` samples."""
    ctx = replace(ctx, sampling=eval_set.sampling, scorer=eval_set.scorer)
    if eval_fn is None:
        groups = default_eval_rollout(ctx, eval_set)
    else:
        path = ctx.cfg.eval.eval_function_path or getattr(eval_fn, "__qualname__", repr(eval_fn))
        out = call_named(f"{EVAL_KEY} '{path}'", eval_fn, ctx, eval_set)
        groups = eval_fn_groups(out, path, eval_set, ctx.vocab_size())
    for g in groups:
        if len(g) != eval_set.n_samples:
            raise ValueError(f"eval set '{eval_set.name}': a group has {len(g)} samples, "
                             f"expected n_samples_per_eval_prompt={eval_set.n_samples}")
        for s in g:
            s.metadata["eval_dataset"] = eval_set.name
    ctx.score([s for g in groups for s in g])
    return groups
