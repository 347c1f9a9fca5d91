"""What rlake checks in the samples a user's rollout, generate or eval function returns, before
any of it reaches the lake (docs/rollout.md, "Function paths"): token ids within the model's
vocabulary, loss mask and rollout log-probs one per response token, log-probs finite and <= 0,
the response within its budget, unique sample indexes, generated (not pending) eval samples,
pre-set rewards checked as scored ones are; and errors raised inside the function name it.
With the real TorchEngine on a tiny model, and one run through the real CLI (the refused
iteration leaves no rows; a resume with the function fixed goes on)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from infra.config import load_config
from infra.sides import RolloutSide
from rewards.registry import Scorer, score_samples
from rollout.context import RolloutContext, RolloutOutput
from rollout.data import PromptDataset
from rollout.engine import SamplingParams
from rollout.evaluation import build_eval_sets, run_eval_set
from rollout.rollout import make_samples
from rollout.runner import Rollout
from rollout.sample import Sample, Status
from rollout.torch_engine import TorchEngine
from tasks.rollout import score
from tests.opshelp import TINY, cli_env, rlake, tail

torch.set_num_threads(1)
RECORDS = [{"prompt": f"{a}+{a}=", "label": str(2 * a), "metadata": {}} for a in range(10, 30)]
HERE = "tests.test_rollout_function_checks"
MAX_NEW = 6


def _ctx(tiny, *overrides: str) -> RolloutContext:
    path, tok = tiny
    cfg = load_config(None, ["rollout.n_samples_per_prompt=2", "rollout.rm_type=exact", *overrides])
    engine = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id, seed=0)
    return RolloutContext(cfg=cfg, engine=engine, tokenizer=tok, dataset=PromptDataset(RECORDS, seed=1),
                          scorer=Scorer.from_config(cfg), run_id="run",
                          sampling=SamplingParams(max_new_tokens=MAX_NEW))


def _rollout(tiny, fn: str, *overrides: str) -> RolloutOutput:
    ctx = _ctx(tiny, f"rollout.rollout_function_path={HERE}:{fn}", *overrides)
    return Rollout(ctx.cfg)(ctx, 0)


def _generated(ctx) -> list[list[Sample]]:
    groups = ctx.take_groups(2)
    ctx.generate([s for g in groups for s in g])
    return groups


# --- bug 1: the samples' tokens, mask, log-probs and length ------------------------------------

def _edit(groups, **fields) -> list[list[Sample]]:
    """``fields`` (callables of the sample) applied to the second group's first sample."""
    s = groups[1][0]
    for name, value in fields.items():
        setattr(s, name, value(s))
    return groups


def oov(ctx, iteration):
    return _edit(_generated(ctx), response_token_ids=lambda s: [10**6, *s.response_token_ids[1:]])


def at_vocab_size(ctx, iteration):
    size = ctx.engine.model.config.vocab_size
    return _edit(_generated(ctx), response_token_ids=lambda s: [size, *s.response_token_ids[1:]])


def last_id(ctx, iteration):
    size = ctx.engine.model.config.vocab_size
    return _edit(_generated(ctx), response_token_ids=lambda s: [size - 1, *s.response_token_ids[1:]])


def neg(ctx, iteration):
    return _edit(_generated(ctx), response_token_ids=lambda s: [-5, *s.response_token_ids[1:]])


def neg_prompt(ctx, iteration):
    return _edit(_generated(ctx), prompt_token_ids=lambda s: [-1, *s.prompt_token_ids])


def shortmask(ctx, iteration):
    return _edit(_generated(ctx), loss_mask=lambda s: [1],
                 response_token_ids=lambda s: [*s.response_token_ids, 5, 5][:MAX_NEW],
                 rollout_log_probs=lambda s: [-1.0] * min(MAX_NEW, s.response_length + 2))


def longmask(ctx, iteration):
    return _edit(_generated(ctx), loss_mask=lambda s: [1] * (s.response_length + 3))


def mask_values(ctx, iteration):
    return _edit(_generated(ctx), loss_mask=lambda s: [2] * s.response_length)


def toolong(ctx, iteration):
    return _edit(_generated(ctx), response_token_ids=lambda s: [*s.response_token_ids, *[5] * 100],
                 rollout_log_probs=lambda s: [*s.rollout_log_probs, *[-1.0] * 100],
                 loss_mask=lambda s: [*s.loss_mask, *[1] * 100])


