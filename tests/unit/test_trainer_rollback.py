"""The step rollback (max_step_kl): step_kl measured independently, a step above it undone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trainer_recipe import _params, _trainer, make_rollouts

from trainer.batch import build_batch, group_rollouts
from trainer.loss import token_logprobs
from trainer.recipe import Trainer
from trainer.rollback import StepSnapshot, kl_k3_sums

torch.set_num_threads(1)


def test_kl_k3_sums_by_hand() -> None:
    # r = 0.5/0.25 = 2 → 2 − 1 − ln 2; r = 1 → 0; the padded token does not count
    new = torch.tensor([[math.log(0.5), math.log(0.3), 0.0]])
    prox = torch.tensor([[math.log(0.25), math.log(0.3), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k3, n = kl_k3_sums(new, prox, mask)
    assert k3 == pytest.approx(1.0 - math.log(2.0), rel=1e-6)
    assert n == 2.0


def _tiny_move(delta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """512 near-certain tokens (log-probs -1e-3 .. -1e-1) each moved by +-``delta`` nats, and the
    exact k3 sum: r − 1 − log r = x²/2 + x³/6 + ... for x = ±delta (float64 reference)."""
    g = torch.Generator().manual_seed(0)
    prox = -torch.logspace(-3, -1, 512, dtype=torch.float64)[None]
    x = delta * torch.where(torch.rand(prox.shape, generator=g, dtype=torch.float64) < 0.5, -1, 1)
    new, prox = (prox + x).float(), prox.float()
    moved = new.double() - prox.double()  # the fp32 log-ratios, exactly
    exact = float((torch.expm1(moved) - moved).sum())
    return new, prox, torch.ones_like(prox), exact


@pytest.mark.parametrize("delta", [1e-6, 1e-5, 1e-4])
def test_k3_of_a_tiny_move_is_its_true_value_not_rounding_noise(delta: float) -> None:
    # In fp32, exp(x) − 1 − x is off by up to 6e-8 a token with either sign: for 512 tokens moved
    # by 1e-5 it came out ~3e-6 (true 2.6e-8), and negative as often as not, so a step that
    # barely moved the policy read as noise (the KL-adaptive rate's "0 < step_kl" a coin flip).
    new, prox, mask, exact = _tiny_move(delta)
    k3, n = kl_k3_sums(new, prox, mask)
    assert n == 512.0
    assert exact > 0
    assert k3 == pytest.approx(exact, rel=1e-3)


def test_snapshot_restores_weights_and_adam_moments() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    params = list(model.parameters())
    first = StepSnapshot.take(model, opt)  # before any step: no optimizer state yet
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    after_one = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    snap = StepSnapshot.take(model, opt)
    model(torch.full((1, 3), 5.0)).sum().backward()
    opt.step()
    assert not torch.equal(params[0], after_one[0])
    snap.restore(model, opt)
    for p, w, m in zip(params, after_one, moments, strict=True):
        assert torch.equal(p, w) and torch.equal(opt.state[p]["exp_avg_sq"], m)
        assert float(opt.state[p]["step"]) == 1.0
    first.restore(model, opt)
    assert all(p not in opt.state for p in params)


def _logp(tr: Trainer, rollouts: list) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[type-arg]
    flat = [r for g in group_rollouts(rollouts) for r in g]
    batch = build_batch(
        flat, [0.0] * len(flat), [0] * len(flat), pad_token_id=tr.pad_token_id,
        eos_token_id=tr.stop_token_ids,
    )  # fmt: skip
    with torch.no_grad():
        out = tr.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.completion_ids.shape[1] + 1,
        )
    logp = token_logprobs(out.logits[:, :-1], batch.completion_ids)
    return logp, batch.completion_mask


def test_step_kl_is_the_policy_move_and_a_large_one_is_undone(tmp_path: Path) -> None:
    rollouts = make_rollouts(3, 4, 4, version=0)
    kept = _trainer(tmp_path / "a", max_step_kl=1e9, lr=0.05)
    before_logp, mask = _logp(kept, rollouts)
    rec = kept.train_step(rollouts)
    after_logp, _ = _logp(kept, rollouts)
    k3, n = kl_k3_sums(after_logp, before_logp, mask)
    assert rec["step_kl"] == pytest.approx(k3 / n, rel=1e-3, abs=1e-6)
    assert rec["step_kl"] > 0.01  # lr 0.05 moves the tiny model visibly
    assert rec["rolled_back"] is False and rec["rollbacks"] == 0

    undone = _trainer(tmp_path / "b", max_step_kl=rec["step_kl"] / 2, lr=0.05)
    before = _params(undone.model)
    rec_b = undone.train_step(rollouts)
    assert rec_b["rolled_back"] is True and rec_b["rollbacks"] == 1
    assert rec_b["step_kl"] == pytest.approx(rec["step_kl"], rel=1e-3)
    assert all(torch.equal(before[k], v) for k, v in undone.model.state_dict().items())
    assert all(not undone.optimizer.state.get(p) for p in undone.model.parameters())
    assert (undone.step, undone.version) == (1, 1)  # the batch is consumed, the version moves


def test_step_kl_is_not_measured_when_off(tmp_path: Path) -> None:
    # neither the rollback nor the KL-adaptive learning rate (both off by default) asks for it
    rec = _trainer(tmp_path, target_step_kl=None).train_step(make_rollouts(4, 4, 4, version=0))
    assert rec["step_kl"] is None and rec["rolled_back"] is False
