"""Rollout with the real TorchEngine on a tiny model: Sample <-> lake rows, segments, dynamic
sampling, partial rollouts (through a real lake), custom rollout functions."""

from __future__ import annotations

import pytest
import torch

from buffer import Lake
from infra.config import load_config
from rewards.registry import Scorer
from rollout.context import RolloutContext
from rollout.data import PromptDataset
from rollout.dynamic import default_rollout
from rollout.engine import SamplingParams
from rollout.filters import check_reward_nonzero_std
from rollout.partial import load_partial_groups, mask_old_policy_tokens
from rollout.rollout import generate_samples, make_samples
from rollout.runner import Rollout
from rollout.sample import Sample, Status
from rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
RECORDS = [{"prompt": f"{a}+{a}=", "label": str(2 * a), "metadata": {"a": a}} for a in range(10, 40)]



def _ctx(tiny, overrides, stop_half=False, lake=None, max_new=8) -> RolloutContext:
    path, tok = tiny
    cfg = load_config(None, ["rollout.n_samples_per_prompt=3", "rollout.rm_type=exact", *overrides])
    engine = TorchEngine(str(path), tok.eos_token_id, tok.pad_token_id, seed=0)
    stops = tuple(range(4, len(tok), 2)) if stop_half else ()  # ~half the vocabulary stops
    return RolloutContext(cfg=cfg, engine=engine, tokenizer=tok, dataset=PromptDataset(RECORDS, seed=1),
                          scorer=Scorer.from_config(cfg), lake=lake, run_id="run",
                          sampling=SamplingParams(max_new_tokens=max_new, stop_token_ids=stops))


def even_row(cfg, group):
    return group[0].row % 2 == 0


def test_sample_row_round_trip_with_slime_fields():
    s = Sample(group_index=2, index=7, prompt=[{"role": "user", "content": "1+1="}], prompt_token_ids=[1, 5],
               label="2", response="2", response_token_ids=[6], rollout_log_probs=[-0.5], loss_mask=[1],
               reward=1.0, reward_detail={"score": 1.0}, status=Status.COMPLETED, finish_reason="stop",
               weight_version=3, metadata={"task": "x"}, data_source="f.jsonl", row=4,
               weight_versions=[2, 3], remove_sample=True, train_metadata={"loss": "sft"},
               session_id="abc", non_generation_time=0.25)
    row = s.to_row("run", 5, "torch")
    assert row["sample_uid"] == "run/5/7" and row["status"] == "completed"
    assert isinstance(row["prompt"], str) and "_sample" in row["metadata"]
    assert Sample.from_row(row) == s
    plain = Sample(group_index=0, index=0, prompt="p", prompt_token_ids=[1])
    assert "_sample" not in plain.to_row("r", 0, "torch")["metadata"]
    assert Sample.from_row(plain.to_row("r", 0, "torch")) == plain


def test_segments_equal_one_call_structure(tiny):
    path, tok = tiny
    ctx = _ctx(tiny, [])
    samples = make_samples(ctx.dataset.take(0, 2), tok, 3, "t")
    steps = 0
    while any(s.status == Status.PENDING for s in samples):
        generate_samples(ctx.engine, tok, samples, ctx.sampling, chunk_tokens=3)
        steps += 1
    assert steps == 3  # 8 tokens in steps of 3 (nothing hits EOS in this seed's first tokens)
    for s in samples:
        n = s.response_length
        assert len(s.rollout_log_probs) == n == len(s.loss_mask) and all(m == 1 for m in s.loss_mask)
        assert s.status in (Status.TRUNCATED, Status.COMPLETED)
        assert s.status != Status.TRUNCATED or n == 8
        assert s.weight_versions == [0] * len(s.weight_versions) and len(s.weight_versions) >= 1
        assert s.response == tok.decode(s.response_token_ids, skip_special_tokens=True)


