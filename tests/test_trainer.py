"""The torch trainer, wired through TrainerConfig: every estimator, KL (loss and reward), TIS,
gradient accumulation, SFT loss in the RL loop, and checkpoints with the critic."""

from __future__ import annotations

import math

import pytest
import torch

from infra.config import ConfigError, config_from_dict
from tests.trainer_fixtures import (
    build_model,
    logprobs,
    make_batch,
    params,
    sequence_logprobs,
    trainer,
)
from trainers import algorithms as alg
from trainers.critic import CRITIC_FILE, response_values
from trainers.torch_trainer import pad_batch

torch.set_num_threads(1)

ESTIMATORS = ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
# two groups of four: in each, samples 0 and 3 are right
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("trainer"))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_raises_logprob_of_rewarded_samples(model_dir, estimator):
    batch = make_batch(REWARDS, seed=1)
    tr = trainer(model_dir, 4, advantage_estimator=estimator, lr=3e-3)
    before_params = params(tr.model)
    before = sequence_logprobs(tr, batch)
    metrics = tr.train(batch)
    after = sequence_logprobs(tr, batch)
    delta = after - before
    good = torch.tensor(REWARDS) == 1.0
    assert tr.weight_version == 1
    assert any(not torch.equal(before_params[k], v) for k, v in params(tr.model).items())
    # rewarded samples gain log-probability relative to the unrewarded ones
    assert delta[good].mean() > delta[~good].mean() + 1e-3, (estimator, delta)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "grad_norm", "lr",
                "advantage_mean", "advantage_std", "return_mean", "train_rollout_logprob_abs_diff"):
        assert math.isfinite(metrics[key]), key
    assert (tr.critic is not None) == (estimator == "ppo")
    assert tr._reference is None  # no KL configured: the reference is never loaded
    if estimator == "ppo":
        assert metrics["value_loss"] > 0 and "value_clipfrac" in metrics


def test_grpo_loss_equals_hand_computed_value(model_dir):
    """Two groups of two, rewards [1, 0] and [0.5, 0.5], response lengths 2, 3, 1, 4.

    GRPO: group 1 has mean 0.5, unbiased std sqrt(0.5) = 0.70711, so A = +-0.5 / (0.70711 + 1e-6)
    = +-0.70711; group 2 is constant: A = 0. At the first step r = 1, so L_t = -A_t and
    token_mean pg_loss = -(0.70711 * 2 - 0.70711 * 3) / (2 + 3 + 1 + 4) = 0.070711;
    sample_mean pg_loss = -(0.70711 - 0.70711 + 0 + 0) / 4 = 0.
    """
    batch = make_batch([1.0, 0.0, 0.5, 0.5], response_lengths=[2, 3, 1, 4], seed=2, group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert a == pytest.approx(0.70711, abs=1e-5)
    for agg, expected_pg in (("token_mean", a / 10), ("sample_mean", 0.0)):
        tr = trainer(model_dir, 2, loss_aggregation=agg, entropy_coef=0.01)
        pb = pad_batch(batch, 0)
        with torch.no_grad():
            logits = tr.model(input_ids=pb.input_ids, attention_mask=pb.attention_mask).logits
        resp_logits = logits.gather(1, pb.response_index[..., None].expand(-1, -1, logits.shape[-1]))
        entropy = alg.aggregate_loss(alg.entropy_from_logits(resp_logits), pb.mask, agg)
        metrics = tr.train(batch)
        assert metrics["pg_loss"] == pytest.approx(expected_pg, abs=1e-6)
        assert metrics["entropy_loss"] == pytest.approx(float(entropy), abs=1e-5)
        assert metrics["loss"] == pytest.approx(expected_pg - 0.01 * float(entropy), abs=1e-5)
        assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-7)
        assert metrics["advantage_max"] == pytest.approx(a, abs=1e-6)
        assert metrics["advantage_min"] == pytest.approx(-a, abs=1e-6)


