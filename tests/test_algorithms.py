"""Hand-computed cases for trainers/algorithms.py (expected numbers worked out by hand; the
arithmetic is written in the comments)."""

import math

import pytest
import torch

from trainers import algorithms as alg

torch.set_num_threads(1)


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a.to(torch.float64), t(b), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- KL

LP, REF = t([[0.0, -1.0]]), t([[-0.5, -0.5]])  # d = [0.5, -0.5]


@pytest.mark.parametrize("kind,expected", [
    ("k1", [[0.5, -0.5]]),
    ("k2", [[0.125, 0.125]]),  # d^2/2
    # exp(-0.5) - 1 + 0.5 = 0.60653066 - 0.5 ; exp(0.5) - 1 - 0.5 = 1.64872127 - 1.5
    ("k3", [[0.1065306597, 0.1487212707]]),
    ("low_var_kl", [[0.1065306597, 0.1487212707]]),
])
def test_kl_estimators(kind, expected):
    close(alg.compute_approx_kl(LP, REF, kind), expected, 1e-9)


def test_low_var_kl_clamped_but_k3_not():
    lp, ref = t([[-20.0, 0.0]]), t([[0.0, -30.0]])  # d = -20, 30
    # k3: exp(20) - 1 - 20 = 485165174.41; exp(-30) - 1 + 30 = 29.0000000000001
    close(alg.compute_approx_kl(lp, ref, "k3"), [[485165174.40979, 29.0]], 1e-4)
    close(alg.compute_approx_kl(lp, ref, "low_var_kl"), [[10.0, 10.0]])
    # k1 is not clamped either
    close(alg.compute_approx_kl(lp, ref, "k1"), [[-20.0, 30.0]])


def test_low_var_kl_gradient_stays_finite_where_exp_overflows():
    """exp(-d) overflowed float32 past d = -88.7: the clamp's gradient was 0 * inf = NaN, at a
    masked-out position too (review, 2026-11-29)."""
    for d0 in (-50.0, -90.0, -1000.0):
        lp = torch.tensor([[d0, -1.0]], requires_grad=True)
        kl = alg.compute_approx_kl(lp, torch.zeros(1, 2), "low_var_kl")
        alg.aggregate_loss(kl, t([[0.0, 1.0]])).backward()
        close(kl.detach(), [[10.0, math.e - 2.0]])
        close(lp.grad, [[0.0, 1.0 - math.e]])


def test_kl_importance_ratio_and_bad_type():
    w = t([[2.0, 0.5]])
    close(alg.compute_approx_kl(LP, REF, "k1", importance_ratio=w), [[1.0, -0.25]])
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        alg.compute_approx_kl(LP, REF, "k4")
    with pytest.raises(ValueError, match="shape"):
        alg.compute_approx_kl(LP, REF[:, :1], "k1")


def test_kl_keeps_float64_and_upcasts_half():
    assert alg.compute_approx_kl(LP, REF, "k3").dtype == torch.float64
    assert alg.compute_approx_kl(LP.to(torch.bfloat16), REF.to(torch.bfloat16), "k3").dtype == torch.float32


# ----------------------------------------------------------------------------- policy loss

# ratios r and advantages A, eps_clip=0.2, eps_clip_high=0.3 -> clip range [0.8, 1.3]
RATIOS = [1.5, 0.5, 1.1, 0.5, 5.0]
ADVS = [1.0, 1.0, -2.0, -1.0, -1.0]
# r=1.5,A=1 : L1=-1.5, L2=-1.3 -> L=-1.3, clipped
# r=0.5,A=1 : L1=-0.5, L2=-0.8 -> L=-0.5
# r=1.1,A=-2: L1=2.2,  L2=2.2  -> L=2.2 (tie: not clipped)
# r=0.5,A=-1: L1=0.5,  L2=0.8  -> L=0.8, clipped
# r=5,  A=-1: L1=5.0,  L2=1.3  -> L=5.0 ; dual-clip c=3: min(5, 3) = 3
EXP_LOSS = [[-1.3, -0.5, 2.2, 0.8, 5.0]]
EXP_CLIPPED = [[1.0, 0.0, 0.0, 1.0, 0.0]]


def _lp_old(ratios):
    old = t([[-0.7] * len(ratios)])
    return old + torch.log(t([ratios])), old


