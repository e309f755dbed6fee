"""The KL-adaptive learning rate (target_step_kl): the rule by hand, the trainer applying it, and
the factor surviving a restart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trainer_recipe import make_rollouts

from trainer.adaptive_lr import next_lr_factor
from trainer.config import TrainerConfig
from trainer.recipe import Trainer

torch.set_num_threads(1)


def test_the_rule_by_hand() -> None:
    # target 0.02: above 0.04 divide by 1.5, below 0.01 multiply, in between keep
    assert next_lr_factor(1.0, 0.05, 0.02) == pytest.approx(1 / 1.5)
    assert next_lr_factor(1.0, 0.005, 0.02, high=4.0) == pytest.approx(1.5)
    assert next_lr_factor(1.0, 0.03, 0.02) == 1.0
    assert next_lr_factor(1.0, 0.04, 0.02) == 1.0  # exactly 2x: not above
    assert next_lr_factor(0.5, 0.01, 0.02) == 0.5  # exactly half: not below
    assert next_lr_factor(2.0, 0.001, 0.02, change=2.0, high=4.0) == 4.0
    # clamped to [low, high]; by default never above the configured rate
    assert next_lr_factor(3.5, 0.001, 0.02, high=4.0) == 4.0
    assert next_lr_factor(0.06, 1.0, 0.02) == 0.05
    assert next_lr_factor(1.0, 0.001, 0.02) == 1.0
    assert next_lr_factor(0.5, 0.001, 0.02) == pytest.approx(0.75)  # recovers towards 1
    # a step that did not move the policy (step_kl = 0, or rounding just below it) is no reason
    # to raise the rate: rsl_rl raises only for 0 < KL < target/2
    assert next_lr_factor(0.5, 0.0, 0.02) == 0.5
    assert next_lr_factor(2.0, 0.0, 0.02, change=2.0, high=4.0) == 2.0
    assert next_lr_factor(1.0, -1e-9, 0.02, high=4.0) == 1.0
    assert next_lr_factor(1.0, 1e-12, 0.02, high=4.0) == pytest.approx(1.5)  # moved, a little
    # a step with no evidence (NaN) changes nothing
    assert next_lr_factor(0.7, math.nan, 0.02) == 0.7


@pytest.mark.parametrize(
    "kw",
    [dict(target=0.0), dict(change=1.0), dict(low=0.0), dict(low=2.0, high=1.0)],
)
def test_the_rule_refuses_settings_that_mean_nothing(kw: dict[str, float]) -> None:
    args = {"target": 0.02, "change": 1.5, "low": 0.05, "high": 4.0, **kw}
    with pytest.raises(ValueError, match="need target > 0"):
        next_lr_factor(1.0, 0.01, args.pop("target"), **args)


def test_config_bounds_are_checked_at_load() -> None:
    with pytest.raises(ValueError, match="target_step_kl"):
        TrainerConfig(target_step_kl=0.0)
    with pytest.raises(ValueError, match="adaptive_lr_max"):
        TrainerConfig(target_step_kl=0.02, adaptive_lr_max=0.5)


def _trainer(tmp_path: Path, **kw: object) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp_path / "run"), batch_prompts=4, group_size=4, minibatches=1, **kw
    )  # type: ignore[arg-type]
    return Trainer.setup(cfg)


def _lrs(tr: Trainer) -> list[float]:
    return [float(g["lr"]) for g in tr.optimizer.param_groups]


def test_a_step_that_moved_too_far_lowers_the_next_steps_learning_rate(tmp_path: Path) -> None:
    # lr 0.05 moves the tiny model by far more than 1e-4 nat/token: the factor falls by 1.5 a step
    tr = _trainer(tmp_path, lr=0.05, target_step_kl=1e-4, ess_lr_scaling=False)
    first = tr.train_step(make_rollouts(0, 4, 4, version=0))
    assert first["lr_factor"] == 1.0 and first["step_kl"] > 2e-4
    assert first["rolled_back"] is False and first["rollbacks"] == 0  # measured, not undone
    assert tr.lr_factor == pytest.approx(1 / 1.5)
    second = tr.train_step(make_rollouts(1, 4, 4, version=1))
    assert second["lr_factor"] == pytest.approx(1 / 1.5)
    assert _lrs(tr) == [pytest.approx(0.05 / 1.5)]  # the second step's updates used it
    assert tr.lr_factor == pytest.approx(1 / 1.5**2)


def test_the_factor_multiplies_vcpos_ess_step_size(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lr=0.05, target_step_kl=1e-4, ess_lr_scaling=True)
    tr.train_step(make_rollouts(0, 4, 4, version=0))
    # make_rollouts' behaviour log-probs are not the model's: the ESS factor is below 1
    rec = tr.train_step(make_rollouts(1, 4, 4, version=1))
    assert rec["lr_scale"] < 1.0 and rec["lr_factor"] == pytest.approx(1 / 1.5)
    assert _lrs(tr) == [pytest.approx(0.05 * rec["lr_factor"] * rec["lr_scale"], rel=1e-9)]


def test_a_step_far_below_the_target_raises_it_up_to_the_cap(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lr=1e-6, target_step_kl=10.0, adaptive_lr_max=2.0, ess_lr_scaling=False)
    for i in range(3):
        tr.train_step(make_rollouts(i, 4, 4, version=i))
    assert tr.lr_factor == 2.0  # 1 → 1.5 → 2 (capped) → 2
    assert _lrs(tr) == [pytest.approx(2e-6)]


def test_a_step_that_did_not_move_the_policy_leaves_the_rate(tmp_path: Path) -> None:
    # every reward equal: every advantage 0, and with no entropy bonus no gradient at all, so the
    # updates leave the weights as they are (step_kl = 0 exactly); the factor must not rise
    tr = _trainer(
        tmp_path, lr=0.05, target_step_kl=0.02, adaptive_lr_max=4.0, entropy_coef=0.0,
        ess_lr_scaling=False,
    )  # fmt: skip
    tr.lr_factor = 0.5
    for i in range(2):
        rec = tr.train_step(make_rollouts(i, 4, 4, version=i, equal_rewards=True))
        assert rec["updates"] == 1 and rec["step_kl"] == 0.0
    assert tr.lr_factor == 0.5


def test_by_default_never_above_the_configured_rate(tmp_path: Path) -> None:
    cfg = TrainerConfig()
    assert (cfg.target_step_kl, cfg.target_mismatch_kl, cfg.adaptive_lr_max) == (None, None, 1.0)
    tr = _trainer(tmp_path, lr=1e-7, target_step_kl=0.02, ess_lr_scaling=False)  # tiny moves
    for i in range(3):
        rec = tr.train_step(make_rollouts(i, 4, 4, version=i))
        assert rec["step_kl"] is not None and rec["step_kl"] < 0.01
        assert rec["lr_factor"] == 1.0
    assert _lrs(tr) == [1e-7]


def test_off_by_default_and_then_step_kl_is_not_measured(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lr=0.05, ess_lr_scaling=False)
    rec = tr.train_step(make_rollouts(0, 4, 4, version=0))
    assert rec["step_kl"] is None and rec["lr_factor"] == 1.0 and tr.lr_factor == 1.0
    assert _lrs(tr) == [0.05]


def test_the_factor_survives_a_restart(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, lr=0.05, target_step_kl=1e-4)
    tr.train_step(make_rollouts(0, 4, 4, version=0))
    factor = tr.lr_factor
    assert factor < 1.0
    tr.save_checkpoint()
    again = _trainer(tmp_path, lr=0.05, target_step_kl=1e-4)
    assert again.step == 1 and again.lr_factor == pytest.approx(factor)
    rec = again.train_step(make_rollouts(1, 4, 4, version=1))
    assert rec["lr_factor"] == pytest.approx(factor)


def test_the_mismatch_signal_needs_no_forward_pass_and_follows_mismatch_kl(
    tmp_path: Path,
) -> None:
    # make_rollouts' behaviour log-probs are far from the model's: mismatch KL well above 2e-3
    tr = _trainer(tmp_path, lr=0.05, target_mismatch_kl=1e-3, ess_lr_scaling=False)
    calls = {"n": 0}
    tr.model.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    rec = tr.train_step(make_rollouts(0, 4, 4, version=0))
    assert calls["n"] == 2  # π_prox and the update: no step_kl pass
    assert rec["step_kl"] is None and rec["mismatch_kl"] > 2e-3
    assert rec["lr_factor"] == 1.0 and tr.lr_factor == pytest.approx(1 / 1.5)
    tr.train_step(make_rollouts(1, 4, 4, version=1))
    assert _lrs(tr) == [pytest.approx(0.05 / 1.5)]


def test_one_signal_at_a_time() -> None:
    with pytest.raises(ValueError, match="target_step_kl and target_mismatch_kl both set"):
        TrainerConfig(target_step_kl=0.02, target_mismatch_kl=0.05)
    assert TrainerConfig(target_mismatch_kl=0.05).target_mismatch_kl == 0.05