def test_kl_loss_zero_against_itself_then_positive(model_dir):
    batch = make_batch(REWARDS, seed=3)
    tr = trainer(model_dir, 4, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    first = tr.train(batch)
    assert first["kl_loss"] == 0.0  # one optimizer step, taken at the reference weights
    assert tr._reference is not None
    assert all(not p.requires_grad for p in tr._reference.parameters())
    second = tr.train(make_batch(REWARDS, seed=4))
    assert second["kl_loss"] > 0.0
    # the reference did not move: its log-probs equal a fresh copy of the initial model's
    fresh = trainer(model_dir, 4)
    pb = pad_batch(batch, 0)
    from trainers.torch_trainer import response_logprobs
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(tr._reference, pb)[0], logprobs(fresh, batch))


def test_kl_in_reward_for_reinforce_plus_plus(model_dir):
    tr = trainer(model_dir, 4, advantage_estimator="reinforce_plus_plus", kl_coef=0.5)
    first = tr.train(make_batch(REWARDS, seed=5))
    assert first["reward_kl"] == 0.0 and "kl_loss" not in first
    second = tr.train(make_batch(REWARDS, seed=6))
    assert second["reward_kl"] > 0.0


def test_kl_in_loss_and_reward_is_a_config_error():
    with pytest.raises(ConfigError, match="use_kl_loss and kl_coef"):
        config_from_dict({"trainer": {"use_kl_loss": True, "kl_coef": 0.1}})


