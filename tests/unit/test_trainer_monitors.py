"""Stability monitors (trainer/monitors.py): rolling means against bounds, one warning line."""

from __future__ import annotations

import logging

import pytest

from trainer.config import TrainerConfig
from trainer.monitors import Bound, GradSpikeGuard, StabilityMonitor, monitor_from_config


def test_warns_on_the_rolling_mean_not_on_one_noisy_step(caplog: pytest.LogCaptureFixture) -> None:
    mon = StabilityMonitor(
        [Bound("mismatch_kl", 0.5, above=True), Bound("ess_frac", 0.6, above=False)], window=3
    )
    caplog.set_level(logging.INFO, logger="trainer.monitors")
    # fewer than `window` steps: no verdict yet, even on a wild value
    assert mon.observe({"mismatch_kl": 3.0, "ess_frac": 1.0}) == ""
    assert mon.observe({"mismatch_kl": 0.0, "ess_frac": 1.0}) == ""
    # mean KL (3 + 0 + 0) / 3 = 1.0 > 0.5
    assert mon.observe({"mismatch_kl": 0.0, "ess_frac": 1.0}) == "mismatch_kl 1 > 0.5"
    assert sum("stability warning" in r.message for r in caplog.records) == 1
    # the spike leaves the window: KL mean 0.2; ESS mean (1 + 1 + 0.1) / 3 = 0.7 still ≥ 0.6
    assert mon.observe({"mismatch_kl": 0.6, "ess_frac": 0.1}) == ""
    assert any("cleared" in r.message for r in caplog.records)
    # ESS mean (1 + 0.1 + 0.1) / 3 = 0.4 < 0.6 and KL (0 + 0.6 + 0.8) / 3 = 0.47 is not > 0.5
    line = mon.observe({"mismatch_kl": 0.8, "ess_frac": 0.1})
    assert line == "ess_frac 0.4 < 0.6"
    # the same alarm again is not logged again
    n = sum("stability warning" in r.message for r in caplog.records)
    mon.observe({"mismatch_kl": 0.0, "ess_frac": 0.1})
    assert sum("stability warning" in r.message for r in caplog.records) == n


def test_missing_figures_and_disabled_bounds() -> None:
    mon = StabilityMonitor(
        [Bound("grad_norm", None, above=True), Bound("clip_frac", 0.1, above=True)], window=2
    )
    assert [b.figure for b in mon.bounds] == ["clip_frac"]
    # a record without the figure (e.g. grad_norm when max_grad_norm is None) is skipped
    assert mon.observe({"grad_norm": 100.0}) == ""
    assert mon.observe({"clip_frac": 0.3}) == ""
    assert mon.observe({"clip_frac": 0.3}) == "clip_frac 0.3 > 0.1"
    with pytest.raises(ValueError, match="window"):
        StabilityMonitor([], window=0)


def test_monitor_from_config_uses_the_warn_fields() -> None:
    cfg = TrainerConfig(warn_window=1, warn_mask_frac_above=0.2, warn_grad_norm_above=None)
    mon = monitor_from_config(cfg)
    assert mon.window == 1
    assert "mask_frac 0.5 > 0.2" in mon.observe({"mask_frac": 0.5})
    assert "grad_norm" not in mon.observe({"grad_norm": 1e9})


def test_grad_spike_guard_skips_outliers_after_warmup(caplog: pytest.LogCaptureFixture) -> None:
    guard = GradSpikeGuard(5.0, window=6, warmup=3)
    # no verdict during warm-up, however large the norm
    assert [guard.skip(x) for x in (100.0, 1.0, 1.0)] == [False, False, False]
    assert guard.skip(5.1) is True  # median(100, 1, 1) = 1: 5.1 > 5 × 1
    assert "skipped an update" in caplog.text
    # every norm enters the history: median(100, 1, 1, 5.1) = 3.05, and 15 < 5 × 3.05
    assert guard.skip(15.0) is False
    assert guard.skip(30.0) is True  # median(100, 1, 1, 5.1, 15) = 5.1: 30 > 25.5
    # a lasting higher level moves the median (window 6), and skipping stops
    for _ in range(3):
        guard.skip(20.0)
    assert guard.skip(50.0) is False  # median(5.1, 15, 30, 20, 20, 20) = 20
    assert GradSpikeGuard(None).skip(1e9) is False  # disabled