def test_dynamic_sampling_keeps_filters_aborts(tiny):
    ctx = _ctx(tiny, ["rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=6",
                      "rollout.dynamic_sampling_filter_path=tests.test_rollout:even_row"])
    rows = [row for row, _ in ctx.dataset.take(0, 18)]
    out = Rollout(ctx.cfg)(ctx, iteration=0)
    # expected from the deterministic prompt order: rounds of 6 until 4 even rows are kept
    evens, rounds = [], 0
    while len(evens) < 4:
        evens += [r for r in rows[rounds * 6:(rounds + 1) * 6] if r % 2 == 0]
        rounds += 1
    drawn = rows[:rounds * 6]
    assert [g[0].row for g in out.groups] == evens[:4]
    assert len(out.filtered) == sum(r % 2 for r in drawn)
    assert len(out.aborted) == len(evens) - 4  # kept beyond the batch: surplus
    assert out.stats["rollout/groups_kept"] == 4 and out.stats["rollout/rounds"] == rounds
    assert out.stats["rollout/data_position_end"] == ctx.data_position == rounds * 6
    assert [s.index for s in out.samples] == list(range(12))
    assert all(s.reward is not None for g in out.groups + out.filtered for s in g)


def test_default_filter_is_reward_std():
    mk = lambda r: Sample(group_index=0, index=0, prompt="", prompt_token_ids=[], reward=r)  # noqa: E731
    assert check_reward_nonzero_std(None, [mk(1.0), mk(0.0)])
    assert not check_reward_nonzero_std(None, [mk(1.0), mk(1.0)])
    cfg = load_config(None, ["rollout.rollout_batch_size=2", "rollout.over_sampling_batch_size=4"])
    assert Rollout(cfg).keep is not None and Rollout(load_config(None, [])).keep is None


def test_filter_that_rejects_everything_is_a_clear_error(tiny):
    ctx = _ctx(tiny, ["rollout.rollout_batch_size=2", "rollout.over_sampling_batch_size=2",
                      "rollout.dynamic_sampling_filter_path=tests.test_rollout:reject_all"])
    with pytest.raises(RuntimeError, match="kept no group in 2 rounds"):
        default_rollout(ctx, 0, keep=lambda g: False, max_rounds=2)


def reject_all(cfg, group):
    return False


def test_dynamic_sampling_rounds_run_out_with_some_kept(tiny):
    """Fewer groups than rollout_batch_size pass the filter before max_rounds: the rollout
    returns what it kept (0 < kept < target), nothing is aborted, every drawn prompt counted."""
    ctx = _ctx(tiny, ["rollout.rollout_batch_size=5", "rollout.over_sampling_batch_size=6",
                      "rollout.dynamic_sampling_filter_path=tests.test_rollout:even_row"])
    rows = [row for row, _ in ctx.dataset.take(0, 6)]
    evens = [r for r in rows if r % 2 == 0]
    assert 0 < len(evens) < 5, rows  # this seed's first round: the case under test
    out = default_rollout(ctx, 0, keep=lambda g: even_row(ctx.cfg, g), max_rounds=1)
    assert [g[0].row for g in out.groups] == evens
    assert [g[0].row for g in out.filtered] == [r for r in rows if r % 2]
    assert out.aborted == []
    assert out.stats["rollout/groups_kept"] == len(evens) and out.stats["rollout/rounds"] == 1
    assert out.stats["rollout/prompts_drawn"] == 6 == ctx.data_position
    assert all(s.status != Status.PENDING and s.reward is not None for s in out.samples)


