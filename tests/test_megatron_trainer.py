"""MegatronTrainer on CPU: the same GRPO step as a plain HF/torch implementation, TP=2 and DP=2
(spawned gloo ranks) equal to TP=1, and HF checkpoints that HF loads."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.megatron_helpers import (
    hf_grpo_step,
    hf_response_logprobs,
    make_batch,
    sample_with_megatron,
    save_tiny_model,
    trainer_config,
    weights_of,
)
from trainers.megatron import gpu
from trainers.megatron.launch import SpawnedMegatronTrainer, make_megatron_trainer
from trainers.megatron.ranks import RankFailed
from trainers.megatron.trainer import MegatronTrainer

pytestmark = pytest.mark.megatron
torch.set_num_threads(1)

LOGP_TOL = 1e-5
# One AdamW step moves each weight by about lr (1e-3); fp32 summation-order noise in the
# gradients changes that by far less than 1e-5.
WEIGHT_TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model = save_tiny_model(str(path), "qwen2", tie=True)  # vocab 31: padded to 32 under TP=2
    return str(path), model


@pytest.fixture(scope="module")
def batch():
    return make_batch(n_groups=2, n_per=4)


@pytest.fixture(scope="module")
def tp1(ckpt, batch):
    """TP=1 in-process: log-probs before, metrics of one train call, weights after."""
    trainer = MegatronTrainer(trainer_config(), ckpt[0])
    logp = trainer.compute_logprobs(batch)
    metrics = trainer.train(batch)
    weights = trainer.hf_state_dict()
    trainer.close()
    return logp, metrics, weights


@pytest.fixture(scope="module")
def reference(ckpt, batch):
    model = copy.deepcopy(ckpt[1])
    cfg = trainer_config()
    with torch.no_grad():
        logp, _, mask = hf_response_logprobs(model, batch, cfg.rollout_temperature)
    metrics = hf_grpo_step(model, batch, cfg)
    return logp * mask, metrics, weights_of(model)


def assert_weights_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    # hf_state_dict lives on the trainer's device (the GPU if any)
    worst = max(float((got[k].cpu() - want[k].cpu()).abs().max()) for k in want)
    assert worst <= tol, worst


def test_tp1_matches_plain_hf_grpo_step(tp1, reference, ckpt):
    logp, metrics, weights = tp1
    ref_logp, ref_metrics, ref_weights = reference
    torch.testing.assert_close(logp, ref_logp, atol=LOGP_TOL, rtol=0)
    for k in ("pg_loss", "entropy_loss", "grad_norm"):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-5), k
    assert metrics["optimizer_steps"] == 1.0 and metrics["ppo_kl"] == pytest.approx(0, abs=1e-6)
    moved = max(float((weights[k].cpu() - ckpt[1].state_dict()[k]).abs().max())
                for k in weights)
    assert moved > 1e-4  # the step did change the weights
    assert_weights_close(weights, ref_weights, WEIGHT_TOL)


@pytest.mark.parametrize("layout", [dict(tensor_model_parallel_size=2),
                                    dict(data_parallel_size=2)], ids=["tp2", "dp2"])
def test_two_ranks_equal_tp1_and_save_hf(layout, ckpt, batch, tp1, reference, tmp_path):
    logp1, metrics1, _ = tp1
    _, _, ref_weights = reference
    trainer = make_megatron_trainer(trainer_config(**layout), ckpt[0])
    assert isinstance(trainer, SpawnedMegatronTrainer) and trainer.world == 2
    assert trainer.uses_reference is False  # forwarded: the runtime keeps v0 while True
    try:
        logp = trainer.compute_logprobs(batch)
        torch.testing.assert_close(logp, logp1, atol=LOGP_TOL, rtol=0)
        metrics = trainer.train(batch)
        for k in ("pg_loss", "entropy_loss", "grad_norm"):
            assert metrics[k] == pytest.approx(metrics1[k], abs=1e-5), k
        assert trainer.weight_version == 1
        assert_weights_close(trainer.hf_state_dict(), ref_weights, WEIGHT_TOL)
        out = tmp_path / "v1"
        trainer.save(str(out))
        after = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    hf = AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert_weights_close(weights_of(hf), ref_weights, WEIGHT_TOL)
    with torch.no_grad():
        hf_logp, _, mask = hf_response_logprobs(hf, batch, trainer_config().rollout_temperature)
    torch.testing.assert_close(after, hf_logp * mask, atol=LOGP_TOL, rtol=0)


def test_save_load_resumes_state(ckpt, batch, tmp_path):
    cfg = trainer_config()
    a = MegatronTrainer(cfg, ckpt[0])
    a.train(batch)
    a.save(str(tmp_path / "v1"))
    second = a.train(batch)
    after_two = a.hf_state_dict()
    b = MegatronTrainer(cfg, ckpt[0])
    b.load(str(tmp_path / "v1"))
    assert b.weight_version == 1
    again = b.train(batch)
    assert again["pg_loss"] == pytest.approx(second["pg_loss"], abs=1e-6)
    assert_weights_close(b.hf_state_dict(), after_two, 1e-6)  # optimizer moments restored
    a.close()
    b.close()


def test_sft_step_lowers_loss(ckpt, batch):
    trainer = MegatronTrainer(trainer_config(lr=1e-2), ckpt[0])
    first = trainer.train_sft(batch)["sft_loss"]
    for _ in range(3):
        last = trainer.train_sft(batch)["sft_loss"]
    trainer.close()
    assert last < first - 0.05


def test_pipeline_parallel_is_refused_where_it_cannot_run(ckpt):
    """PP=2 in this single process: on CPU, refused because PP needs megatron's GPU schedules;
    on a GPU host the schedules exist, but a world of one process cannot hold two stages."""
    if torch.cuda.is_available():
        expected = "world size 1 is not a multiple of .* pipeline_model_parallel_size = 2"
    else:
        expected = "pipeline_model_parallel_size=2: pipeline parallelism needs .* GPUs"
    with pytest.raises(ValueError, match=expected):
        MegatronTrainer(trainer_config(pipeline_model_parallel_size=2), ckpt[0])


def test_grpo_learns_a_target_token(ckpt):
    """A few GRPO iterations on the trainer's own samples raise the reward
    (fraction of response tokens equal to 7: about 1/31 at random init)."""
    cfg = trainer_config(lr=1e-2, n_samples_per_prompt=8, global_batch_size=32,
                         micro_batch_size=32, rollout_temperature=1.0, entropy_coef=0.0)
    trainer = MegatronTrainer(cfg, ckpt[0])
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    rewards = []
    for _ in range(12):
        batch = sample_with_megatron(trainer, prompts, 8, 3, 1.0, gen)
        batch.rewards = [r.count(7) / 3 for r in batch.response_token_ids]
        rewards.append(sum(batch.rewards) / len(batch.rewards))
        metrics = trainer.train(batch)
        assert metrics["train_rollout_logprob_abs_diff"] < 1e-4
    trainer.close()
    assert sum(rewards[:3]) / 3 < 0.15
    assert sum(rewards[-3:]) / 3 > 0.5, rewards


def test_kl_loss_against_frozen_reference(ckpt, batch):
    """use_kl_loss: KL to the initial policy is 0 on the first call, > 0 once the policy moved,
    and the reference copy does not move."""
    trainer = MegatronTrainer(trainer_config(use_kl_loss=True, kl_loss_coef=0.1), ckpt[0])
    first = trainer.train(batch)
    second = trainer.train(batch)
    ref = {k: v for k, v in trainer.ref_model.state_dict().items() if "extra_state" not in k}
    fresh = MegatronTrainer(trainer_config(), ckpt[0])
    initial = fresh.local_state_dict()
    fresh.close()
    trainer.close()
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl_loss"] > 1e-6
    assert all(torch.equal(ref[k], initial[k]) for k in initial)


def test_rank_failure_is_reported(tmp_path):
    """A rank that cannot start (no checkpoint) surfaces as an error naming the cause."""
    with pytest.raises(RankFailed, match=r"megatron rank [01] failed; all ranks stopped"):
        SpawnedMegatronTrainer(trainer_config(tensor_model_parallel_size=2), str(tmp_path))


def test_trailing_samples_get_an_optimizer_step(ckpt, tp1):
    """12 samples with global_batch_size 8: two steps, the second on the 4 trailing samples
    (they used to be dropped by ``range(0, n - step + 1, step)``). The first 8 samples are
    ``batch``, so after the first step the weights are tp1's; the second must move them on."""
    trainer = MegatronTrainer(trainer_config(), ckpt[0])
    metrics = trainer.train(make_batch(n_groups=3, n_per=4))
    weights = trainer.hf_state_dict()
    trainer.close()
    assert metrics["optimizer_steps"] == 2.0
    moved = max(float((weights[k] - tp1[2][k]).abs().max()) for k in weights)
    assert moved > 1e-5, "the trailing samples did not change the weights"


