"""The shared-prompt training forward equals the plain one (values, gradients, a whole train
call) and really runs each group's prompt once."""

from __future__ import annotations

import random

import pytest
import torch

from infra.modeling import load_model
from tests.trainer_fixtures import VOCAB_HI, VOCAB_LO, build_model, params, trainer
from trainers.base import TrainBatch, pad_batch
from trainers.critic import ValueModel, response_values
from trainers.shared_prompt import can_share_prompt, prompt_groups, worth_sharing
from trainers.torch_trainer import response_logprobs

torch.set_num_threads(1)


def grouped_batch(groups: int = 4, per_prompt: int = 4, seed: int = 0,
                  max_response: int = 6) -> TrainBatch:
    """GRPO-shaped: ``groups`` prompts of different lengths, ``per_prompt`` responses of 1 to
    ``max_response`` tokens each (one of them empty), rewards 0/1."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(3 + 2 * g)]
        for j in range(per_prompt):
            prompts.append(prompt)
            length = 0 if (g, j) == (1, 2) else rng.randint(1, max_response)
            responses.append([rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)])
    n = len(prompts)
    return TrainBatch(
        sample_uids=[f"s/{i}" for i in range(n)], prompt_token_ids=prompts,
        response_token_ids=responses, loss_mask=[[1] * len(r) for r in responses],
        rollout_logprobs=[[] for _ in range(n)], rewards=[float(rng.random() < 0.5) for _ in range(n)],
        group_keys=[f"g{i // per_prompt}" for i in range(n)], weight_versions=[0] * n)


def test_prompt_groups_are_runs_of_equal_prompts():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 9], [5, 6, 0, 0], [5, 6, 7, 1], [5, 6, 7, 1]])
    prompt_len = torch.tensor([3, 3, 2, 3, 3])
    # rows 0-1: same prompt (response tokens differ); row 2: a prefix of it, another prompt;
    # rows 3-4: the first prompt again, but not next to rows 0-1: a new group
    assert prompt_groups(ids, prompt_len).tolist() == [0, 0, 1, 2, 2]


def test_distinct_prompts_are_not_shared():
    pb = pad_batch(grouped_batch(groups=4, per_prompt=1), 0)
    assert not worth_sharing(pb, prompt_groups(pb.input_ids, pb.prompt_len))


@pytest.mark.parametrize("chunk, max_response", [(None, 6), (7, 6), (None, 1)])
def test_shared_equals_plain_values_and_gradients(tmp_path, chunk, max_response):
    """max_response 1: every response token is predicted by its prompt, no response pass."""
    model = load_model(build_model(tmp_path))
    pb = pad_batch(grouped_batch(max_response=max_response), 0)
    assert can_share_prompt(model) and worth_sharing(pb, prompt_groups(pb.input_ids, pb.prompt_len))
    weights = torch.randn(pb.mask.shape, generator=torch.Generator().manual_seed(0))
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = response_logprobs(model, pb, 0.8, with_entropy=True, vocab_chunk_size=chunk,
                                      share_prompt=share)
        ((weights * logp * pb.mask).sum() + 0.3 * (ent * pb.mask).sum()).backward()
        out[share] = (logp.detach() * pb.mask, ent.detach() * pb.mask,
                      [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    for got, want in zip(out[True][2], out[False][2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_critic_values_shared_equal_plain_values_and_gradients(tmp_path):
    model = load_model(build_model(tmp_path))
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.value_head.weight, generator=torch.Generator().manual_seed(1))
    pb = pad_batch(grouped_batch(), 0)
    out = {}
    for share in (False, True):
        critic.zero_grad(set_to_none=True)
        values = response_values(critic, pb, share)
        (values * pb.mask).pow(2).sum().backward()
        out[share] = (values.detach() * pb.mask, [p.grad.clone() for p in critic.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    for got, want in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_each_prompt_runs_once(tmp_path):
    """The token embedding sees U x P + B x (R - 1) positions, not B x (P + R)."""
    model = load_model(build_model(tmp_path))
    pb = pad_batch(grouped_batch(groups=4, per_prompt=4), 0)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    response_logprobs(model, pb, share_prompt=True)
    assert seen == [4 * int(pb.prompt_len.max()), 16 * (pb.response_ids.shape[1] - 1)]
    seen.clear()
    response_logprobs(model, pb, share_prompt=False)
    assert seen == [pb.input_ids.numel()]


@pytest.mark.parametrize("overrides", [{}, {"advantage_estimator": "ppo"},
                                       {"use_kl_loss": True, "kl_loss_coef": 0.1}])
def test_train_call_is_the_same_with_and_without_sharing(tmp_path, overrides):
    """One train call moves the weights the same way (within AdamW's rounding amplification):
    GRPO (old log-probs from the grad pass),
    PPO (the critic's values shared too), KL to the reference (its log-probs shared too)."""
    path = build_model(tmp_path)
    batch = grouped_batch(seed=1)
    results = {}
    for share in (False, True):
        tr = trainer(path, 4, share_prompt_forward=share, **overrides)
        metrics = tr.train(batch)
        results[share] = (metrics, params(tr.model),
                          params(tr.critic) if tr.critic is not None else {})
    for key in ("pg_loss", "value_loss", "kl_loss"):
        if key in results[False][0]:
            assert results[True][0][key] == pytest.approx(results[False][0][key], abs=1e-6), key
    # AdamW's first step is ~ lr * g / |g| per element (lr 1e-2): rounding in a near-zero
    # gradient moves that element by up to ~1e-5, not a difference in the math
    for part in (1, 2):
        for name, want in results[False][part].items():
            torch.testing.assert_close(results[True][part][name], want, atol=1e-5, rtol=1e-5)
    if overrides.get("advantage_estimator") == "ppo":
        assert results[True][2]  # the critic was trained and compared


def test_not_shared_under_activation_checkpointing(tmp_path):
    tr = trainer(build_model(tmp_path), 4, recompute_granularity="full", advantage_estimator="ppo")
    assert not can_share_prompt(tr.model)
    assert not can_share_prompt(tr._ensure_critic().backbone)