@pytest.mark.parametrize("mask_offpolicy", [True, False])
def test_partial_rollout_through_the_lake(tiny, tmp_path, mask_offpolicy):
    """Iteration 0's surplus groups are written ``partial``; iteration 1 (a fresh context, as
    after a restart: the pending buffer comes from the lake alone) continues them. With
    ``mask_offpolicy_in_partial_rollout`` the older policy's tokens get loss_mask 0, else 1."""
    lake = Lake(str(tmp_path / "lake"))
    opts = ["rollout.rollout_batch_size=2", "rollout.over_sampling_batch_size=6",
            "rollout.generation_chunk_tokens=2", "rollout.partial_rollout=true",
            f"rollout.mask_offpolicy_in_partial_rollout={str(mask_offpolicy).lower()}",
            "rollout.dynamic_sampling_filter_path=tests.test_rollout:keep_all"]
    ctx = _ctx(tiny, opts, stop_half=True, lake=lake)
    out0 = Rollout(ctx.cfg)(ctx, 0)
    assert len(out0.groups) == 2 and len(out0.aborted) >= 1
    unfinished = [s for g in out0.aborted for s in g if s.status == Status.ABORTED]
    assert unfinished and any(s.response_length > 0 for s in unfinished)  # cut mid-flight
    assert all(s.finish_reason == "abort" and s.response_length < 8 for s in unfinished)
    lake.append_trajectories(out0.rows("run", 0, "torch", partial_rollout=True))
    kinds = lake.read("trajectories", run_id="run", columns=["kind"]).column("kind").to_pylist()
    assert kinds.count("partial") == sum(len(g) for g in out0.aborted)
    assert set(lake.training_slice("run", 0).column("kind").to_pylist()) == {"train"}

    previous = {f"run/partial-0/{p.index}": p for g in out0.aborted for p in g}
    ctx.engine.load_state_dict(ctx.engine.model.state_dict(), weight_version=1)  # a newer policy
    resumed = load_partial_groups(lake, "run", 1)
    assert [len(g) for g in resumed] == [len(g) for g in out0.aborted]
    ctx1 = _ctx(tiny, opts, stop_half=True, lake=lake)
    ctx1.engine, ctx1.data_position = ctx.engine, ctx.data_position
    out1 = Rollout(ctx1.cfg)(ctx1, 1)
    assert out1.stats["rollout/groups_resumed"] == len(out0.aborted)
    continued = [s for g in out1.groups + out1.aborted for s in g if "continued_from" in s.metadata]
    assert sorted(s.metadata["continued_from"] for s in continued) == sorted(previous)
    masked = regenerated = 0
    for s in continued:
        prev = previous[s.metadata["continued_from"]]
        k = prev.response_length
        if prev.status != Status.ABORTED:  # a surplus sample finished by version 0: too old for
            # iteration 1's slice (max_staleness 0), so generated again from its prompt
            assert s.metadata["regenerated_stale_version"] == 0
            assert s.weight_version == 1 and set(s.weight_versions) == {1}, s.weight_versions
            assert s.loss_mask == [1] * s.response_length
            regenerated += 1
            continue
        assert s.response_token_ids[:k] == prev.response_token_ids  # continued, not restarted
        # generated by version 0 < 1: masked out, or kept as trained-on tokens
        assert s.loss_mask[:k] == ([0] * k if mask_offpolicy else prev.loss_mask), s.loss_mask
        assert mask_offpolicy or prev.loss_mask == [1] * k
        if prev.status == Status.ABORTED and s.response_length > k:
            assert s.loss_mask[k:] == [1] * (s.response_length - k)
            assert s.weight_versions == [*prev.weight_versions, 1] and s.weight_version == 1
            masked += 1
    assert masked >= 1 and regenerated >= 1
    # every sample iteration 1 keeps is within its training slice's bound: nothing left untrained
    assert all(s.weight_version == 1 for g in out1.groups for s in g)


def keep_all(cfg, group):
    return True


def test_mask_old_policy_tokens():
    assert mask_old_policy_tokens([1, 1, 0], generated_by=2, current_version=3) == [0, 0, 0]
    assert mask_old_policy_tokens([1, 1, 0], generated_by=3, current_version=3) == [1, 1, 0]


def custom_rollout(ctx, iteration):
    groups = ctx.take_groups(3)
    ctx.generate([s for g in groups for s in g])
    return groups


def test_custom_rollout_function_advances_position(tiny):
    ctx = _ctx(tiny, ["rollout.rollout_function_path=tests.test_rollout:custom_rollout"])
    out = Rollout(ctx.cfg)(ctx, 0)
    assert len(out.groups) == 3 and ctx.data_position == 3
    assert out.stats["rollout/data_position_end"] == 3
    assert all(s.status != Status.PENDING for s in out.samples)


def rollout_none(ctx, iteration):
    return None


def rollout_flat(ctx, iteration):
    groups = ctx.take_groups(2)
    samples = [s for g in groups for s in g]
    ctx.generate(samples)
    return samples


def rollout_no_groups(ctx, iteration):
    from rollout.context import RolloutOutput

    return RolloutOutput(groups=[])


