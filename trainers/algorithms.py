"""RL math as slime defines it: KL estimators, clipped policy losses, advantage estimators.

Every function is a small pure function on torch tensors; its docstring gives its formula.
Definitions follow slime's formulas and edge cases, written out in ``docs/algorithms.md``.

Conventions
-----------
- Token-level tensors are ``[B, T]``, padded on the right, over *response* tokens.
- ``mask`` ``[B, T]``: 1 = trained response token, 0 = padding or a masked-out token.
- "The last token" of a row is its last masked (mask == 1) token; everything after it is padding.
- Per-sample tensors are ``[B]``. Groups are consecutive runs of ``n_samples_per_prompt`` samples.
- Estimator outputs (advantages, returns) are 0 where ``mask == 0``.
- A row whose mask is all zero contributes nothing: its advantages/returns are 0 and it adds 0 to
  every masked sum (``aggregate_loss`` still counts it as a sample, as slime does).
- Masked sums use ``torch.where``, so inf/NaN in padding never reaches a forward value; keep
  padded log-probs finite anyway (e.g. 0): an inf ratio there would still give NaN gradients.
- Inputs of any float dtype; computations run in at least float32 (float64 stays float64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
AGG_MODES = ("sample_mean", "token_mean")
GRPO_STD_EPS = 1e-6
WHITEN_EPS = 1e-8
LOW_VAR_KL_CLAMP = 10.0
# exp(80) is finite in float32 (its limit ~88.7), and any importance ratio a step can see times
# exp(80) - 81 is far past the clamp: the clamped value is unchanged
LOW_VAR_KL_EXP_MAX = 80.0

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "KL_TYPES",
    "aggregate_loss", "clipped_policy_loss", "compute_advantages", "compute_approx_kl",
    "compute_gspo_policy_loss", "compute_policy_loss", "entropy_from_logits", "gae",
    "grpo_advantages", "gspo_log_ratio", "gspo_sequence_ratio", "last_token_index",
    "log_probs_from_logits", "masked_mean", "pass_at_k", "pass_at_k_metrics",
    "reinforce_plus_plus_baseline_advantages", "reinforce_plus_plus_returns", "sft_loss",
    "tis_weights", "value_loss", "whiten",
]


# ----------------------------------------------------------------------------- checks / masks

def _check_shapes(name: str, *tensors: Tensor) -> None:
    """Raise ValueError unless all tensors share one shape."""
    shapes = [tuple(t.shape) for t in tensors]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"{name}: tensors must share one shape, got {shapes}")


def _check_groups(name: str, n_rows: int, n_samples_per_prompt: int) -> None:
    if n_samples_per_prompt < 1 or n_rows % n_samples_per_prompt != 0:
        raise ValueError(f"{name}: batch of {n_rows} samples is not a whole number of groups of "
                         f"n_samples_per_prompt={n_samples_per_prompt}")


def _f(x: Tensor) -> Tensor:
    """x as a float tensor of at least float32 precision (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask > 0, else 0 (robust to inf/NaN in padding, unlike x * mask)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def last_token_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the last masked token of each row, and whether the row has one.

    last[i] = max{t : mask[i, t] = 1} (0 for an empty row); has[i] = any_t mask[i, t] = 1.
    """
    T = mask.shape[-1]
    m = mask > 0
    positions = torch.arange(T, device=mask.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=-1).values
    has = last >= 0
    return last.clamp(min=0), has


# ----------------------------------------------------------------------------- reductions

def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """mean over masked entries: sum(x * m) / max(sum(m), 1), over ``dim`` (all dims if None)."""
    _check_shapes("masked_mean", x, mask)
    m = (mask > 0).to(x.dtype)
    if dim is None:
        return _masked(x, mask).sum() / m.sum().clamp(min=1)
    return _masked(x, mask).sum(dim=dim) / m.sum(dim=dim).clamp(min=1)


def aggregate_loss(x: Tensor, mask: Tensor, mode: str = "sample_mean") -> Tensor:
    """Reduce a per-token quantity to a scalar, as slime's loss aggregation.

    - ``sample_mean``: (1/B) sum_i [ sum_t x_it m_it / max(sum_t m_it, 1) ]
      (per-sample mean of token means; empty rows count as samples contributing 0).
    - ``token_mean``: sum_it x_it m_it / max(sum_it m_it, 1) (mean over all masked tokens).
    """
    if mode == "sample_mean":
        if x.shape[0] == 0:
            return x.new_zeros(())
        return masked_mean(x, mask, dim=-1).mean()
    if mode == "token_mean":
        return masked_mean(x, mask)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")


# ----------------------------------------------------------------------------- logits helpers

def log_probs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """lp[b, t] = log softmax(logits[b, t])[tokens[b, t]]; logits [B, T, V], tokens [B, T]."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"log_probs_from_logits: logits {tuple(logits.shape)} do not match "
                         f"tokens {tuple(tokens.shape)}")
    logp = torch.log_softmax(_f(logits), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum_v softmax(z)_v z_v.

    logits [B, T, V] -> [B, T]."""
    z = _f(logits)
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


# ----------------------------------------------------------------------------- KL

def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_loss_type: str,
                      importance_ratio: Tensor | None = None) -> Tensor:
    """Per-token KL approximation (Schulman's estimators), d = lp - lp_ref:

    - k1: d
    - k2: d^2 / 2
    - k3, low_var_kl: exp(-d) - 1 + d   (>= 0)
    Optionally (unbiased variant) multiplied by ``importance_ratio`` = exp(lp - lp_old).
    low_var_kl is then clamped to [-10, 10]; the others are not clamped. For low_var_kl, -d
    enters exp at most ``LOW_VAR_KL_EXP_MAX``: past ~88.7 exp(-d) overflows float32, and the
    clamp's gradient 0 times inf was NaN, through the mask's ``where`` even at a padding
    position (review, 2026-11-29); the clamped value is the same (> 10 either way).
    """
    _check_shapes("compute_approx_kl", log_probs, ref_log_probs)
    d = _f(log_probs) - _f(ref_log_probs)
    if kl_loss_type == "k1":
        kl = d
    elif kl_loss_type == "k2":
        kl = d.pow(2) / 2.0
    elif kl_loss_type == "k3":
        kl = torch.expm1(-d) + d
    elif kl_loss_type == "low_var_kl":
        kl = torch.expm1((-d).clamp(max=LOW_VAR_KL_EXP_MAX)) + d
    else:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; allowed: {', '.join(KL_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    return kl


# ----------------------------------------------------------------------------- policy losses

def clipped_policy_loss(log_ratio: Tensor, advantages: Tensor, eps_clip: float,
                        eps_clip_high: float | None = None,
                        eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate from a per-token log-ratio (token ratio for PPO/GRPO, the broadcast
    sequence ratio for GSPO):

    r = exp(log_ratio); L1 = -r A; L2 = -clip(r, 1 - eps_clip, 1 + eps_clip_high) A;
    L = max(L1, L2); clipped = [L2 > L1] (before dual-clip);
    dual-clip (eps_clip_c > 1): where A < 0, L = min(L, -eps_clip_c A).
    eps_clip_high defaults to eps_clip. Returns (L [B,T], clipped [B,T] as 0./1. floats).
    """
    _check_shapes("clipped_policy_loss", log_ratio, advantages)
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio)
    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1.0 - eps_clip, 1.0 + hi) * advantages
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(loss.dtype)
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
        dual = torch.minimum(loss, -eps_clip_c * advantages)
        loss = torch.where(advantages < 0, dual, loss)
    return loss, clipped


