"""The actor's total loss for one micro-batch, assembled from ``trainers.algorithms``.

    L_pg  = per-token clipped loss (token ratio; per-sequence ratio for gspo),
            times the TIS weight w = clamp(exp(lp_old - lp_roll), tis_clip_low, tis_clip) if use_tis
    loss  = agg(L_pg) - entropy_coef * agg(H) + kl_loss_coef * agg(KL(lp, lp_ref))   [use_kl_loss]
    sft   = agg(-lp)                                                                  [loss_type sft]

``agg`` is ``algorithms.aggregate_loss`` with ``loss_aggregation`` (sample_mean | token_mean).
Metrics use slime's names and are aggregated the same way as the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infra.config import TrainerConfig
from trainers import algorithms as alg


def policy_loss(cfg: TrainerConfig, logp: Tensor, entropy: Tensor, old_logp: Tensor,
                advantages: Tensor, mask: Tensor, ref_logp: Tensor | None = None,
                rollout_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(scalar loss, detached metrics) for one micro-batch; all inputs [B, T].

    ``entropy`` may be detached (its gradient is only needed when entropy_coef != 0);
    ``ref_logp`` is required with use_kl_loss, ``rollout_logp`` with use_tis."""
    agg = cfg.loss_aggregation

    def reduce(x: Tensor) -> Tensor:
        return alg.aggregate_loss(x, mask, agg)

    if cfg.advantage_estimator == "gspo":
        pg, clipped = alg.compute_gspo_policy_loss(logp, old_logp, advantages, mask, cfg.eps_clip,
                                                   cfg.eps_clip_high, cfg.eps_clip_c)
        log_ratio = alg.gspo_log_ratio(logp, old_logp, mask)
    else:
        pg, clipped = alg.compute_policy_loss(logp, old_logp, advantages, cfg.eps_clip,
                                              cfg.eps_clip_high, cfg.eps_clip_c)
        log_ratio = logp - old_logp
    metrics: dict[str, Tensor] = {}
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("trainer.use_tis needs the rollout engine's log-probs in the batch")
        w = alg.tis_weights(old_logp, rollout_logp, cfg.tis_clip, cfg.tis_clip_low)
        raw = torch.exp(old_logp - rollout_logp)
        pg = pg * w
        metrics.update(tis=reduce(raw), tis_weight_mean=reduce(w),
                       tis_clipfrac=reduce((w != raw).to(w.dtype)))
    pg_loss = reduce(pg)
    entropy_loss = reduce(entropy)
    loss = pg_loss - cfg.entropy_coef * entropy_loss
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("trainer.use_kl_loss needs the reference model's log-probs")
        kl_loss = reduce(alg.compute_approx_kl(logp, ref_logp, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    metrics.update(loss=loss, pg_loss=pg_loss, pg_clipfrac=reduce(clipped),
                   ppo_kl=reduce(-log_ratio), entropy_loss=entropy_loss)
    return loss, {k: v.detach() for k, v in metrics.items()}


def sft_loss(cfg: TrainerConfig, logp: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """SFT on the batch's response tokens: agg(-lp) (``algorithms.sft_loss``)."""
    loss = alg.sft_loss(logp, mask, cfg.loss_aggregation)
    return loss, {"loss": loss.detach(), "sft_loss": loss.detach()}


def value_loss(cfg: TrainerConfig, values: Tensor, old_values: Tensor, returns: Tensor,
               mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (``algorithms.value_loss``, a masked mean over tokens) and
    value_clipfrac = masked mean of [|V - V_old| > value_clip] (slime's definition)."""
    loss = alg.value_loss(values, old_values, returns, mask, cfg.value_clip)
    clipfrac = alg.masked_mean(((values - old_values).abs() > cfg.value_clip).to(values.dtype), mask)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


def micro_weight(mode: str, mask: Tensor, micro_idx: Tensor) -> float:
    """Share of one optimizer step's loss that a micro-batch carries, so that summing
    weight * agg(micro) over the micro-batches equals agg over the whole step exactly:
    sample_mean: B_micro / B_step; token_mean: tokens_micro / tokens_step (0 if no tokens).
    ``mask`` is the step's [B, T] mask, ``micro_idx`` the micro-batch's rows in it."""
    if mode == "sample_mean":
        return len(micro_idx) / mask.shape[0]
    total = float((mask > 0).sum())
    return float((mask[micro_idx] > 0).sum()) / total if total > 0 else 0.0