def lp_length(ctx, iteration):
    return _edit(_generated(ctx), rollout_log_probs=lambda s: [-0.5] * (s.response_length + 2))


def lp_positive(ctx, iteration):
    return _edit(_generated(ctx), rollout_log_probs=lambda s: [0.5] * s.response_length)


def lp_nan(ctx, iteration):
    return _edit(_generated(ctx), rollout_log_probs=lambda s: [math.nan] * s.response_length)


@pytest.mark.parametrize("fn, message", [
    ("oov", r"response token id 1000000, outside the model's vocabulary \[0, 55\)"),
    ("at_vocab_size", r"response token id 55, outside the model's vocabulary \[0, 55\)"),
    ("neg", r"response token id -5, outside"),
    ("neg_prompt", r"prompt token id -1, outside"),
    ("shortmask", r"1 loss_mask for \d response tokens: one per response token \(or none\)"),
    ("longmask", r"\d+ loss_mask for \d response tokens"),
    ("mask_values", r"loss_mask values \[2\]: each must be 0 or 1"),
    ("toolong", r"\d+ response tokens, over the budget of 6"),
    ("lp_length", r"\d rollout_log_probs for \d response tokens"),
    ("lp_positive", r"rollout log-prob 0.5 \(\d such\): a log-probability is a finite number <= 0"),
    ("lp_nan", r"rollout log-prob nan"),
])
def test_a_bad_sample_from_a_rollout_function_is_refused_naming_it(tiny, fn, message):
    """Each went into the lake unchecked; training then failed ("index out of range in self"
    naming nothing, or on the mask), and a resume reused the rows and failed the same way for
    ever (review, 2026-11-29). The vocabulary is the model's (55 ids, the tiny model's)."""
    with pytest.raises(ValueError, match=f"^rollout.rollout_function_path '{HERE}:{fn}' returned a "
                                         rf"sample \(group_index 1, index 2\) with {message}"):
        _rollout(tiny, fn)


def empty_mask_and_logprobs(ctx, iteration):
    return _edit(_generated(ctx), loss_mask=lambda s: [], rollout_log_probs=lambda s: [])


@pytest.mark.parametrize("fn", ["last_id", "empty_mask_and_logprobs"])
def test_what_a_rollout_function_may_return(tiny, fn):
    """The last id of the vocabulary; an empty mask (every token trained) and no log-probs
    (none reported), as the trainer reads them."""
    out = _rollout(tiny, fn)
    assert len(out.samples) == 4


def gen_oov(ctx, sample, sampling):
    return Sample(**{**sample.__dict__, "response_token_ids": [99999, 5], "rollout_log_probs": [-1.0, -1.0],
                     "loss_mask": [1, 1], "response": "x", "status": Status.COMPLETED})


def plain(ctx, iteration):
    return _generated(ctx)


def test_a_generate_functions_out_of_vocab_id_is_refused_naming_it(tiny):
    """check_generated did not look at the ids: "index out of range in self" in training."""
    ctx = _ctx(tiny, f"rollout.custom_generate_function_path={HERE}:gen_oov")
    ctx.generate_fn = Rollout(ctx.cfg).generate_fn
    with pytest.raises(ValueError, match=rf"^rollout.custom_generate_function_path '{HERE}:gen_oov' "
                                         r"returned a sample \(group_index 0, index 0\) with response "
                                         r"token id 99999, outside the model's vocabulary \[0, 55\)"):
        ctx.generate([s for g in ctx.take_groups(1) for s in g])


def test_the_calculator_example_passes_the_checks(tiny):
    """Its tool tokens (mask 0, log-prob 0.0) count against the whole response's budget, which
    its generate function keeps (docs/rollout.md, multi-turn)."""
    ctx = _ctx(tiny, f"rollout.rollout_function_path={HERE}:plain",
               "rollout.custom_generate_function_path=examples.calculator_tool.generate:generate")
    ctx.sampling = SamplingParams(max_new_tokens=12)
    out = Rollout(ctx.cfg)(ctx, 0)
    assert all(s.response_length <= 12 and len(s.loss_mask) == s.response_length for s in out.samples)