def compute_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                        eps_clip: float, eps_clip_high: float | None = None,
                        eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """Token-level PPO clipped loss: ``clipped_policy_loss`` with r = exp(lp - lp_old).

    L = max(-r A, -clip(r, 1-eps_clip, 1+eps_clip_high) A), dual-clipped where A < 0 by
    -eps_clip_c A; clipped = [clipped term > unclipped term]. Returns (loss, clipped), [B, T].
    """
    _check_shapes("compute_policy_loss", log_probs, old_log_probs, advantages)
    return clipped_policy_loss(log_probs - old_log_probs, advantages, eps_clip, eps_clip_high,
                               eps_clip_c)


def gspo_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """GSPO per-sequence log-ratio broadcast to tokens:
    s_i = sum_t (lp - lp_old)_it m_it / max(sum_t m_it, 1); returns s_i on every token [B, T].
    Gradients flow to every masked token of the sequence through the mean."""
    _check_shapes("gspo_log_ratio", log_probs, old_log_probs, mask)
    s = masked_mean(log_probs - old_log_probs, mask, dim=-1)
    return s.unsqueeze(-1).expand_as(log_probs)


def gspo_sequence_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """GSPO sequence ratio r_i = exp( sum_t (lp - lp_old) m / max(sum_t m, 1) ) -> [B]."""
    _check_shapes("gspo_sequence_ratio", log_probs, old_log_probs, mask)
    return torch.exp(masked_mean(log_probs - old_log_probs, mask, dim=-1))


