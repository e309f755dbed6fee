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
    group_advantages,
    policy_loss,
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
