"""Pure GRPO math against hand-computed values (trainer/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    admission_mask,
    behaviour_weights,
    effective_sample_size,
    entropy_bonus,
    ess_lr_scale,
    group_advantages,
    policy_loss,
    second_moment_keep,
    second_moment_mask,
    sequence_ratio_sums,
    token_entropy,
    token_logprobs,
    weight_stats,
)

EPS = 1e-4


def _close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_group_advantages_std_normalised() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, groups, std_normalize=True, eps=EPS)
    s0 = math.sqrt(0.5)  # unbiased std of {1, 0}
    expected = [0.5 / (s0 + EPS), -0.5 / (s0 + EPS), 0.0, 0.0, -1 / (1 + EPS), 0.0, 1 / (1 + EPS)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-12)


def test_group_advantages_without_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups, std_normalize=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -1.0, 0.0, 1.0])


def test_all_equal_rewards_give_zero_advantage() -> None:
    rewards = torch.full((8,), 0.75)
    for std in (True, False):
        adv = group_advantages(rewards, torch.zeros(8, dtype=torch.long), std_normalize=std)
        assert torch.equal(adv, torch.zeros(8))


def test_singleton_group_has_zero_advantage() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.3]), torch.tensor([0, 1]))
    assert adv.tolist() == [0.0, 0.0]


def test_admission_drops_beyond_s_and_negative() -> None:
    stale = torch.tensor([0, 2, 3, 4, 5, -1])
    assert admission_mask(stale, 3).tolist() == [True, True, True, False, False, False]
    assert admission_mask(stale, 0).tolist() == [True, False, False, False, False, False]


def _ratio_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Row 0: token ratios π_prox/μ = 5, 0.75, 1. Row 1: one token with ratio 1.5, then padding
    # whose (garbage) log-probs must be ignored.
    prox = torch.log(torch.tensor([[0.5, 0.3, 0.9], [0.3, 0.9, 0.9]]))
    beh = torch.log(torch.tensor([[0.1, 0.4, 0.9], [0.2, 0.01, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return prox, beh, mask, torch.tensor([0, 0])


def test_token_truncation_at_c() -> None:
    prox, beh, mask, st = _ratio_batch()
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="truncate", level="token")
    _close(bw.weights, [[2.0, 0.75, 1.0], [1.5, 0.0, 0.0]])
    assert bw.modified.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_token_masking_outside_band() -> None:
    prox, beh, mask, st = _ratio_batch()
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="mask", level="token")
    # 5 > 2 masked; 0.75, 1 and 1.5 inside [0.5, 2].
    _close(bw.weights, [[0.0, 0.75, 1.0], [1.5, 0.0, 0.0]])
    assert bw.modified.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    bw = behaviour_weights(prox, beh, mask, st, cap=1.4, mode="mask", level="token")
    # band [0.714, 1.4]: 5 and 1.5 masked.
    _close(bw.weights, [[0.0, 0.75, 1.0], [0.0, 0.0, 0.0]])
    assert bw.modified.sum().item() == 2.0


def test_sequence_level_uses_product_of_ratios() -> None:
    prox, beh, mask, st = _ratio_batch()
    # Row 0: 5 · 0.75 · 1 = 3.75 for every token; row 1: 1.5.
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="truncate", level="sequence")
    _close(bw.weights, [[2.0, 2.0, 2.0], [1.5, 0, 0]])
    assert bw.modified.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    bw = behaviour_weights(prox, beh, mask, st, cap=4.0, mode="mask", level="sequence")
    _close(bw.weights, [[3.75, 3.75, 3.75], [1.5, 0, 0]])
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="mask", level="sequence")
    _close(bw.weights, [[0.0, 0.0, 0.0], [1.5, 0, 0]])
    stats = weight_stats(prox, beh, mask, bw, "sequence")
    assert (stats.units, stats.modified, stats.tokens) == (2.0, 1.0, 4.0)


def test_mismatch_kl_of_agreeing_policies_is_not_rounding_noise() -> None:
    """Node and trainer agreeing to ~1e-6 nats a token (kernel rounding at S = 0) have a mismatch
    KL of ~5e-13 a token; the fp32 k3 reported ~1e-9 of rounding noise instead."""
    g = torch.Generator().manual_seed(1)
    prox = -torch.rand(8, 64, generator=g) * 3.0
    beh = prox + 1e-6 * torch.randn(8, 64, generator=g)
    mask = torch.ones(8, 64)
    st = torch.zeros(8, dtype=torch.long)
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="truncate", level="token")
    stats = weight_stats(prox, beh, mask, bw, "token")
    x = prox.double() - beh.double()  # the fp32 log-ratios, exactly
    exact = float((torch.expm1(x) - x).sum())
    assert stats.kl_sum == pytest.approx(exact, rel=1e-3)
    assert 0 < stats.kl_sum / 512 < 1e-11


def test_weight_off_and_staleness_decay() -> None:
    prox, beh, mask, _ = _ratio_batch()
    st = torch.tensor([2, 1])
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="off", level="token", decay=0.5)
    assert bw.weights.tolist() == [[0.25, 0.25, 0.25], [0.5, 0.0, 0.0]]
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="truncate", level="token", decay=0.5)
    _close(bw.weights, [[0.5, 0.1875, 0.25], [0.75, 0, 0]])


def test_weight_stats_kl_and_ess() -> None:
    prox, beh, mask, st = _ratio_batch()
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="truncate", level="token")
    stats = weight_stats(prox, beh, mask, bw, "token")
    ratios = [5.0, 0.75, 1.0, 1.5]
    k3 = sum(r - 1 - math.log(r) for r in ratios)
    k1 = sum(-math.log(r) for r in ratios)
    assert stats.kl_sum == pytest.approx(k3, rel=1e-5)
    assert stats.kl_k1_sum == pytest.approx(k1, rel=1e-5)
    assert (stats.units, stats.tokens, stats.modified) == (4.0, 4.0, 1.0)
    w = [2.0, 0.75, 1.0, 1.5]
    ess = effective_sample_size(stats.w_sum, stats.w_sq_sum)
    assert ess == pytest.approx(sum(w) ** 2 / sum(x * x for x in w), rel=1e-6)
    assert effective_sample_size(0.0, 0.0) == 0.0


def test_geometric_level_rejects_on_the_mean_log_ratio() -> None:
    # Geo-RS: row 0's geometric mean ratio is (5 · 0.75 · 1)^(1/3) = 1.5536, row 1's is 1.5.
    prox, beh, mask, st = _ratio_batch()
    geo0 = 3.75 ** (1 / 3)
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="mask", level="geometric")
    _close(bw.weights, [[geo0, geo0, geo0], [1.5, 0.0, 0.0]])
    # band [1/1.52, 1.52]: row 0 is out (its every token is rejected), row 1 is in, weight 1.
    bw = behaviour_weights(prox, beh, mask, st, cap=1.52, mode="reject", level="geometric")
    _close(bw.weights, [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert bw.modified.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    stats = weight_stats(prox, beh, mask, bw, "geometric")
    assert (stats.units, stats.modified, stats.zeroed_tokens, stats.tokens) == (2.0, 1.0, 3.0, 4.0)
    assert (stats.w_sum, stats.w_sq_sum) == (1.0, 1.0)  # one sequence of weight 1, one of 0


def test_icepop_band_is_asymmetric_and_keeps_the_ratio_inside() -> None:
    prox, beh, mask, st = _ratio_batch()  # token ratios 5, 0.75, 1 | 1.5
    bw = behaviour_weights(prox, beh, mask, st, cap=6.0, cap_low=0.5, mode="mask", level="token")
    _close(bw.weights, [[5.0, 0.75, 1.0], [1.5, 0.0, 0.0]])  # all inside [0.5, 6]
    assert bw.modified.sum().item() == 0.0
    # [0.8, 4.5]: 5 (above) and 0.75 (below) masked, 1 and 1.5 kept at their ratio.
    bw = behaviour_weights(prox, beh, mask, st, cap=4.5, cap_low=0.8, mode="mask", level="token")
    _close(bw.weights, [[0.0, 0.0, 1.0], [1.5, 0.0, 0.0]])
    assert bw.modified.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_reject_and_raw_modes() -> None:
    prox, beh, mask, st = _ratio_batch()
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="reject", level="token")
    _close(bw.weights, [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 5 outside [0.5, 2]: rejected
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="raw", level="token")
    _close(bw.weights, [[5.0, 0.75, 1.0], [1.5, 0.0, 0.0]])  # untruncated
    assert bw.modified.sum().item() == 0.0


def test_second_moment_mask_drops_the_largest_until_the_mean_is_below_tau() -> None:
    # (log r)² = 0.01, 0.25, 0.04, 1.0 (+ padding). Mean 0.325 > 0.04; without 1.0: 0.1 > 0.04;
    # without 1.0 and 0.25: 0.025 ≤ 0.04 -> keep the tokens of 0.1 and 0.2.
    log_r = torch.tensor([[0.1, -0.5, 0.2, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert second_moment_mask(log_r, mask, 0.04).tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]
    # the mean without 1.0 is 0.1: τ = 0.11 keeps three tokens, τ = 0.09 two.
    assert second_moment_mask(log_r, mask, 0.11).tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert second_moment_mask(log_r, mask, 0.09).tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]
    assert second_moment_mask(log_r, mask, 0.5).tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0]]
    # Nothing satisfies τ: the single smallest token is kept (as AReaL does).
    assert second_moment_mask(log_r, mask, 1e-6).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert second_moment_mask(log_r, torch.zeros_like(mask), 0.04).sum().item() == 0.0


def test_second_moment_keep_breaks_ties_by_position() -> None:
    # (log r)² = 1, 4, 4, 0 in position order. τ = 1: without both 4s the mean is 0.5 (with one
    # of them 5/3): both go. τ = 1.7: one 4 is enough (5/3 ≤ 1.7) and the earlier one goes.
    m2 = torch.tensor([1.0, 4.0, 4.0, 0.0])
    assert second_moment_keep(m2, 1.0).tolist() == [True, False, False, True]
    assert second_moment_keep(m2, 1.7).tolist() == [True, False, True, True]
    assert second_moment_keep(torch.zeros(0), 1.0).tolist() == []


def test_m2po_mask_given_precomputed_is_applied_as_is() -> None:
    # the sharded trainer chooses the mask over every rank's tokens and passes it in
    prox, beh, mask, st = _ratio_batch()
    keep = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    bw = behaviour_weights(prox, beh, mask, st, cap=2.0, mode="raw", level="token", m2_keep=keep)
    _close(bw.weights, [[5.0, 0.0, 1.0], [1.5, 0.0, 0.0]])
    assert bw.m2_masked.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="not both"):
        behaviour_weights(
            prox, beh, mask, st, cap=2.0, mode="raw", level="token", m2_threshold=0.1,
            m2_keep=keep,
        )  # fmt: skip


def test_m2po_mask_in_behaviour_weights_and_stats() -> None:
    # (log r)²: ln5² = 2.590, ln0.75² = 0.0828, 0, ln1.5² = 0.1644; mean 0.709 > 0.1; without
    # the ln5 token: 0.0824 ≤ 0.1. So only the token of ratio 5 is dropped.
    prox, beh, mask, st = _ratio_batch()
    bw = behaviour_weights(
        prox, beh, mask, st, cap=2.0, mode="raw", level="token", m2_threshold=0.1
    )
    _close(bw.weights, [[0.0, 0.75, 1.0], [1.5, 0.0, 0.0]])
    assert bw.m2_masked.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    stats = weight_stats(prox, beh, mask, bw, "token")
    m2 = sum(math.log(r) ** 2 for r in (5.0, 0.75, 1.0, 1.5))
    assert stats.m2_sum == pytest.approx(m2, rel=1e-5)
    assert stats.zeroed_tokens == 1.0


def test_vcpo_lr_scale_from_the_sequence_level_ess() -> None:
    # sequence ratios 5 · 0.75 · 1 = 3.75 and 1.5 (padding ignored): Σw = 5.25, Σw² = 16.3125,
    # ESS = 5.25² / 16.3125 = 1.6897 of n = 2 -> factor sqrt(0.8448) = 0.9191.
    prox, beh, mask, _ = _ratio_batch()
    w_sum, w_sq, n = sequence_ratio_sums(prox, beh, mask)
    assert (w_sum, w_sq, n) == pytest.approx((5.25, 16.3125, 2.0), rel=1e-5)
    assert ess_lr_scale(w_sum, w_sq, n) == pytest.approx(math.sqrt(5.25**2 / 16.3125 / 2), rel=1e-5)
    assert ess_lr_scale(*sequence_ratio_sums(prox, prox, mask)) == 1.0  # on-policy: no damping
    assert ess_lr_scale(0.0, 0.0, 0.0) == 1.0


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject", "raw", "off"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_every_option_is_neutral_when_behaviour_is_the_proximal_policy(
    mode: str, level: str
) -> None:
    # S = 0 (μ = π_prox): every correction must leave w = 1 on every completion token.
    prox, _, mask, st = _ratio_batch()
    bw = behaviour_weights(
        prox, prox.clone(), mask, st, cap=1.5, mode=mode, level=level,  # type: ignore[arg-type]
        cap_low=0.9, m2_threshold=0.04,
    )  # fmt: skip
    assert torch.equal(bw.weights, mask)
    assert bw.modified.sum().item() == 0.0 and bw.m2_masked.sum().item() == 0.0


@pytest.mark.parametrize(
    ("adv", "expected_loss", "expected_grad", "binding"),
    [
        # A=+1: ρ=1.5 clipped to 1.28 (no gradient); ρ=0.7 below 1−ε is not clipped for A>0.
        (1.0, -(1.28 * 1 + 0.7 * 2) / 2, [0.0, -0.7 * 2 / 2], 1.0),
        # A=−1: ρ=1.5 is not clipped for A<0; ρ=0.7 clipped to 0.8 (no gradient).
        (-1.0, (1.5 * 1 + 0.8 * 2) / 2, [1.5 * 1 / 2, 0.0], 1.0),
    ],
)
def test_policy_loss_clip_asymmetric(
    adv: float, expected_loss: float, expected_grad: list[float], binding: float
) -> None:
    prox = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    logp = (prox + torch.log(torch.tensor([[1.5, 0.7, 9.0]]))).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third column is padding: huge ratio must not count
    weights = torch.tensor([[1.0, 2.0, 0.0]])
    out = policy_loss(
        logp, prox, torch.tensor([adv]), weights, mask, eps=0.2, eps_high=0.28, normalizer=2.0
    )
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert out.clipped_tokens.item() == binding
    out.loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, :2].tolist() == pytest.approx(expected_grad, abs=1e-6)
    assert logp.grad[0, 2].item() == 0.0


def test_entropy_and_logprob_helpers() -> None:
    logits = torch.zeros(1, 2, 4)
    logits[0, 1] = torch.tensor([0.0, 0.0, -1e9, -1e9])
    ent = token_entropy(logits)
    _close(ent, [[math.log(4), math.log(2)]])
    lp = token_logprobs(logits, torch.tensor([[3, 1]]))
    _close(lp, [[-math.log(4), -math.log(2)]])
    mask = torch.tensor([[1.0, 0.0]])
    bonus = entropy_bonus(ent, mask, coef=0.5, normalizer=1.0)
    assert bonus.item() == pytest.approx(-0.5 * math.log(4), rel=1e-6)