def compute_gspo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                             mask: Tensor, eps_clip: float, eps_clip_high: float | None = None,
                             eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """GSPO loss: the clipped loss of ``clipped_policy_loss`` with the per-sequence ratio
    r_i = ``gspo_sequence_ratio`` used for every token of sample i (via ``gspo_log_ratio``).
    Returns (loss [B,T], clipped [B,T])."""
    return clipped_policy_loss(gspo_log_ratio(log_probs, old_log_probs, mask), advantages,
                               eps_clip, eps_clip_high, eps_clip_c)


def tis_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, tis_clip: float = 2.0,
                tis_clip_low: float = 0.0) -> Tensor:
    """Truncated importance sampling weight per token:
    w = clamp(exp(lp_old - lp_roll), tis_clip_low, tis_clip), lp_old detached (no gradient).
    The per-token policy loss is multiplied by w."""
    _check_shapes("tis_weights", old_log_probs, rollout_log_probs)
    if tis_clip_low > tis_clip:
        raise ValueError(f"tis_clip_low ({tis_clip_low}) must be <= tis_clip ({tis_clip})")
    w = torch.exp(old_log_probs.detach() - rollout_log_probs.detach())
    return w.clamp(min=tis_clip_low, max=tis_clip)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               value_clip: float) -> Tensor:
    """Clipped value loss, masked mean over all masked tokens of the batch:
    V_c = V_old + clip(V - V_old, -value_clip, value_clip);
    loss = sum( max((V_c - G)^2, (V - G)^2) m ) / max(sum m, 1)."""
    _check_shapes("value_loss", values, old_values, returns, mask)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    per_token = torch.maximum((v_clipped - returns).pow(2), (values - returns).pow(2))
    return masked_mean(per_token, mask)


def sft_loss(log_probs: Tensor, mask: Tensor, mode: str = "sample_mean") -> Tensor:
    """Supervised loss on response tokens: agg(-lp) with ``aggregate_loss``'s mode."""
    return aggregate_loss(-log_probs, mask, mode)


# ----------------------------------------------------------------------------- advantages

