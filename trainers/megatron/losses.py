"""Batch padding and the actor loss of the megatron backend, built from ``trainers.algorithms``.

The loss here is the torch trainer's: the same functions, the same aggregation, the same
metric names (slime's). It is one function so both backends can share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainers import algorithms as alg
from trainers.base import TrainBatch

Tensor = torch.Tensor


@dataclass
class PaddedBatch:
    """Right-padded prompt+response sequences and the response-token view into them."""

    input_ids: Tensor         # [B, L]
    response_index: Tensor    # [B, T] position whose logits predict response token t
    response_ids: Tensor      # [B, T]
    mask: Tensor              # [B, T] float, 1 on trained response tokens
    rollout_logprobs: Tensor  # [B, T]

    def select(self, idx: Tensor) -> PaddedBatch:
        return PaddedBatch(*(t[idx] for t in (self.input_ids, self.response_index,
                                              self.response_ids, self.mask,
                                              self.rollout_logprobs)))

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(*(t.to(device) for t in (self.input_ids, self.response_index,
                                                    self.response_ids, self.mask,
                                                    self.rollout_logprobs)))


def pad_batch(batch: TrainBatch, pad_id: int = 0) -> PaddedBatch:
    """Right-pad prompt+response; response token t of row i is predicted at position
    len(prompt_i) - 1 + t. An empty ``loss_mask`` means all response tokens are trained."""
    n = len(batch)
    if n == 0:
        raise ValueError("TrainBatch is empty: nothing to train on")
    width = max(len(p) + len(r) for p, r in zip(batch.prompt_token_ids,
                                                batch.response_token_ids, strict=True))
    t_width = max(1, max(len(r) for r in batch.response_token_ids))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    response_index = torch.zeros((n, t_width), dtype=torch.long)
    response_ids = torch.zeros((n, t_width), dtype=torch.long)
    mask = torch.zeros((n, t_width))
    rollout_lp = torch.zeros((n, t_width))
    for i, (prompt, resp) in enumerate(zip(batch.prompt_token_ids, batch.response_token_ids,
                                           strict=True)):
        if not prompt:
            raise ValueError(f"sample {batch.sample_uids[i]}: empty prompt_token_ids")
        seq = list(prompt) + list(resp)
        input_ids[i, :len(seq)] = torch.tensor(seq)
        r = len(resp)
        if r == 0:
            continue
        response_index[i, :r] = torch.arange(len(prompt) - 1, len(prompt) - 1 + r)
        response_ids[i, :r] = torch.tensor(resp)
        lm = batch.loss_mask[i]
        mask[i, :r] = torch.tensor(lm[:r] if lm else [1] * r, dtype=torch.float32)
        if batch.rollout_logprobs[i]:
            rollout_lp[i, :r] = torch.tensor(batch.rollout_logprobs[i][:r], dtype=torch.float32)
    return PaddedBatch(input_ids, response_index, response_ids, mask, rollout_lp)


def cfg_get(cfg: Any, name: str, default: Any) -> Any:
    """``cfg.name`` or ``default`` when the config object has no such attribute (or None)."""
    value = getattr(cfg, name, None)
    return default if value is None else value


def compute_advantages(cfg: Any, rewards: Tensor, mask: Tensor,
                       n_samples_per_prompt: int) -> Tensor:
    """Advantages [B, T] for ``cfg.advantage_estimator`` (grpo, gspo, reinforce_plus_plus*),
    0 off the mask; ``ppo`` needs a critic, which this backend does not have."""
    estimator = cfg_get(cfg, "advantage_estimator", "grpo")
    if estimator == "ppo":
        raise ValueError("trainer.advantage_estimator=ppo needs a critic; the megatron backend "
                         "supports grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline")
    normalize = getattr(cfg, "normalize_advantages", None)
    adv, _ = alg.compute_advantages(
        estimator, rewards, mask, n_samples_per_prompt,
        normalize_std=not cfg_get(cfg, "disable_grpo_std_normalization", False),
        normalize_advantages=normalize if normalize else None)
    return adv


def actor_loss(cfg: Any, logp: Tensor, entropy: Tensor | None, old_logp: Tensor,
               advantages: Tensor, mask: Tensor, ref_logp: Tensor | None = None,
               rollout_logp: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """loss = agg(L_pg * w_tis) - entropy_coef * agg(H) + kl_loss_coef * agg(KL(lp, lp_ref))

    L_pg: ``compute_policy_loss`` (token ratio) or ``compute_gspo_policy_loss`` (gspo);
    w_tis = ``tis_weights(lp_old, lp_roll)`` when ``use_tis``; agg = ``aggregate_loss`` with
    ``cfg.loss_aggregation``. Metrics: pg_loss, pg_clipfrac, ppo_kl = agg(lp_old - lp),
    entropy_loss, kl_loss (when used).
    """
    agg = cfg_get(cfg, "loss_aggregation", "sample_mean")
    eps, hi, c = cfg.eps_clip, getattr(cfg, "eps_clip_high", None), getattr(cfg, "eps_clip_c", None)
    if cfg_get(cfg, "advantage_estimator", "grpo") == "gspo":
        pg, clipped = alg.compute_gspo_policy_loss(logp, old_logp, advantages, mask, eps, hi, c)
    else:
        pg, clipped = alg.compute_policy_loss(logp, old_logp, advantages, eps, hi, c)
    if cfg_get(cfg, "use_tis", False):
        if rollout_logp is None:
            raise ValueError("trainer.use_tis needs rollout_logprobs in the batch")
        pg = pg * alg.tis_weights(old_logp, rollout_logp, cfg_get(cfg, "tis_clip", 2.0),
                                  cfg_get(cfg, "tis_clip_low", 0.0))
    pg_loss = alg.aggregate_loss(pg, mask, agg)
    loss = pg_loss
    metrics: dict[str, float] = {"pg_loss": float(pg_loss.detach())}
    if entropy is not None:
        entropy_loss = alg.aggregate_loss(entropy, mask, agg)
        loss = loss - cfg_get(cfg, "entropy_coef", 0.0) * entropy_loss
        metrics["entropy_loss"] = float(entropy_loss.detach())
    if cfg_get(cfg, "use_kl_loss", False):
        if ref_logp is None:
            raise ValueError("trainer.use_kl_loss needs reference log-probs")
        kl = alg.compute_approx_kl(logp, ref_logp, cfg_get(cfg, "kl_loss_type", "low_var_kl"))
        kl_loss = alg.aggregate_loss(kl, mask, agg)
        loss = loss + cfg_get(cfg, "kl_loss_coef", 0.0) * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
    with torch.no_grad():
        metrics["ppo_kl"] = float(alg.aggregate_loss(old_logp - logp, mask, agg))
        metrics["pg_clipfrac"] = float(alg.aggregate_loss(clipped, mask, agg))
    return loss, metrics


def masked_abs_diff(a: Tensor, b: Tensor, mask: Tensor) -> float:
    """mean over masked tokens of |a - b| (train vs rollout log-prob mismatch)."""
    denom = mask.sum()
    return float(((a - b).abs() * mask).sum() / denom) if denom > 0 else 0.0