def test_step_spans_cover_every_sample_once():
    assert gpu.step_spans(12, 8) == [(0, 8), (8, 4)]
    assert gpu.step_spans(16, 8) == [(0, 8), (8, 8)]
    assert gpu.step_spans(5, 8) == [(0, 5)]
    for n, step in ((1, 1), (7, 3), (256, 256), (300, 64)):
        spans = gpu.step_spans(n, step)
        assert [i for s, k in spans for i in range(s, s + k)] == list(range(n))


def test_equal_size_groups_split_where_the_size_changes():
    chunks = list(torch.arange(10).split(4))  # sizes 4, 4, 2
    groups = gpu._equal_size_groups(chunks)
    assert [[len(c) for c in g] for g in groups] == [[4, 4], [2]]
    assert torch.equal(torch.cat([c for g in groups for c in g]), torch.arange(10))
    assert gpu._equal_size_groups([]) == []


def test_gpu_step_sizes_must_split_into_equal_micro_batches():
    gpu.check_step_sizes(8, [8, 8], dp=2, micro=4)
    gpu.check_step_sizes(8, [8, 4], dp=1, micro=4)  # a trailing step of whole micro-batches
    with pytest.raises(ValueError, match="global_batch_size=6 must be a multiple of data parallel size 2"):
        gpu.check_step_sizes(6, [6], dp=2, micro=2)
    with pytest.raises(ValueError, match="batch of 11 samples leaves a last optimizer step of 3"):
        gpu.check_step_sizes(8, [8, 3], dp=1, micro=4)