@pytest.mark.parametrize("shift,weight,clipfrac", [
    (0.0, 1.0, 0.0),                 # rollout == trainer: w = 1
    (0.5, math.exp(-0.5), 0.0),      # lp_roll = lp_old + 0.5: w = exp(-0.5)
    (-1.0, 2.0, 1.0),                # lp_roll = lp_old - 1: exp(1) = 2.718 clipped to tis_clip 2
])
def test_tis_weights_scale_the_policy_loss(model_dir, shift, weight, clipfrac):
    lengths = [2, 3, 1, 4, 2, 2, 1, 3]  # token_mean pg_loss = -a (2 + 2) / 18 != 0
    plain = make_batch(REWARDS, response_lengths=lengths, seed=7)
    ref = trainer(model_dir, 4, loss_aggregation="token_mean")
    old = logprobs(ref, plain)
    rollout = [(old[i, :k] + shift).tolist() for i, k in enumerate(lengths)]
    tis_batch = make_batch(REWARDS, response_lengths=lengths, seed=7, rollout_logprobs=rollout)
    base = ref.train(plain)
    tis = trainer(model_dir, 4, loss_aggregation="token_mean", use_tis=True).train(tis_batch)
    assert abs(base["pg_loss"]) > 1e-3
    assert tis["pg_loss"] == pytest.approx(weight * base["pg_loss"], rel=1e-4)
    assert tis["tis_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert tis["tis_clipfrac"] == pytest.approx(clipfrac)
    assert tis["train_rollout_logprob_abs_diff"] == pytest.approx(abs(shift), abs=1e-5)


def test_tis_without_rollout_logprobs_is_an_error(model_dir):
    with pytest.raises(ValueError, match="rollout log-probs"):
        trainer(model_dir, 4, use_tis=True).train(make_batch(REWARDS))


def _capture_grads(tr) -> list[dict[str, torch.Tensor]]:
    """Record the (clipped) gradients each optimizer step applies, policy and critic."""
    seen: list[dict[str, torch.Tensor]] = []
    step = tr.optimizer.step

    def recording_step(*args, **kwargs):
        grads = {f"policy.{k}": p.grad.clone() for k, p in tr.model.named_parameters()}
        if tr.critic is not None:
            grads.update({f"critic.{k}": p.grad.clone() for k, p in tr.critic.named_parameters()})
        seen.append(grads)
        return step(*args, **kwargs)

    tr.optimizer.step = recording_step
    return seen


@pytest.mark.parametrize("estimator,agg", [("grpo", "sample_mean"), ("grpo", "token_mean"),
                                           ("ppo", "token_mean")])
def test_gradient_accumulation_matches_one_big_batch(model_dir, estimator, agg):
    """micro_batch_size 3 (micro-batches of 3 + 3 + 2) vs 8, one optimizer step of 8 samples:
    the same gradients (policy and critic) and the same weights after the step. lr is small
    because Adam's first step is g / (|g| + eps): for a gradient near eps = 1e-8 it amplifies
    float32 summation-order noise to a visible fraction of lr."""
    batch = make_batch(REWARDS, seed=8)
    common = {"advantage_estimator": estimator, "loss_aggregation": agg, "global_batch_size": 8,
              "lr": 1e-4, "entropy_coef": 0.01}
    big = trainer(model_dir, 4, micro_batch_size=8, **common)
    small = trainer(model_dir, 4, micro_batch_size=3, **common)
    g_big, g_small = _capture_grads(big), _capture_grads(small)
    m_big, m_small = big.train(batch), small.train(batch)
    assert len(g_big) == len(g_small) == 1
    assert any(k.startswith("critic.") for k in g_big[0]) == (estimator == "ppo")
    for k, v in g_big[0].items():
        torch.testing.assert_close(g_small[0][k], v, atol=1e-6, rtol=0, msg=k)
    models = [(big.model, small.model)] + ([(big.critic, small.critic)] if estimator == "ppo" else [])
    for a, b in models:
        for k, v in params(a).items():
            torch.testing.assert_close(params(b)[k], v, atol=1e-6, rtol=0, msg=k)
    for key in ("loss", "pg_loss", "entropy_loss", "grad_norm") + (("value_loss",) if estimator == "ppo" else ()):
        assert m_small[key] == pytest.approx(m_big[key], abs=1e-6)


def test_several_optimizer_steps_per_rollout(model_dir):
    tr = trainer(model_dir, 4, global_batch_size=4, micro_batch_size=2)
    metrics = tr.train(make_batch(REWARDS, seed=9))
    assert metrics["optimizer_steps"] == 2.0
    assert tr.optimizer.state[next(tr.model.parameters())]["step"] == 2
    # the second step is off-policy: its ratio differs from 1
    assert metrics["ppo_kl"] != 0.0


def test_sft_loss_type_trains_on_kept_rollout_responses(model_dir):
    batch = make_batch(REWARDS, seed=10)
    tr = trainer(model_dir, 4, loss_type="sft", sft_min_reward=1.0, lr=3e-3)
    before = sequence_logprobs(tr, batch)
    metrics = tr.train(batch)
    delta = sequence_logprobs(tr, batch) - before
    good = torch.tensor(REWARDS) == 1.0
    assert metrics["sft_samples"] == 4.0 and metrics["sft_loss"] > 0
    assert delta[good].min() > 0
    assert delta[good].mean() > delta[~good].mean()


def test_sft_min_reward_loss_is_the_kept_samples_own(model_dir):
    """Rejected samples were zero-mask rows that ``sample_mean`` counted: with 1 of 8 kept the
    loss (and the step) was 1/8 of the kept sample's NLL (review, 2026-11-29). None kept: no
    optimizer step, the weights unchanged."""
    rewards = [1.0] + [0.0] * 7
    batch = make_batch(rewards, seed=14)
    tr = trainer(model_dir, 4, loss_type="sft", sft_min_reward=1.0)
    lp, mask = logprobs(tr, batch), pad_batch(batch, 0).mask
    nll_kept = float(-(lp[0] * mask[0]).sum() / mask[0].sum())
    metrics = tr.train(batch)
    assert metrics["sft_samples"] == 1.0
    assert metrics["sft_loss"] == pytest.approx(nll_kept, rel=1e-5)
    none_kept = trainer(model_dir, 4, loss_type="sft", sft_min_reward=2.0)
    before = params(none_kept.model)
    metrics = none_kept.train(batch)
    assert metrics["optimizer_steps"] == 0.0 and metrics["sft_samples"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in params(none_kept.model).items())
    assert none_kept.weight_version == 1


def test_uneven_groups_are_refused_not_normalised_across_prompts(model_dir):
    """A batch whose groups are not n consecutive samples of one group key was read as
    consecutive runs of n: groups of 5 and 3 for n = 4 were normalised across two prompts
    (review, 2026-11-29)."""
    batch = make_batch([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], seed=15)
    batch.group_keys = ["A"] * 5 + ["B"] * 3
    tr = trainer(model_dir, 4)
    with pytest.raises(ValueError, match=r"groups are not 4 samples each \(rollout.n_samples_per_prompt\): A: 5, B: 3"):
        tr.train(batch)
    batch.group_keys = ["A", "B", "A", "B", "C", "C", "C", "C"]  # uneven runs
    with pytest.raises(ValueError, match="groups are not 4 samples each"):
        tr.train(batch)
    two = trainer(model_dir, 2)
    batch.group_keys = ["A", "B", "B", "A", "C", "C", "D", "D"]  # right sizes, not consecutive
    with pytest.raises(ValueError, match="groups are not 2 samples each"):
        two.train(batch)
    assert tr.weight_version == 0
    batch.group_keys = ["A"] * 4 + ["B"] * 4
    tr.train(batch)
    assert tr.weight_version == 1


def test_dropout_in_the_model_config_is_off_in_training(tmp_path):
    """A config with dropout (attention_dropout 0.3) gave the old-log-prob pass and the grad
    pass different policies at the same weights: ppo_kl and clipfrac above 0 before any update
    (review, 2026-11-29). Loaded without dropout, as slime and verl do."""
    from infra.config import TrainerConfig
    from tests.megatron_helpers import make_batch as groups_batch
    from tests.megatron_helpers import save_tiny_model
    from trainers.torch_trainer import TorchTrainer

    save_tiny_model(str(tmp_path), "llama", tie=False, attention_dropout=0.3)
    tr = TorchTrainer(str(tmp_path), TrainerConfig(lr=1e-3, global_batch_size=8, micro_batch_size=8),
                      4, pad_token_id=0)
    tr.reuse_grad_pass_logprobs = False  # the separate old-log-prob forward
    assert tr.model.training and tr.model.config.attention_dropout == 0.0
    metrics = tr.train(groups_batch(n_groups=2, n_per=4))
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_clipfrac"] == 0.0


def test_save_load_round_trip_with_critic(model_dir, tmp_path):
    tr = trainer(model_dir, 4, advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.05)
    tr.train(make_batch(REWARDS, seed=11))
    tr.save(str(tmp_path / "v1"))
    assert (tmp_path / "v1" / CRITIC_FILE).exists()
    assert not any("ref" in p.name for p in (tmp_path / "v1").iterdir())  # the reference is not saved
    other = trainer(model_dir, 4, advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.05)
    other.load(str(tmp_path / "v1"))
    assert other.weight_version == 1
    batch = make_batch(REWARDS, seed=12)
    pb = pad_batch(batch, 0)
    torch.testing.assert_close(logprobs(other, batch), logprobs(tr, batch), atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(
            response_values(other.critic, pb), response_values(tr.critic, pb),
            atol=0, rtol=0)
    # the optimizers' states came back too: one more identical step gives identical weights
    tr.train(batch)
    other.train(batch)
    for name, model_a, model_b in (("policy", tr.model, other.model), ("critic", tr.critic, other.critic)):
        for k, v in params(model_a).items():
            torch.testing.assert_close(params(model_b)[k], v, atol=0, rtol=0, msg=f"{name} {k}")


def test_trainer_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="tis_clip_low"):
        config_from_dict({"trainer": {"tis_clip_low": 3.0, "tis_clip": 2.0}})
    with pytest.raises(ConfigError, match="trainer.eps_clip_c"):
        config_from_dict({"trainer": {"eps_clip_c": 0.5}})
    with pytest.raises(ConfigError, match="trainer.advantage_estimator"):
        config_from_dict({"trainer": {"advantage_estimator": "dpo"}})


def test_gspo_equals_grpo_on_policy_but_not_off_policy(model_dir):
    """With one optimizer step per rollout the ratio is 1 and, with sample_mean, the GSPO
    gradient A_i * mean_t grad lp equals GRPO's; with several steps the ratios differ."""
    batch = make_batch(REWARDS, seed=13)
    one = {"global_batch_size": 8, "micro_batch_size": 8}
    a, b = trainer(model_dir, 4, **one), trainer(model_dir, 4, advantage_estimator="gspo", **one)
    a.train(batch)
    b.train(batch)
    for k, v in params(a.model).items():
        torch.testing.assert_close(params(b.model)[k], v, atol=1e-6, rtol=0)
    two = {"global_batch_size": 4, "micro_batch_size": 4, "lr": 3e-2, "eps_clip": 0.01}
    a, b = trainer(model_dir, 4, **two), trainer(model_dir, 4, advantage_estimator="gspo", **two)
    ma, mb = a.train(batch), b.train(batch)
    assert ma["pg_loss"] != pytest.approx(mb["pg_loss"], abs=1e-6)


def test_pad_batch_layout_and_a_short_loss_mask_is_an_error():
    """Right padding; response token t of row i is predicted at len(prompt_i) - 1 + t; an empty
    loss_mask trains every response token; log-probs shorter than the response fill its start."""
    from trainers.base import TrainBatch

    def batch(loss_mask):
        return TrainBatch(sample_uids=["a", "b", "c"], prompt_token_ids=[[5, 6], [7], [8, 9, 4]],
                          response_token_ids=[[1, 2, 3], [4], []], loss_mask=loss_mask,
                          rollout_logprobs=[[-0.5, -0.25], [], [-1.0]], rewards=[1.0, 0.0, 0.0],
                          group_keys=["g"] * 3, weight_versions=[0] * 3)
    pb = pad_batch(batch([[1, 0, 1], [], []]), pad_id=0)
    assert pb.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0], [8, 9, 4, 0, 0]]
    assert pb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert pb.response_index.tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 0]]
    assert pb.response_ids.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    assert pb.mask.tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert pb.rollout_logprobs.tolist() == [[-0.5, -0.25, 0.0], [0.0] * 3, [0.0] * 3]
    assert pb.has_rollout_logprobs.tolist() == [1.0, 0.0, 0.0]  # c has no response: none used
    assert pb.prompt_len.tolist() == [2, 1, 3]
    assert (pb.input_ids.dtype, pb.mask.dtype) == (torch.long, torch.float32)
    with pytest.raises(ValueError, match="sample a: loss_mask has 2 entries for 3 response tokens"):
        pad_batch(batch([[1, 1], [1], []]), pad_id=0)


