"""The actor loss of the megatron backend, built from ``trainers.algorithms``.

The loss here is the torch trainer's: the same functions, the same aggregation, the same
metric names (slime's). It is one function so both backends can share it.
"""

from __future__ import annotations

from typing import Any

import torch

from trainers import algorithms as alg

Tensor = torch.Tensor


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