def test_micro_batches_are_this_dp_ranks_contiguous_part():
    class Rank:  # the two attributes _micro_batches reads, as MegatronTrainer has them
        dp, dp_rank = 2, 1

        def _dp_slice(self, idx):
            return MegatronTrainer._dp_slice(self, idx)

    got = gpu._micro_batches(Rank(), start=8, step=8, micro=2)
    assert [c.tolist() for c in got] == [[12, 13], [14, 15]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_torch_and_megatron_trainers_agree_in_bf16(ckpt, batch):
    """On a GPU (NCCL world of one, bf16): the torch and Megatron trainers compute the same
    log-probs and losses within bf16 tolerance."""
    from infra.config import TrainerConfig
    from trainers.base import pad_batch
    from trainers.torch_trainer import TorchTrainer

    cfg = trainer_config()
    mg = MegatronTrainer(cfg, ckpt[0], dtype="bf16")
    assert torch.distributed.get_backend() == "nccl"
    tcfg = TrainerConfig(**{k: getattr(cfg, k) for k in (
        "lr", "eps_clip", "eps_clip_high", "entropy_coef", "global_batch_size",
        "micro_batch_size", "clip_grad", "weight_decay", "adam_beta1", "adam_beta2",
        "loss_aggregation")})
    tt = TorchTrainer(ckpt[0], tcfg, cfg.n_samples_per_prompt, cfg.rollout_temperature,
                      device="cuda", dtype="bf16")
    pb = pad_batch(batch, 0).to("cuda")
    with torch.no_grad():
        torch_logp = (tt._logprobs(tt.model, pb)[0] * pb.mask).cpu()
    torch.testing.assert_close(mg.compute_logprobs(batch), torch_logp, atol=5e-2, rtol=0)
    m_mg, m_tt = mg.train(batch), tt.train(batch)
    for k in ("pg_loss", "entropy_loss"):
        assert m_mg[k] == pytest.approx(m_tt[k], abs=2e-2), k
    mg.close()


@pytest.mark.parametrize("agg", ["sample_mean", "token_mean"])
def test_micro_batch_size_does_not_change_the_update(ckpt, batch, agg):
    """Gradient accumulation is exact for both aggregations: micro-batches of 3+3+2 give the
    weights of one micro-batch of 8. Under token_mean each micro-batch's loss used to be
    weighted by its share of the samples, not of the tokens (review, 2026-11-29)."""
    weights = {}
    for micro in (8, 3):
        trainer = MegatronTrainer(trainer_config(micro_batch_size=micro, loss_aggregation=agg),
                                  ckpt[0])
        trainer.train(batch)
        weights[micro] = trainer.hf_state_dict()
        trainer.close()
    assert_weights_close(weights[3], weights[8], WEIGHT_TOL)  # it was 2e-3 under token_mean


def test_gpu_micro_batch_losses_carry_their_share_of_the_step():
    """The GPU path's loss scaling (checked without a GPU): the schedule divides each
    micro-batch loss by the number of micro-batches M and DDP averages over dp ranks, so
    sum_m (returned loss_m) / (M * dp) must be each micro-batch's token (or sample) share
    times its loss; here loss_m = its token mean, so the sum is the whole step's token mean."""
    mask = torch.tensor([[1., 1., 1., 1.], [1., 0., 0., 0.], [1., 1., 0., 0.], [1., 1., 1., 0.]])
    per_token = torch.arange(16, dtype=torch.float32).view(4, 4)
    start = 4  # the step's rows are 4..7 of the batch

    def loss_from_logits(idx, logits):
        rows = idx - start
        loss = (per_token[rows] * mask[rows]).sum() / mask[rows].sum()
        return loss, {"loss": float(loss)}

    micro_batches = [torch.tensor([4, 5]), torch.tensor([6, 7])]
    weighted = gpu._share_weighted(loss_from_logits, "token_mean", mask, start,
                                   len(micro_batches), dp=1)
    outs = [weighted(idx, None) for idx in micro_batches]
    whole = float((per_token * mask).sum() / mask.sum())
    assert sum(float(loss) for loss, _ in outs) / len(micro_batches) == pytest.approx(whole)
    assert sum(terms["loss"] for _, terms in outs) == pytest.approx(whole)


def test_kl_reference_is_reference_dir_loaded_at_the_first_train(ckpt, batch, tmp_path):
    """The reference is the folder the runtime names (checkpoint v0), read at the first train:
    a trainer built from the base model, moved by the SFT warm-up and saved as v0, has KL 0 at
    its first RL step. It used to be the construction folder, the base model before SFT
    (review, 2026-11-29)."""
    v0 = tmp_path / "v000000"
    trainer = MegatronTrainer(trainer_config(use_kl_loss=True, kl_loss_coef=0.1), ckpt[0],
                              reference_dir=str(v0))  # does not exist yet, as on a fresh run
    assert trainer.uses_reference and trainer.ref_model is None
    trainer.train_sft(batch)  # the warm-up moves the policy away from the base model
    trainer.save(str(v0))
    first = trainer.train(batch)
    trainer.close()
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)