def test_policy_loss_clip_high():
    lp, old = _lp_old(RATIOS)
    loss, clipped = alg.compute_policy_loss(lp, old, t([ADVS]), 0.2, eps_clip_high=0.3)
    close(loss, EXP_LOSS, 1e-9)
    close(clipped, EXP_CLIPPED)


def test_policy_loss_dual_clip():
    lp, old = _lp_old(RATIOS)
    loss, clipped = alg.compute_policy_loss(lp, old, t([ADVS]), 0.2, 0.3, eps_clip_c=3.0)
    close(loss, [[-1.3, -0.5, 2.2, 0.8, 3.0]], 1e-9)
    close(clipped, EXP_CLIPPED)  # clipfrac is taken before dual-clip
    with pytest.raises(ValueError, match="eps_clip_c"):
        alg.compute_policy_loss(lp, old, t([ADVS]), 0.2, 0.3, eps_clip_c=1.0)


def test_policy_loss_eps_clip_high_defaults_to_eps_clip():
    lp, old = _lp_old([1.5, 0.5])
    loss, clipped = alg.compute_policy_loss(lp, old, t([[1.0, -1.0]]), 0.2)
    # r=1.5,A=1 -> -min(1.5,1.2) = -1.2 ; r=0.5,A=-1 -> max(0.5, 0.8) = 0.8
    close(loss, [[-1.2, 0.8]], 1e-9)
    close(clipped, [[1.0, 1.0]])


def test_policy_loss_gradient_is_zero_when_clipped():
    lp, old = _lp_old([1.5, 1.0])
    lp.requires_grad_(True)
    loss, _ = alg.compute_policy_loss(lp, old, t([[1.0, 1.0]]), 0.2)
    loss.sum().backward()
    # clipped token: constant -1.2 -> grad 0; r=1 token: d(-exp(lp-old))/dlp = -1
    close(lp.grad, [[0.0, -1.0]], 1e-9)


# ----------------------------------------------------------------------------- GSPO

def test_gspo_sequence_ratio():
    lp = t([[0.2, 0.4, 9.0], [-0.3, 5.0, 5.0], [1.0, 1.0, 1.0]])
    old = torch.zeros_like(lp)
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # row means over masked tokens: 0.3, -0.3; empty row -> 0 -> ratio 1
    close(alg.gspo_sequence_ratio(lp, old, mask), [math.exp(0.3), math.exp(-0.3), 1.0], 1e-9)
    close(alg.gspo_log_ratio(lp, old, mask), [[0.3] * 3, [-0.3] * 3, [0.0] * 3], 1e-9)


def test_gspo_policy_loss_values_and_gradient():
    lp = t([[0.2, 0.4, 9.0], [-0.3, 5.0, 5.0]])
    old = torch.zeros_like(lp)
    mask = t([[1, 1, 0], [1, 0, 0]])
    adv = t([[1.0] * 3, [-1.0] * 3])
    loss, clipped = alg.compute_gspo_policy_loss(lp, old, adv, mask, 0.2)
    # row0: r=exp(.3)=1.3499 > 1.2, A=1 -> -1.2 clipped; row1: r=exp(-.3)=0.7408 < 0.8, A=-1 -> 0.8
    close(loss, [[-1.2] * 3, [0.8] * 3], 1e-9)
    close(clipped, [[1.0] * 3, [1.0] * 3])
    # unclipped: loss per sample -exp(mean lp) A; d/dlp_t = -A r / n_masked on masked tokens only
    lp0 = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    m0 = t([[1, 1, 0]])
    loss, _ = alg.compute_gspo_policy_loss(lp0, torch.zeros_like(lp0), t([[1.0] * 3]), m0, 10.0)
    alg.aggregate_loss(loss, m0).backward()
    close(lp0.grad, [[-0.5, -0.5, 0.0]], 1e-9)


# ----------------------------------------------------------------------------- TIS / value / sft

def test_tis_weights():
    old = t([[0.0, -1.0, -0.3]], ).requires_grad_(True)
    roll = t([[-1.0, 0.0, -0.3]])
    w = alg.tis_weights(old, roll)
    # exp(1)=2.718 -> 2 ; exp(-1) = 0.36788 ; exp(0) = 1
    close(w, [[2.0, 0.3678794412, 1.0]], 1e-9)
    assert not w.requires_grad  # lp_old is detached
    close(alg.tis_weights(old, roll, tis_clip=3.0, tis_clip_low=0.5), [[2.718281828, 0.5, 1.0]], 1e-8)
    with pytest.raises(ValueError, match="tis_clip_low"):
        alg.tis_weights(old, roll, tis_clip=1.0, tis_clip_low=2.0)