def grpo_advantages(rewards: Tensor, n_samples_per_prompt: int, normalize_std: bool = True) -> Tensor:
    """GRPO group-normalised rewards [B] (groups = consecutive runs of n samples):
    R~ = (R - mean_g) / (std_g + 1e-6), std unbiased (N - 1).
    The std division is skipped when ``normalize_std`` is False (Dr.GRPO) or n == 1.
    Computed in float64, and a group of equal rewards gets exactly 0: in float32, the rounding
    residual of mean_g divided by (std_g + 1e-6) ~ 1e-6 would give spurious advantages (0.06 for
    eight rewards of 0.7)."""
    if rewards.dim() != 1:
        raise ValueError(f"grpo_advantages: rewards must be [B], got {tuple(rewards.shape)}")
    _check_groups("grpo_advantages", rewards.shape[0], n_samples_per_prompt)
    g = rewards.to(torch.float64).view(-1, n_samples_per_prompt)
    constant = (g == g[:, :1]).all(dim=-1, keepdim=True)
    centered = torch.where(constant, torch.zeros_like(g), g - g.mean(dim=-1, keepdim=True))
    if normalize_std and n_samples_per_prompt > 1:
        centered = centered / (g.std(dim=-1, keepdim=True, unbiased=True) + GRPO_STD_EPS)
    return centered.reshape(-1).to(_f(rewards).dtype)


def _discounted_reverse_cumsum(x: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) x_k along the last dim (G_t = x_t + gamma G_{t+1})."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + gamma * running
        out[..., t] = running
    return out


def _add_at_last_token(token_rewards: Tensor, rewards: Tensor, mask: Tensor) -> Tensor:
    """token_rewards + R_i at the last masked token of row i (nothing for an empty row)."""
    last, has = last_token_index(mask)
    bonus = torch.zeros_like(token_rewards)
    bonus.scatter_(-1, last.unsqueeze(-1), (rewards.to(token_rewards.dtype) * has).unsqueeze(-1))
    return token_rewards + bonus


def reinforce_plus_plus_returns(rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float,
                                gamma: float) -> Tensor:
    """REINFORCE++ returns (before whitening), [B, T]:
    r_t = -kl_coef kl_t m_t, plus R at the last masked token;
    G_t = sum_{k >= t} gamma^(k - t) r_k; output G m."""
    _check_shapes("reinforce_plus_plus_returns", kl, mask)
    kl = _f(kl)
    token_rewards = _add_at_last_token(-kl_coef * _masked(kl, mask), _f(rewards), mask)
    return _masked(_discounted_reverse_cumsum(token_rewards, gamma), mask)


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, kl: Tensor, mask: Tensor,
                                            n_samples_per_prompt: int, kl_coef: float) -> Tensor:
    """REINFORCE++-baseline advantages (before whitening), [B, T]:
    R~ = R - mean_g (no std); A_t = (R~ - kl_coef kl_t) m_t."""
    _check_shapes("reinforce_plus_plus_baseline_advantages", kl, mask)
    base = grpo_advantages(rewards, n_samples_per_prompt, normalize_std=False)
    return _masked(base.unsqueeze(-1) - kl_coef * _f(kl), mask)


def gae(rewards: Tensor, values: Tensor, kl: Tensor, mask: Tensor, kl_coef: float, gamma: float,
        lambd: float) -> tuple[Tensor, Tensor]:
    """PPO generalised advantage estimation, [B, T] each.

    Over each row's span t = 0..last (last = last masked token; later positions are padding):
    r_t = -kl_coef kl_t, plus R at t = last; V_{last+1} = 0;
    delta_t = r_t + gamma V_{t+1} - V_t; A_t = sum_l (gamma lambd)^l delta_{t+l};
    returns = A + V. Both outputs are 0 where mask == 0.
    """
    _check_shapes("gae", values, kl, mask)
    last, has = last_token_index(mask)
    T = mask.shape[-1]
    span = (torch.arange(T, device=mask.device).unsqueeze(0) <= last.unsqueeze(-1)) & has.unsqueeze(-1)
    v = _masked(_f(values), span)
    token_rewards = _add_at_last_token(_masked(-kl_coef * _f(kl), span), _f(rewards), mask)
    next_v = torch.cat([v[..., 1:], torch.zeros_like(v[..., :1])], dim=-1)
    deltas = token_rewards + gamma * next_v - v
    adv = _discounted_reverse_cumsum(deltas, gamma * lambd)
    return _masked(adv, mask), _masked(adv + v, mask)