# --- bug 2: duplicate sample indexes ------------------------------------------------------------

def dup(ctx, iteration):
    groups = _generated(ctx)
    for g in groups:
        for s in g:
            s.index = 0
    return RolloutOutput(groups=groups)


def two_draws(ctx, iteration):
    """Two take_groups calls: the second numbers on from the first."""
    return RolloutOutput(groups=[*_generated(ctx), *_generated(ctx)])


def two_draws_as_list(ctx, iteration):
    return [*_generated(ctx), *_generated(ctx)]


@pytest.mark.parametrize("fn, message", [
    ("dup", r"two train samples of index 0 \(group_index 0 and 0\): a sample's index keys its row"),
])
def test_duplicate_indexes_in_a_rollout_output_are_refused(tiny, fn, message):
    """256 samples of index 0 became one row in the lake (appends skip existing sample_uids),
    training failed on group sizes, and a resume reused the one row for ever."""
    with pytest.raises(ValueError, match=f"^rollout.rollout_function_path '{HERE}:{fn}' returned "
                                         f"{message}"):
        _rollout(tiny, fn)


def test_a_rollout_output_of_two_draws_keeps_both(tiny):
    """Each ``take_groups`` numbered its samples from 0: an output built from two draws was
    refused as duplicate indexes (before that, half its rows were lost in the lake)."""
    out = _rollout(tiny, "two_draws")
    assert [s.index for s in out.samples] == list(range(8))
    assert [s.group_index for s in out.samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len({s.prompt for s in out.samples}) == 4


def test_a_list_of_groups_is_numbered_by_rlake(tiny):
    out = _rollout(tiny, "two_draws_as_list")
    assert [s.index for s in out.samples] == list(range(8))
    assert [s.group_index for s in out.samples] == [0, 0, 1, 1, 2, 2, 3, 3]


# --- bug 6: rewards a rollout function set itself -----------------------------------------------

def nan_reward(response, label, metadata):
    return math.nan


def _preset(tiny) -> list[Sample]:
    ctx = _ctx(tiny)
    samples = [s for g in _generated(ctx) for s in g]
    for s, reward in zip(samples, [math.nan, math.inf, 1.0, None], strict=True):
        s.reward = reward
    return samples


def test_a_non_finite_preset_reward_fails_its_sample_as_a_reward_functions_would(tiny):
    """NaN and inf set by a rollout function skipped the check (only samples without a reward
    were scored): written as completed, the run failed ("'float' object has no attribute
    'numerator'"). Through the run's score step and the context's."""
    scored = [Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1], status=Status.COMPLETED)]
    assert score_samples(scored, nan_reward) == 1
    path, tok = tiny
    for run_score in ("step", "ctx"):
        samples = _preset(tiny)
        ctx = _ctx(tiny)
        if run_score == "step":
            side = RolloutSide(ctx.cfg, "run", None, ctx.engine, tok, ctx.dataset)
            side.reward_fn = ctx.scorer
            failed = score.fn(side, samples)
        else:
            failed = ctx.score(samples)
        assert failed == 2, run_score
        nan, inf, one, unscored = samples
        assert nan.reward_detail == scored[0].reward_detail  # the reason a reward function's NaN gets
        assert (nan.status, nan.reward) == (Status.FAILED, 0.0)
        assert inf.status == Status.FAILED and inf.reward_detail == {
            "error": "ValueError: reward is inf (not a finite number)"}
        assert (one.reward, one.status) == (1.0, Status.COMPLETED)
        assert unscored.reward in (0.0, 1.0) and unscored.status != Status.FAILED


# --- bug 8: pending samples from an eval function -----------------------------------------------

def eval_pending(ctx, eval_set):
    samples = make_samples(list(enumerate(eval_set.records)), ctx.tokenizer, eval_set.n_samples,
                           eval_set.source)
    return [[s] for s in samples]  # never generated


def test_an_eval_function_returning_pending_samples_is_refused(tiny):
    """500 never-generated samples were scored and recorded as accuracy 0, no error."""
    cfg = load_config(None, [f"eval.eval_function_path={HERE}:eval_pending", "rollout.rm_type=exact"])
    (held,) = build_eval_sets(cfg, RECORDS[:5], "builtin:addition")
    ctx = _ctx(tiny)
    ctx.cfg = cfg
    with pytest.raises(ValueError, match=rf"^eval.eval_function_path '{HERE}:eval_pending' returned 5 "
                                         r"of 5 samples still 'pending' \(never generated\)"):
        run_eval_set(ctx, held, eval_fn=eval_pending)