def test_value_loss():
    values = t([[1.0, 2.0, 0.0], [7.0, 7.0, 7.0]])
    old = t([[0.5, 2.5, 0.0], [0.0, 0.0, 0.0]])
    returns = t([[2.0, 3.0, 5.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [0, 0, 0]])
    # t0: Vc = 0.5 + clip(0.5) = 0.7 -> max((0.7-2)^2, (1-2)^2) = max(1.69, 1) = 1.69
    # t1: Vc = 2.5 - 0.2 = 2.3   -> max((2.3-3)^2, (2-3)^2) = max(0.49, 1) = 1
    close(alg.value_loss(values, old, returns, mask, 0.2), 1.345, 1e-9)
    # no masked token at all -> 0, not NaN
    close(alg.value_loss(values, old, returns, torch.zeros_like(mask), 0.2), 0.0)


def test_sft_loss():
    lp = t([[-1.0, -3.0, -100.0], [-2.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(alg.sft_loss(lp, mask), (2.0 + 2.0) / 2)  # row means 2, 2
    close(alg.sft_loss(lp, mask, "token_mean"), 6.0 / 3)


# ----------------------------------------------------------------------------- aggregation / logits

def test_aggregate_loss():
    x = t([[1.0, 2.0, float("inf")], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # per-sample means 1.5, 4, (empty) 0 -> (1.5 + 4 + 0) / 3 ; token mean (1 + 2 + 4) / 3
    close(alg.aggregate_loss(x, mask, "sample_mean"), 5.5 / 3)
    close(alg.aggregate_loss(x, mask, "token_mean"), 7.0 / 3)
    close(alg.masked_mean(x, mask, dim=-1), [1.5, 4.0, 0.0])
    with pytest.raises(ValueError, match="sample_mean, token_mean"):
        alg.aggregate_loss(x, mask, "seq_mean_token_sum")
    close(alg.aggregate_loss(x[:0], mask[:0]), 0.0)


def test_entropy_and_log_probs_from_logits():
    logits = t([[[0.0, math.log(3.0)], [1000.0, 0.0]]])  # p = (1/4, 3/4) ; ~(1, 0)
    # H = -(.25 ln .25 + .75 ln .75) = 0.346574 + 0.215762
    close(alg.entropy_from_logits(logits), [[0.5623351446, 0.0]], 1e-9)
    close(alg.entropy_from_logits(torch.zeros(1, 2, 5)), [[math.log(5)] * 2], 1e-6)
    tokens = torch.tensor([[1, 1]])
    close(alg.log_probs_from_logits(logits, tokens), [[math.log(0.75), -1000.0]], 1e-9)
    with pytest.raises(ValueError, match="tokens"):
        alg.log_probs_from_logits(logits, torch.tensor([[1]]))


# ----------------------------------------------------------------------------- advantages

def test_grpo_advantages():
    r = t([1, 0, 0, 1, 1, 1, 1, 1])
    # group 1: mean .5, unbiased std sqrt(4 * .25 / 3) = 0.5773503 ; group 2: all equal -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(alg.grpo_advantages(r, 4), [a, -a, -a, a, 0, 0, 0, 0], 1e-9)
    close(alg.grpo_advantages(r, 4, normalize_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(alg.grpo_advantages(t([1.0, 2.0, 3.0]), 3), [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)], 1e-9)


def test_grpo_n1_skips_std_and_bad_group_size():
    out = alg.grpo_advantages(t([0.3, 1.0]), 1)  # R - mean of a one-sample group = 0; no NaN
    close(out, [0.0, 0.0])
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        alg.grpo_advantages(t([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match=r"\[B\]"):
        alg.grpo_advantages(t([[1.0, 2.0]]), 2)


def test_reinforce_plus_plus_returns():
    rewards = t([1.0, 2.0, 3.0])
    kl = t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    # kl_coef .5, gamma .9
    # row0 r = [-.05, -.1, -.15 + 1, 0] -> G2 = .85, G1 = -.1 + .9*.85 = .665, G0 = -.05 + .9*.665 = .5485
    # row1 r = [-.25, 0 (masked), -.25 + 2, 0] -> G2 = 1.75, G1 = 1.575 (masked -> 0), G0 = -.25 + .9*1.575
    # row2 has no masked token: all 0
    out = alg.reinforce_plus_plus_returns(rewards, kl, mask, 0.5, 0.9)
    close(out, [[0.5485, 0.665, 0.85, 0.0], [1.1675, 0.0, 1.75, 0.0], [0.0] * 4], 1e-9)


def test_reinforce_plus_plus_baseline_advantages():
    rewards = t([1.0, 0.0, 2.0, 2.0])
    kl = t([[0.2, 0.4], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    mask = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    # R~ = R - group mean = [.5, -.5, 0, 0]; A = R~ - .1 kl
    out = alg.reinforce_plus_plus_baseline_advantages(rewards, kl, mask, 2, 0.1)
    close(out, [[0.48, 0.46], [-0.5, -0.5], [-0.1, -0.1], [0.0, 0.0]], 1e-9)


def test_gae():
    rewards = t([1.0, 5.0])
    values = t([[0.5, 0.4, 0.2, 9.0], [1.0, 1.0, 1.0, 1.0]])
    kl = t([[0.1, 0.2, 0.3, 7.0], [1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 0, 1, 0], [0, 0, 0, 0]])
    # kl_coef .5, gamma .9, lambd .8 ; row0 span t=0..2 (t=3 is padding)
    # r = [-.05, -.1, -.15 + 1 = .85] ; V = [.5, .4, .2], V_3 = 0
    # delta = [-.05 + .36 - .5, -.1 + .18 - .4, .85 - .2] = [-.19, -.32, .65]
    # A2 = .65 ; A1 = -.32 + .72*.65 = .148 ; A0 = -.19 + .72*.148 = -.08344
    # returns = A + V = [.41656, .548 (masked -> 0), .85]
    adv, ret = alg.gae(rewards, values, kl, mask, 0.5, 0.9, 0.8)
    close(adv, [[-0.08344, 0.0, 0.65, 0.0], [0.0] * 4], 1e-9)
    close(ret, [[0.41656, 0.0, 0.85, 0.0], [0.0] * 4], 1e-9)


def test_whiten():
    x = t([[1.0, 2.0, 3.0], [4.0, 100.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # masked 1,2,3,4: mu 2.5, var (2.25+.25+.25+2.25)/3 = 5/3
    s = math.sqrt(5 / 3 + 1e-8)
    close(alg.whiten(x, mask), [[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]], 1e-9)
    close(alg.whiten(x, torch.zeros_like(mask)), [[0.0] * 3] * 2)
    close(alg.whiten(x, t([[0, 1, 0], [0, 0, 0]])), [[0.0] * 3] * 2)  # one token: 0, not NaN


def test_last_token_index():
    last, has = alg.last_token_index(t([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]))
    assert last.tolist() == [1, 2, 0, 3] and has.tolist() == [True, True, False, True]


# ----------------------------------------------------------------------------- dispatcher

MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
REWARDS = t([1.0, 0.0, 1.0, 1.0])


@pytest.mark.parametrize("est", ["grpo", "gspo"])
def test_compute_advantages_grpo_broadcasts(est):
    adv, ret = alg.compute_advantages(est, REWARDS, MASK, 2, kl_coef=123.0)  # kl_coef: no effect
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # group 1: mean .5, unbiased std sqrt(.5); group 2: equal
    close(adv, [[a, a, 0.0], [-a, -a, -a], [0.0] * 3, [0.0] * 3], 1e-9)
    close(ret, adv.tolist())
    # normalize_advantages=True whitens over the mask (masked values a, a, -a, -a, -a, 0)
    vals = [a, a, -a, -a, -a, 0.0]
    mu = sum(vals) / 6
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 5 + 1e-8)
    adv_w, _ = alg.compute_advantages(est, REWARDS, MASK, 2, normalize_advantages=True)
    close(adv_w, [[(a - mu) / sd] * 2 + [0.0], [(-a - mu) / sd] * 3, [-mu / sd, 0, 0], [0.0] * 3], 1e-6)


def test_compute_advantages_reinforce_plus_plus_whitened_by_default():
    kl = t([[0.1, 0.2, 0.3], [0.0, 0.1, 0.0], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0]])
    g = alg.reinforce_plus_plus_returns(REWARDS, kl, MASK, 0.1, 1.0)
    adv, ret = alg.compute_advantages("reinforce_plus_plus", REWARDS, MASK, 2, kl=kl, kl_coef=0.1)
    close(ret, g.tolist())
    close(adv, alg.whiten(g, MASK).tolist())
    # row1 (gamma 1): G = [0 - .01, -.01, 0] ; row0: G = [1 - .03, 1 - .02] ; row2: [1 - .05]
    close(g, [[0.97, 0.98, 0.0], [-0.01, -0.01, 0.0], [0.95, 0.0, 0.0], [0.0] * 3], 1e-9)
    adv_raw, _ = alg.compute_advantages("reinforce_plus_plus", REWARDS, MASK, 2, kl=kl, kl_coef=0.1,
                                        normalize_advantages=False)
    close(adv_raw, g.tolist())


def test_compute_advantages_baseline_and_ppo():
    adv, ret = alg.compute_advantages("reinforce_plus_plus_baseline", REWARDS, MASK, 2)
    # R~ = [.5, -.5, 0, 0] on masked tokens, then whitened over the 6 masked tokens
    vals = [0.5, 0.5, -0.5, -0.5, -0.5, 0.0]
    mu = sum(vals) / 6
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 5 + 1e-8)
    close(ret, [[0.5, 0.5, 0], [-0.5] * 3, [0.0] * 3, [0.0] * 3])
    close(adv[0, 0], (0.5 - mu) / sd, 1e-9)
    values = t([[0.2, 0.3, 0.0], [0.1, 0.1, 0.1], [0.5, 0.0, 0.0], [0.0] * 3])
    adv, ret = alg.compute_advantages("ppo", REWARDS, MASK, 2, values=values)
    # gamma = lambd = 1, no kl: A_t = R - V_t, returns = R on masked tokens
    close(adv, [[0.8, 0.7, 0.0], [-0.1] * 3, [0.5, 0.0, 0.0], [0.0] * 3], 1e-9)
    close(ret, [[1.0, 1.0, 0.0], [0.0] * 3, [1.0, 0.0, 0.0], [0.0] * 3], 1e-9)


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo"):
        alg.compute_advantages("rloo", REWARDS, MASK, 2)
    with pytest.raises(ValueError, match="values"):
        alg.compute_advantages("ppo", REWARDS, MASK, 2)
    with pytest.raises(ValueError, match="rewards"):
        alg.compute_advantages("grpo", REWARDS[:3], MASK, 1)


# ----------------------------------------------------------------------------- pass@k

def test_pass_at_k():
    assert alg.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert alg.pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert alg.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert alg.pass_at_k(4, 0, 4) == 0.0
    assert alg.pass_at_k(4, 3, 2) == 1.0  # n - c < k
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            alg.pass_at_k(*bad)


def test_pass_at_k_metrics():
    r = t([1, 0, 0, 0, 1, 1, 0, 0.5])
    # group1 c=1: .25, .5, 1 ; group2 c=2 (0.5 is not correct): .5, 1 - 1/6, 1
    m = alg.pass_at_k_metrics(r, 4)
    assert m.keys() == {"pass@1", "pass@2", "pass@4"}
    assert m["pass@1"] == pytest.approx(0.375)
    assert m["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["pass@4"] == pytest.approx(1.0)


def test_grpo_equal_fractional_rewards_give_exact_zero():
    # float32 mean of eight 0.7s is not exactly 0.7; the residual / (std + 1e-6) must not leak
    for v in (0.7, 0.1, 123.456):
        a = alg.grpo_advantages(torch.full((8,), v, dtype=torch.float32), 8)
        assert a.dtype == torch.float32 and (a == 0).all()


@pytest.mark.parametrize("est", alg.ADVANTAGE_ESTIMATORS)
def test_compute_advantages_mask_dtypes_agree(est):
    kl = t([[0.1, 0.2, 0.3], [0.0, 0.1, 0.0], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0]]).float()
    values = kl * 0.5
    outs = [alg.compute_advantages(est, REWARDS.float(), MASK.to(dt), 2, kl=kl, values=values,
                                   kl_coef=0.1, gamma=0.9, lambd=0.8)
            for dt in (torch.float32, torch.bool, torch.long)]
    for adv, ret in outs[1:]:
        assert adv.dtype == torch.float32
        torch.testing.assert_close(adv, outs[0][0])
        torch.testing.assert_close(ret, outs[0][1])