def test_seeding_on_cpu_draws_as_torch_manual_seed_and_captures_no_stack(monkeypatch):
    """``seed_everything`` without CUDA: the same draws as ``torch.manual_seed``, and none of the
    stack captures its lazy CUDA/XPU seeding makes while those devices are not initialised (one
    per iteration, ~3 ms each under a flow's stack)."""
    import traceback

    from trainers.torch_trainer import seed_everything

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine seeds through torch.manual_seed")
    torch.manual_seed(123)
    expected = torch.rand(8)
    captures = []
    real_format_stack = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: captures.append(1) or real_format_stack(*a, **k))
    torch.manual_seed(5)
    assert captures  # what the old seeding did on every call
    captures.clear()
    seed_everything(123)
    assert torch.equal(torch.rand(8), expected) and captures == []


def test_a_non_finite_gradient_is_refused_before_the_weights_change(model_dir):
    from trainers.torch_trainer import NonFiniteGradient

    tr = trainer(model_dir, 4)
    batch = make_batch(REWARDS, seed=1)
    with torch.no_grad():  # one weight turned to inf: every gradient through it is inf or nan
        next(tr.model.parameters()).view(-1)[0] = math.inf
    before = params(tr.model)
    with pytest.raises(NonFiniteGradient, match="weight version 0 is not finite"):
        tr.train(batch)
    assert tr.weight_version == 0
    after = params(tr.model)
    assert all(torch.equal(before[k], v) for k, v in after.items() if torch.isfinite(v).all())


def test_a_non_finite_critic_gradient_is_refused_before_either_model_changes(model_dir):
    """The critic's gradient norm was clipped and stepped unchecked: a NaN critic was committed
    with the policy (review, 2026-11-29). Now refused before either optimizer steps."""
    from trainers.torch_trainer import NonFiniteGradient

    tr = trainer(model_dir, 4, advantage_estimator="ppo")
    tr.train(make_batch(REWARDS, seed=16))  # the critic exists from the first step
    # the critic's gradient alone goes NaN (an inf weight would make the values, and through
    # the advantages the policy's gradient, non-finite too)
    tr.critic.value_head.weight.register_hook(lambda grad: grad * math.nan)
    policy, critic = params(tr.model), params(tr.critic)
    with pytest.raises(NonFiniteGradient, match="critic's gradient at weight version 1 is not finite"):
        tr.train(make_batch(REWARDS, seed=17))
    assert tr.weight_version == 1
    assert all(torch.equal(policy[k], v) for k, v in params(tr.model).items())
    assert all(torch.equal(critic[k], v) for k, v in params(tr.critic).items())