# --- lesser: an error raised inside the user's function names it --------------------------------

def raises(ctx, iteration):
    raise RuntimeError("second call fails")


def gen_raises(ctx, sample, sampling):
    raise KeyError("nope")


def interrupted(ctx, iteration):
    raise KeyboardInterrupt


def test_an_error_inside_a_rollout_or_generate_function_names_it(tiny):
    """They read "error: second call fails" and "error: 'nope'"; Ctrl-C stays an interrupt."""
    with pytest.raises(RuntimeError, match=f"^rollout.rollout_function_path '{HERE}:raises' raised "
                                           "RuntimeError: second call fails$") as err:
        _rollout(tiny, "raises")
    assert str(err.value.__cause__) == "second call fails"
    with pytest.raises(RuntimeError, match=f"^rollout.custom_generate_function_path '{HERE}:gen_raises' "
                                           "raised KeyError: 'nope'$") as err:
        _rollout(tiny, "plain", f"rollout.custom_generate_function_path={HERE}:gen_raises")
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(KeyboardInterrupt):
        _rollout(tiny, "interrupted")


# --- end to end: the refused iteration writes nothing; a resume with the fix goes on -------------

def oov_until_fixed(ctx, iteration):
    """Out-of-vocab ids until the file named by RLAKE_TEST_FIXED exists."""
    import os

    groups = ctx.take_groups(ctx.cfg.rollout.rollout_batch_size)
    ctx.generate([s for g in groups for s in g])
    if not Path(os.environ["RLAKE_TEST_FIXED"]).exists():
        groups[0][0].response_token_ids = [10**6, *groups[0][0].response_token_ids[1:]]
    return groups


def test_the_refused_iteration_writes_nothing_and_resume_goes_on(tmp_path):
    """The bad rows were in the lake and `rlake resume` reused them, failing for ever."""
    from buffer import Lake

    home, fixed = tmp_path / "home", tmp_path / "fixed"
    env = cli_env(None, COLUMNS="1000", RLAKE_TEST_FIXED=str(fixed))
    args = ["run", "--set", f"home={home}", "--set", "run_id=oov", *TINY, "--set", "sft.enabled=false",
            "--set", "eval.eval_interval=100", "--set", "num_rollout=1", "--set", "prefect_task_runs=false",
            "--set", f"rollout.rollout_function_path={HERE}:oov_until_fixed"]
    proc = rlake(args, env, tmp_path / "run.log", timeout=300)
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 1, tail(tmp_path / "run.log")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith(
        f"error: rollout.rollout_function_path '{HERE}:oov_until_fixed' returned a sample "
        "(group_index 0, index 0) with response token id 1000000, outside the model's vocabulary"), text[-2000:]
    lake = Lake(str(home / "lake"))
    kinds = lake.read("trajectories", run_id="oov").column("kind").to_pylist()
    assert set(kinds) <= {"eval"}, kinds  # the held-out set's, evaluated before the first iteration
    fixed.touch()
    proc = rlake(["resume", "oov", "--home", str(home)], env, tmp_path / "resume.log", timeout=300)
    assert proc.returncode == 0, tail(tmp_path / "resume.log")
    rows = lake.read("trajectories", run_id="oov").to_pylist()
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 16 and max(max(r["response_token_ids"] or [0]) for r in train) < 55
    assert lake.read("train_steps", run_id="oov").num_rows == 1


def test_a_log_prob_a_hair_above_zero_is_accepted_a_positive_one_is_not():
    """bf16 engines can round a near-certain token's log-prob just above 0; 0.5 is no log-prob."""
    from rollout.context import LOGPROB_SLACK, sample_problem
    from rollout.sample import Sample

    def sample(lp: float) -> Sample:
        return Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1],
                      response_token_ids=[2], rollout_log_probs=[lp], loss_mask=[1])

    assert sample_problem(sample(LOGPROB_SLACK / 2), 6, 10, complete=True) is None
    assert "finite number <= 0" in sample_problem(sample(0.5), 6, 10, complete=True)