def rollout_ungenerated(ctx, iteration):
    return ctx.take_groups(2)


def rollout_uneven(ctx, iteration):
    """Moves one sample of the second group into the first: groups of 4 and 2 for n = 3."""
    groups = ctx.take_groups(2)
    ctx.generate([s for g in groups for s in g])
    return [groups[0] + groups[1][:1], groups[1][1:]]


@pytest.mark.parametrize("fn, error, message", [
    ("rollout_none", TypeError, "returned NoneType: expected a RolloutOutput or a list of groups"),
    ("rollout_flat", TypeError, "returned a flat list of Sample"),
    ("rollout_no_groups", ValueError, "returned no groups"),
    ("rollout_ungenerated", ValueError, r"returned 6 of 6 samples still 'pending' \(never generated\)"),
    ("rollout_uneven", ValueError, r"returned a group of 4 samples \(group 0, 2 uneven in all\): "
                                   r"every group holds rollout.n_samples_per_prompt = 3"),
])
def test_rollout_function_bad_return_names_the_key(tiny, fn, error, message):
    """A wrong type, no groups, or samples never generated is one error naming the key and the
    function, before anything is committed (review, 2026-11-29: cryptic errors, or pending
    samples committed as train rows)."""
    ctx = _ctx(tiny, [f"rollout.rollout_function_path=tests.test_rollout:{fn}"])
    with pytest.raises(error, match=f"^rollout.rollout_function_path 'tests.test_rollout:{fn}' {message}"):
        Rollout(ctx.cfg)(ctx, 0)


def filter_raises(cfg, group):
    raise RuntimeError("boom in filter")


def test_dynamic_sampling_filter_errors_name_the_filter(tiny):
    """Nothing kept, or the filter raising: the error names rollout.dynamic_sampling_filter_path
    and the function (docs/rollout.md: "an error naming the filter")."""
    opts = ["rollout.rollout_batch_size=2", "rollout.over_sampling_batch_size=2"]
    ctx = _ctx(tiny, [*opts, "rollout.dynamic_sampling_filter_path=tests.test_rollout:reject_all"])
    with pytest.raises(RuntimeError, match=r"kept no group in 8 rounds of 2 prompts \(16 filtered by "
                                           r"rollout.dynamic_sampling_filter_path "
                                           r"'tests.test_rollout:reject_all'\)"):
        Rollout(ctx.cfg)(ctx, 0)
    ctx = _ctx(tiny, [*opts, "rollout.dynamic_sampling_filter_path=tests.test_rollout:filter_raises"])
    with pytest.raises(RuntimeError, match="^rollout.dynamic_sampling_filter_path "
                                           "'tests.test_rollout:filter_raises' raised RuntimeError: "
                                           "boom in filter$"):
        Rollout(ctx.cfg)(ctx, 0)


def test_calculator_lone_close_brackets_use_the_whole_budget(tiny):
    """examples/calculator_tool: a lone "]" is no tool call, so it does not count against
    max_turns; a model that only writes "]" runs to the token budget (it stopped after
    max_turns + 1 = 5 tokens of 12, recorded truncated; review, 2026-11-29)."""
    path, tok = tiny
    ctx = _ctx(tiny, ["rollout.custom_generate_function_path=examples.calculator_tool.generate:generate"],
               max_new=12)
    ctx.sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    close_id, eq_id = tok.convert_tokens_to_ids("]"), tok.convert_tokens_to_ids("=")
    weights = {k: v.clone() for k, v in ctx.engine.model.state_dict().items() if k != "lm_head.weight"}
    emb = weights["model.embed_tokens.weight"]
    emb[close_id] = 2 * emb[eq_id]  # tied head: greedy "]" after every context ("=" was greedy)
    ctx.engine.load_state_dict(weights, weight_version=0)
    ctx.generate_fn = Rollout(ctx.cfg).generate_fn
    samples = [s for g in ctx.take_groups(2) for s in g]
    ctx.generate(samples)
    for s in samples:
        assert s.response_token_ids == [close_id] * 12, s.response
        assert s.loss_mask == [1] * 12 and s.metadata["tool_calls"] == 0
        assert s.status == Status.TRUNCATED and s.finish_reason == "length"
