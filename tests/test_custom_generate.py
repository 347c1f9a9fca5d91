"""A custom generate function (``rollout.custom_generate_function_path``) written as
docs/rollout.md shows it, and what rlake refuses from one; with the real TorchEngine on a tiny
model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from infra.config import load_config
from rollout.context import RolloutContext
from rollout.data import PromptDataset
from rollout.engine import SamplingParams
from rollout.sample import Status
from rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
RECORDS = [{"prompt": f"{a}+1=", "label": str(a + 1), "metadata": {}} for a in range(10, 14)]


def as_documented(ctx, sample, sampling):
    """docs/rollout.md's example: it sets the response fields, not the weight version."""
    res = ctx.engine.generate([sample.prompt_token_ids], replace(sampling, seed=None))[0]
    ids = list(res.token_ids)
    return replace(sample, response_token_ids=ids, rollout_log_probs=list(res.logprobs),
                   loss_mask=[1] * len(ids), response=ctx.tokenizer.decode(ids),
                   status=Status.COMPLETED)


def _context(tiny, generate_fn) -> RolloutContext:
    path, tok = tiny
    engine = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id, weight_version=3, seed=0)
    cfg = load_config(None, ["rollout.n_samples_per_prompt=2"])
    return RolloutContext(cfg=cfg, engine=engine, tokenizer=tok, dataset=PromptDataset(RECORDS),
                          scorer=None, sampling=SamplingParams(max_new_tokens=4),
                          generate_fn=generate_fn)


def test_a_documented_generate_function_gets_the_engines_weight_version(tiny):
    """Its samples were all weight version 0 (the field's default): the second iteration's
    slice (versions >= 1) was empty and the run failed (review, 2026-11-29)."""
    ctx = _context(tiny, as_documented)
    samples = [s for g in ctx.take_groups(2) for s in g]
    ctx.generate(samples)
    assert {s.weight_version for s in samples} == {3}
    assert all(s.status == Status.COMPLETED and 0 < s.response_length <= 4 for s in samples)


def _bad(field: str, value):
    def generate(ctx, sample, sampling):
        return replace(as_documented(ctx, sample, sampling), **{field: value})
    return generate


@pytest.mark.parametrize("field, value, message", [
    ("loss_mask", [1] * 9, "9 loss_mask for"),
    ("rollout_log_probs", [], "0 rollout_log_probs for"),
    ("status", Status.PENDING, "still 'pending'"),
])
def test_what_a_generate_function_must_give_back(tiny, field, value, message):
    """Each was taken as it came: a mask longer than the response was trained on, empty
    log-probs read as a train/rollout log-prob difference of 0."""
    ctx = _context(tiny, _bad(field, value))
    with pytest.raises(ValueError, match=f"custom_generate_function_path returned .*{message}"):
        ctx.generate([s for g in ctx.take_groups(1) for s in g])


def test_a_response_over_the_budget_is_refused(tiny):
    def too_long(ctx, sample, sampling):
        done = as_documented(ctx, sample, sampling)
        ids = done.response_token_ids * 5
        return replace(done, response_token_ids=ids, rollout_log_probs=[0.0] * len(ids),
                       loss_mask=[1] * len(ids))
    ctx = _context(tiny, too_long)
    with pytest.raises(ValueError, match="over the budget of 4"):
        ctx.generate([s for g in ctx.take_groups(1) for s in g])