def whiten(values: Tensor, mask: Tensor) -> Tensor:
    """Masked whitening over the whole batch:
    mu = sum(A m) / sum(m); var = sum((A - mu)^2 m) / (sum(m) - 1) (Bessel; 0 if sum(m) <= 1);
    A' = (A - mu) / sqrt(var + 1e-8), 0 where mask == 0 (all zeros for an empty mask).
    Statistics are taken in float64 (the result has ``values``' float dtype, >= float32)."""
    _check_shapes("whiten", values, mask)
    x = values.to(torch.float64)
    n = (mask > 0).sum()
    if n == 0:
        return torch.zeros_like(_f(values))
    mu = _masked(x, mask).sum() / n
    var = _masked((x - mu).pow(2), mask).sum() / (n - 1).clamp(min=1)
    return _masked((x - mu) * torch.rsqrt(var + WHITEN_EPS), mask).to(_f(values).dtype)


def compute_advantages(estimator: str, rewards: Tensor, mask: Tensor, n_samples_per_prompt: int,
                       kl: Tensor | None = None, values: Tensor | None = None,
                       kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
                       normalize_std: bool = True,
                       normalize_advantages: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """Advantages and returns [B, T] for one estimator (0 where mask == 0):

    - grpo, gspo: A_t = grpo_advantages(R) on every masked token; returns = A (as slime).
      kl_coef has no effect.
    - reinforce_plus_plus: G = reinforce_plus_plus_returns(R, kl); A = whiten(G); returns = G.
    - reinforce_plus_plus_baseline: A0 = reinforce_plus_plus_baseline_advantages;
      A = whiten(A0); returns = A0.
    - ppo: (A, returns) = gae(R, values, kl); ``values`` is required.
    ``kl`` defaults to zeros. ``normalize_advantages``: None = the estimator's default (whiten for
    reinforce_plus_plus*, not for the others); True whitens A for any estimator; False never.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {estimator!r}; allowed: "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"compute_advantages: rewards {tuple(rewards.shape)} must be [B] for "
                         f"mask {tuple(mask.shape)}")
    if kl is None:
        kl = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    whitened_by_default = estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
    do_whiten = whitened_by_default if normalize_advantages is None else normalize_advantages
    if estimator in ("grpo", "gspo"):
        a = grpo_advantages(rewards, n_samples_per_prompt, normalize_std)
        adv = _masked(a.unsqueeze(-1).expand(mask.shape), mask)
        returns = adv.clone()
    elif estimator == "reinforce_plus_plus":
        returns = reinforce_plus_plus_returns(rewards, kl, mask, kl_coef, gamma)
        adv = returns
    elif estimator == "reinforce_plus_plus_baseline":
        adv = reinforce_plus_plus_baseline_advantages(rewards, kl, mask, n_samples_per_prompt, kl_coef)
        returns = adv
    else:  # ppo
        if values is None:
            raise ValueError("advantage_estimator 'ppo' needs values from the critic")
        adv, returns = gae(rewards, values, kl, mask, kl_coef, gamma, lambd)
    if do_whiten:
        adv = whiten(adv, mask)
    return adv, returns


# ----------------------------------------------------------------------------- pass@k

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for n samples of which c are correct: 1 - C(n - c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_metrics(rewards: Tensor, n_samples_per_prompt: int) -> dict[str, float]:
    """Mean pass@k over prompts for k = 1, 2, 4, ... up to n (correct = reward == 1),
    keyed ``pass@k``; groups are consecutive runs of n samples."""
    _check_groups("pass_at_k_metrics", rewards.shape[0], n_samples_per_prompt)
    n = n_samples_per_prompt
    correct = (rewards.view(-1, n) == 1).sum(dim=-1).tolist()
    out: dict[str, float] = {}
    k = 1
    while k <= n:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1)
        k *= 2
    return out
