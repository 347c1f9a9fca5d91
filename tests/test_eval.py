"""Eval sets: files + built-in held-out, per-set reward/n/temperature/length, pass@k, custom eval
function; generated with the real TorchEngine on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from infra.config import ConfigError, load_config
from rollout.context import RolloutContext
from rollout.data import PromptDataset
from rollout.engine import SamplingParams
from rollout.evaluation import build_eval_sets, run_eval_set
from rollout.torch_engine import TorchEngine
from tasks.eval import eval_metrics, mlflow_key
from trainers.algorithms import pass_at_k

torch.set_num_threads(1)
HELD = [{"prompt": f"{a}+1=", "label": str(a + 1), "metadata": {}} for a in range(10, 16)]

def _ctx(tiny, cfg):
    path, tok = tiny
    engine = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id, seed=0)
    return RolloutContext(cfg=cfg, engine=engine, tokenizer=tok, dataset=PromptDataset(HELD),
                          scorer=None, sampling=SamplingParams(max_new_tokens=4))


def test_eval_metrics_formula():
    rewards = [1, 0, 0, 0, 1, 1, 0, 0]  # two prompts, n = 4: c = 1 and c = 2
    m = eval_metrics([float(r) for r in rewards], 4)
    assert set(m) == {"pass@1", "pass@2", "pass@4", "mean_reward"}
    assert m["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)
    assert m["pass@1"] == pytest.approx(3 / 8) and m["pass@4"] == 1.0 and m["mean_reward"] == 3 / 8
    assert mlflow_key("held_out", "pass@4") == "eval/pass_at_4"
    assert mlflow_key("gsm", "mean_reward") == "eval/gsm/mean_reward"

def test_eval_set_metrics_count_a_failed_reward_and_give_no_score_when_all_failed():
    from rollout.sample import Sample, Status
    from tasks.eval import eval_set_metrics

    def sample(reward, status):
        return Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1], reward=reward,
                      status=status)

    some = [sample(1.0, Status.COMPLETED), sample(0.0, Status.FAILED),
            sample(1.0, Status.COMPLETED), sample(0.0, Status.COMPLETED)]
    m = eval_set_metrics(some, 1)
    assert m["failed_ratio"] == 0.25 and m["pass@1"] == 0.5 and m["mean_reward"] == 0.5
    assert eval_set_metrics([sample(None, Status.FAILED)] * 4, 2) == {"failed_ratio": 1.0}


def test_two_eval_sets_with_their_own_settings(tiny, tmp_path):
    path = tmp_path / "ev.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}*2=", "a": i * 2}) + "\n" for i in range(5)))
    cfg = load_config(None, [
        f'eval.datasets=[{{name: held_out}}, {{name: doubles, path: "{path}@[1:4]", rm_type: math, '
        'n_samples_per_eval_prompt: 4, temperature: 1.0, max_response_len: 3, input_key: q, '
        'label_key: a}]'])
    sets = build_eval_sets(cfg, HELD, "builtin:addition")
    assert [s.name for s in sets] == ["held_out", "doubles"]
    assert sets[0].sampling.temperature == 0.0 and sets[1].sampling.temperature == 1.0
    ctx = _ctx(tiny, cfg)
    held = run_eval_set(ctx, sets[0])
    doubles = run_eval_set(ctx, sets[1])
    assert [len(g) for g in held] == [1] * 6 and [len(g) for g in doubles] == [4] * 3
    assert all(s.response_length <= 3 and s.reward in (0.0, 1.0) for g in doubles for s in g)
    assert {s.metadata["eval_dataset"] for g in doubles for s in g} == {"doubles"}
    assert [g[0].label for g in doubles] == ["2", "4", "6"]
    # greedy held-out: the same weights give the same responses
    again = run_eval_set(ctx, sets[0])
    assert [g[0].response for g in again] == [g[0].response for g in held]

def echo_eval(ctx, eval_set):
    from rollout.sample import Sample, Status

    return [[Sample(group_index=i, index=i, prompt=r["prompt"], prompt_token_ids=[1], label=r["label"],
                    response=r["label"], status=Status.COMPLETED)] for i, r in enumerate(eval_set.records)]

def test_eval_function_path_and_errors(tiny):
    cfg = load_config(None, ["eval.eval_function_path=tests.test_eval:echo_eval", "rollout.rm_type=exact"])
    (held,) = build_eval_sets(cfg, HELD, "builtin:addition")
    groups = run_eval_set(_ctx(tiny, cfg), held, eval_fn=echo_eval)
    assert all(s.reward == 1.0 for g in groups for s in g)
    with pytest.raises(ValueError, match="no built-in held-out"):
        build_eval_sets(cfg, [], "x")
    with pytest.raises(ConfigError, match="unique"):
        load_config(None, ["eval.datasets=[{name: a}, {name: a}]"])
    with pytest.raises(ValueError, match="unknown rm_type 'zz'"):
        build_eval_sets(load_config(None, ["eval.datasets=[{name: held_out, rm_type: zz}]"]), HELD, "x")


def eval_none(ctx, eval_set):
    return None


def eval_no_groups(ctx, eval_set):
    return []


def eval_flat(ctx, eval_set):
    return [s for g in echo_eval(ctx, eval_set) for s in g]


@pytest.mark.parametrize("fn, error, message", [
    ("eval_none", TypeError, "returned NoneType: expected a list of groups"),
    ("eval_no_groups", ValueError, "returned no groups: expected a list of groups"),
    ("eval_flat", TypeError, "returned a flat list of Sample"),
])
def test_eval_function_bad_return_names_the_key(tiny, fn, error, message):
    """None, [] or a flat list from eval.eval_function_path: one error naming the key and the
    function (review, 2026-11-29: "'NoneType' object is not iterable", "division by zero")."""
    cfg = load_config(None, [f"eval.eval_function_path=tests.test_eval:{fn}", "rollout.rm_type=exact"])
    (held,) = build_eval_sets(cfg, HELD, "builtin:addition")
    with pytest.raises(error, match=f"^eval.eval_function_path 'tests.test_eval:{fn}' {message}"):
        run_eval_set(_ctx(tiny, cfg), held, eval_fn=globals()[fn])
