"""Tokens outside the trainer's top-k/top-p support (issue 32): the mismatch KL is taken over the
tokens both policies support, the others are counted apart (``out_of_support_*``), get weight 0
and pass no gradient, and neither blow up nor dominate any figure.

A node holding the bf16 rounding of the trainer's weights now and then samples a token the
trainer's top-p removes (tests/unit/test_publish_rounding_support.py): π_prox = 0 there, and the
k3 term at the ±60 clamp (59 nats) made one such token of a 32-token step read as mismatch_kl
59/32 = 1.84375, a floor far above staleness's ~4e-5.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from protocol.identity import Identity
from swarm.memtransport import InMemoryNetwork
from trainer.batch import Rollout
from trainer.config import TrainerConfig
from trainer.loss import (
    LOGP_FLOOR,
    behaviour_weights,
    policy_loss,
    sequence_ratio_sums,
    support_mask,
    weight_stats,
)
from trainer.metrics import GAUGE_KEYS
from trainer.monitors import monitor_from_config
from trainer.network import StepReport
from trainer.recipe import Trainer
from trainer.swarm_client import CoordinatorSource

torch.set_num_threads(1)


def _step_tokens(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[4, 8]`` log π_prox, log μ and the mask of a 32-token step (groups of 4 × 8 tokens):
    μ a little off π_prox (|log r| ≤ 0.2), every token inside both supports."""
    gen = torch.Generator().manual_seed(seed)
    prox = -0.2 - 3.0 * torch.rand((4, n // 4), generator=gen)
    mu = prox + 0.4 * (torch.rand((4, n // 4), generator=gen) - 0.5)
    return prox, mu, torch.ones_like(prox)


def _k3_mean(prox: list[float], mu: list[float]) -> float:
    """KL(μ‖π_prox) per token, k3 estimator, in float64 (the reference)."""
    terms = [math.exp(p - m) - 1.0 - (p - m) for p, m in zip(prox, mu, strict=True)]
    return sum(terms) / len(terms)


def _stats(prox: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, **kw: object):  # type: ignore[no-untyped-def]
    opts: dict[str, object] = {"cap": 2.0, "mode": "truncate", "level": "token"}
    opts.update(kw)
    bw = behaviour_weights(prox, mu, mask, torch.zeros(prox.shape[0]), **opts)  # type: ignore[arg-type]
    return bw, weight_stats(prox, mu, mask, bw, opts["level"])  # type: ignore[arg-type]


def test_the_1_84375_case_gives_the_mismatch_over_the_shared_tokens() -> None:
    prox, mu, mask = _step_tokens(0)
    prox[2, 5] = LOGP_FLOOR  # the trainer's top-p removed the node's token: π_prox = 0
    _, st = _stats(prox, mu, mask)
    assert (st.tokens, st.support_tokens, st.out_of_support) == (32.0, 31.0, 1.0)
    shared = [(p, m) for p, m in zip(prox.flatten().tolist(), mu.flatten().tolist(), strict=True)]
    shared = [pm for pm in shared if pm[0] > LOGP_FLOOR]
    expected = _k3_mean([p for p, _ in shared], [m for _, m in shared])
    # |log r| ≤ 0.2: each k3 term is ≤ 0.02 and float32's exp/log round it by ~1e-8 absolute,
    # over 31 terms ~3e-7 against a mean of ~3e-3 (rel 1e-4 leaves a factor 10)
    assert st.kl_sum / st.support_tokens == pytest.approx(expected, rel=1e-4)
    assert expected < 0.02  # and not 59/32 = 1.84375, what the clamp made of it
    k1 = sum(m - p for p, m in shared) / len(shared)
    assert st.kl_k1_sum / st.support_tokens == pytest.approx(k1, rel=1e-3, abs=1e-6)
    m2 = sum((p - m) ** 2 for p, m in shared) / len(shared)
    assert st.m2_sum / st.support_tokens == pytest.approx(m2, rel=1e-4)
    # the weight figures leave it out as well: 31 units, and it is not one of mask_frac's
    assert st.units == 31.0 and st.zeroed_tokens == 0.0


def test_a_step_with_every_token_supported_is_unchanged() -> None:
    prox, mu, mask = _step_tokens(1)
    bw, st = _stats(prox, mu, mask)
    assert (st.tokens, st.support_tokens, st.out_of_support) == (32.0, 32.0, 0.0)
    # the figure before the change, the same float32 operations on the same tokens: equal up to
    # the summation order (one float32 rounding of a sum of 32 terms ~1e-3: rel 1e-6)
    log_r = (prox - mu).clamp(-60.0, 60.0) * mask
    before = float(((log_r.exp() - 1.0 - log_r) * mask).sum()) / 32
    assert st.kl_sum / st.support_tokens == pytest.approx(before, rel=1e-6)
    expected = _k3_mean(prox.flatten().tolist(), mu.flatten().tolist())
    assert st.kl_sum / st.support_tokens == pytest.approx(expected, rel=1e-4)  # as above
    # and the weights are the ratios (truncated at 2; |log r| ≤ 0.2 never is)
    torch.testing.assert_close(bw.weights, (prox - mu).exp(), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject", "raw", "off"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_an_unsupported_token_gets_weight_0_and_leaves_its_sequence_alone(
    mode: str, level: str
) -> None:
    prox, mu, mask = _step_tokens(2)
    cut = prox.clone()
    cut[1, 3] = LOGP_FLOOR
    bw, _ = _stats(cut, mu, mask, mode=mode, level=level, cap=5.0)
    assert float(bw.weights[1, 3]) == 0.0 and float(bw.modified[1, 3]) == 0.0
    # every other token of row 1 has the weight it would have if that token were not there
    keep = [t for t in range(prox.shape[1]) if t != 3]
    alone, _ = _stats(
        prox[1:2, keep], mu[1:2, keep], mask[1:2, keep], mode=mode, level=level, cap=5.0
    )
    torch.testing.assert_close(bw.weights[1, keep], alone.weights[0], rtol=1e-6, atol=1e-7)
    # and the other rows are untouched
    full, _ = _stats(prox, mu, mask, mode=mode, level=level, cap=5.0)
    rows = [0, 2, 3]
    torch.testing.assert_close(bw.weights[rows], full.weights[rows], rtol=0.0, atol=0.0)


def test_an_unsupported_behaviour_logprob_is_outside_the_shared_support_too() -> None:
    prox, mu, mask = _step_tokens(3)
    mu[0, 0] = -math.inf  # a log μ no honest node sends; not NaN in any figure
    mask[3, 6:] = 0.0  # padding stays outside every count
    shared = support_mask(prox, mu, mask)
    assert float(shared.sum()) == 32 - 1 - 2 and float(shared[0, 0]) == 0.0
    bw, st = _stats(prox, mu, mask, level="sequence")
    assert (st.out_of_support, st.support_tokens, st.tokens) == (1.0, 29.0, 30.0)
    assert math.isfinite(st.kl_sum) and math.isfinite(st.w_sum)
    assert bool(torch.isfinite(bw.weights).all())


def test_the_sequence_ess_is_over_the_shared_tokens() -> None:
    prox, mu, mask = _step_tokens(4)
    cut = prox.clone()
    cut[0, 0] = LOGP_FLOOR
    w_sum, w_sq, n = sequence_ratio_sums(cut, mu, mask)
    ratios = [
        math.exp(
            sum(
                p - m
                for t, (p, m) in enumerate(zip(cut[i].tolist(), mu[i].tolist(), strict=True))
                if not (i == 0 and t == 0)
            )
        )
        for i in range(4)
    ]
    assert n == 4.0
    # |Σ log r| ≤ 0.8 per row: float32 rounding of 8 terms, rel 1e-5
    assert w_sum == pytest.approx(sum(ratios), rel=1e-5)
    assert w_sq == pytest.approx(sum(r * r for r in ratios), rel=1e-5)


def test_a_token_entering_the_support_mid_step_does_not_make_the_loss_nan() -> None:
    """π_θ may take into its support, after an update of the step, a token π_prox did not have:
    exp(log π_θ − LOGP_FLOOR) is inf, and inf times any weight (0 included) NaN."""
    prox, mu, mask = _step_tokens(5)
    prox[2, 4] = LOGP_FLOOR
    bw, _ = _stats(prox, mu, mask)
    logp_data = prox.clone() + 0.05
    logp_data[2, 4] = -4.0  # π_θ now has it
    logp = logp_data.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -0.5, 0.0])
    pl = policy_loss(logp, prox, adv, bw.weights, mask, eps=0.2, eps_high=0.28, normalizer=32.0)
    pl.loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert math.isfinite(float(pl.loss.detach())) and bool(torch.isfinite(logp.grad).all())
    assert float(logp.grad[2, 4]) == 0.0
    # the token adds nothing: the loss is that of the step with its weight (0) and mask off
    mask_off = mask.clone()
    mask_off[2, 4] = 0.0
    ref_logp = logp_data.clone()
    ref_logp[2, 4] = 0.0
    ref = policy_loss(
        ref_logp, torch.where(mask_off > 0, prox, 0.0), adv, bw.weights, mask_off,
        eps=0.2, eps_high=0.28, normalizer=32.0,
    )  # fmt: skip
    assert float(pl.loss.detach()) == pytest.approx(float(ref.loss), rel=1e-6)
    assert float(pl.clipped_tokens) == float(ref.clipped_tokens)


def test_the_figure_is_a_gauge_and_has_a_monitor() -> None:
    assert "out_of_support_frac" in GAUGE_KEYS
    mon = monitor_from_config(TrainerConfig(warn_window=1, warn_out_of_support_frac_above=0.01))
    assert mon.observe({"out_of_support_frac": 0.002}) == ""
    assert mon.observe({"out_of_support_frac": 0.05}) == "out_of_support_frac 0.05 > 0.01"


def _rollouts(seed: int, n_groups: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [1, *(rng.randrange(4, 26) for _ in range(rng.randint(1, 4))), 3]
        for _ in range(4):
            comp = [rng.randrange(4, 26) for _ in range(rng.randint(2, 6))]
            out.append(
                Rollout(
                    group_id=f"{seed}-{g}",
                    prompt_ids=prompt,
                    completion_ids=comp,
                    behaviour_logprobs=[-0.5 - 1.5 * rng.random() for _ in comp],
                    policy_version=0,
                    reward=rng.choice([0.0, 1.0]),
                )
            )
    return out


def test_the_step_record_reports_them_apart(tmp_path: Path) -> None:
    """A learner step under top-k 3 on completions the model would mostly not pick: the record's
    mismatch_kl is over the tokens inside the top 3 (the reference takes the top 3 of the
    model's own logits, not the trainer's processing), and out_of_support_* counts the rest."""
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=3, group_size=4, minibatches=1,
        resume=False, top_k=3,
    )  # fmt: skip
    tr = Trainer.setup(cfg)
    rollouts = _rollouts(7, 3)
    prox: list[float] = []
    mu: list[float] = []
    outside = total = 0
    for r, logps in zip(rollouts, _top3_logprobs(tr, rollouts), strict=True):
        for logp, behaviour in zip(logps, r.behaviour_logprobs, strict=True):
            total += 1
            if logp is None:
                outside += 1
                continue
            prox.append(logp)
            mu.append(behaviour)
    assert 0 < outside < total
    source = CoordinatorSource(InMemoryNetwork().endpoint("t"), "c", Identity.generate())
    tr.on_step.append(StepReport(source, progress=tr.progress, pending=tr.pending, kappa=1))
    record = tr.train_step(rollouts)
    # the coordinator gets it with the other figures (/status trainer_out_of_support_frac)
    assert source.stats["out_of_support_frac"] == record["out_of_support_frac"]
    assert record["completion_tokens"] == total
    assert record["out_of_support_tokens"] == outside
    assert record["out_of_support_frac"] == pytest.approx(outside / total, rel=1e-12)
    # |log r| up to ~2 here: float32 rounding of exp/log in the model's log-probs (~1e-6 rel)
    assert record["mismatch_kl"] == pytest.approx(_k3_mean(prox, mu), rel=1e-4)
    assert math.isfinite(record["ess_frac"]) and record["updates"] == 1


def _top3_logprobs(tr: Trainer, rollouts: list[Rollout]) -> list[list[float | None]]:
    """Per rollout, log p of each completion token under the model's top 3 (float64, from the
    model's own logits), None where the token is not among them."""
    out: list[list[float | None]] = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = tr.model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1].double()
            top = logits.topk(3, dim=-1)
            norm = torch.logsumexp(top.values, dim=-1)
            out.append(
                [
                    float(logits[t, tok] - norm[t]) if tok in top.indices[t].tolist() else None
                    for t, tok in enumerate(r.completion_ids)
                ]
            )
    return out


def test_step_kl_is_over_the_tokens_both_weights_support(tmp_path: Path) -> None:
    """A step at top-k 3 that takes tokens into (or out of) the model's top 3: step_kl (what
    target_step_kl and max_step_kl act on) is the k3 KL(π_prox‖π_new) over the tokens inside both
    top-3 sets; a token entering them was exp(60) ≈ 1e26 at the ±60 clamp, one leaving 59."""
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=3, group_size=4, minibatches=1,
        resume=False, top_k=3, target_step_kl=0.02, lr=0.05,
    )  # fmt: skip
    tr = Trainer.setup(cfg)
    rollouts = _rollouts(11, 3)
    before = _top3_logprobs(tr, rollouts)
    record = tr.train_step(rollouts)
    after = _top3_logprobs(tr, rollouts)
    pairs = [
        (b, a)
        for rb, ra in zip(before, after, strict=True)
        for b, a in zip(rb, ra, strict=True)
        if a is not None and b is not None
    ]
    moved = sum(
        (b is None) != (a is None)
        for rb, ra in zip(before, after, strict=True)
        for b, a in zip(rb, ra, strict=True)
    )
    assert moved > 0 and pairs  # the case: some tokens changed sides, others stayed inside
    expected = sum(math.exp(a - b) - 1.0 - (a - b) for b, a in pairs) / len(pairs)
    # float32 log-probs (~1e-6 rel) of a move of ~0.1–1 nat: rel 1e-3 is generous
    assert record["step_kl"] == pytest.approx(expected, rel=1e-3)
