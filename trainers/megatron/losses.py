"""Loss pieces of the megatron backend: advantages from ``trainers.algorithms`` and the actor
loss, which is the torch trainer's ``trainers.losses.policy_loss`` itself (same functions, same
aggregation, slime's metric names). The backend takes any object carrying trainer settings
(slime-style args); ``as_trainer_config`` turns it into rlake's TrainerConfig for the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from infra.config import TrainerConfig
from trainers import algorithms as alg
from trainers.losses import policy_loss

Tensor = torch.Tensor


def cfg_get(cfg: Any, name: str, default: Any) -> Any:
    """``cfg.name`` or ``default`` when the config object has no such attribute (or None)."""
    value = getattr(cfg, name, None)
    return default if value is None else value


def compute_advantages(cfg: Any, rewards: Tensor, mask: Tensor, n_samples_per_prompt: int,
                       kl: Tensor | None = None) -> Tensor:
    """Advantages [B, T] for ``cfg.advantage_estimator`` (grpo, gspo, reinforce_plus_plus*),
    0 off the mask: the torch trainer's call of ``algorithms.compute_advantages`` with the same
    keys (reward KL ``kl_coef * kl``, discount ``gamma``, ``normalize_advantages`` as given:
    None = the estimator's default, False = never whiten). ``kl`` [B, T] = KL(lp_old, lp_ref)
    when ``kl_coef > 0`` (zeros when None). ``ppo`` needs a critic, which this backend lacks."""
    estimator = cfg_get(cfg, "advantage_estimator", "grpo")
    if estimator == "ppo":
        raise ValueError("trainer.advantage_estimator=ppo needs a critic; the megatron backend "
                         "supports grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline")
    adv, _ = alg.compute_advantages(
        estimator, rewards, mask, n_samples_per_prompt, kl=kl,
        kl_coef=float(cfg_get(cfg, "kl_coef", 0.0)), gamma=float(cfg_get(cfg, "gamma", 1.0)),
        normalize_std=not cfg_get(cfg, "disable_grpo_std_normalization", False),
        # as given: False means never whiten (``x if x else None`` made it None, the
        # estimator's default, which whitens reinforce_plus_plus*)
        normalize_advantages=getattr(cfg, "normalize_advantages", None))
    return adv


def as_trainer_config(cfg: Any) -> TrainerConfig:
    """``cfg`` as rlake's TrainerConfig: itself, or built from the attributes of any object that
    carries trainer settings (slime-style args); missing ones take TrainerConfig's defaults."""
    if isinstance(cfg, TrainerConfig):
        return cfg
    given = {k: v for k, v in vars(cfg).items() if k in TrainerConfig.model_fields and v is not None}
    return TrainerConfig(**given)


def actor_loss(cfg: Any, logp: Tensor, entropy: Tensor, old_logp: Tensor,
               advantages: Tensor, mask: Tensor, ref_logp: Tensor | None = None,
               rollout_logp: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The torch trainer's ``trainers.losses.policy_loss`` (one definition for both backends),
    with the metrics as floats."""
    loss, metrics = policy_loss(as_trainer_config(cfg), logp, entropy, old_logp, advantages,
                                mask, ref_logp, rollout_logp)
    return loss, {k: float(v) for k, v in metrics.items()}


def masked_abs_diff(a: Tensor, b: Tensor, mask: Tensor) -> float:
    """mean over masked tokens of |a - b| (train vs rollout log-prob mismatch)."""
    denom = mask.sum()
    return float(((a - b).abs() * mask).sum() / denom) if denom > 0 else 0.0