def test_ref_load_overrides_the_reference_folder(ckpt, tmp_path):
    other = tmp_path / "other"
    save_tiny_model(str(other), "qwen2", tie=True, seed=1)
    trainer = MegatronTrainer(trainer_config(use_kl_loss=True, ref_load=str(other)), ckpt[0],
                              reference_dir=ckpt[0])
    ref = {k: v for k, v in trainer.reference().state_dict().items() if "extra_state" not in k}
    fresh = MegatronTrainer(trainer_config(), str(other))
    want = fresh.local_state_dict()
    fresh.close()
    trainer.close()
    assert all(torch.equal(ref[k], want[k]) for k in want)


def test_kl_in_the_reward_and_the_advantage_keys_reach_the_estimator(ckpt, batch):
    """kl_coef (reward KL against the reference), gamma and normalize_advantages=False reach
    algorithms.compute_advantages as in the torch trainer; they used to be dropped (False
    became None, i.e. whitened) (review, 2026-11-29)."""
    from infra.config import TrainerConfig
    from trainers import algorithms as alg
    from trainers.megatron import losses as mlosses

    rewards = torch.tensor([1., 0., 0., 1.])
    mask = torch.tensor([[1., 1., 1.], [1., 1., 0.], [1., 0., 0.], [1., 1., 1.]])
    kl = torch.full(mask.shape, 0.1)
    for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        cfg = TrainerConfig(advantage_estimator=est, normalize_advantages=False, gamma=0.5,
                            kl_coef=0.2)
        want, _ = alg.compute_advantages(est, rewards, mask, 2, kl=kl, kl_coef=0.2, gamma=0.5,
                                         normalize_advantages=False)
        torch.testing.assert_close(mlosses.compute_advantages(cfg, rewards, mask, 2, kl), want)
    plain = mlosses.compute_advantages(TrainerConfig(advantage_estimator="reinforce_plus_plus",
                                                     normalize_advantages=False, gamma=0.5),
                                       rewards, mask, 2)
    assert plain[0].tolist() == pytest.approx([0.25, 0.5, 1.0])
    # the trainer: KL to the reference in the reward, 0 before the policy moves, then > 0
    trainer = MegatronTrainer(trainer_config(advantage_estimator="reinforce_plus_plus",
                                             kl_coef=0.5, kl_loss_type="k3", lr=1e-2), ckpt[0])
    assert trainer.uses_reference
    first, second = trainer.train(batch), trainer.train(batch)
    trainer.close()
    assert first["reward_kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["reward_kl"] > 1e-6
