"""Strikes and bans with growing back-off, persisted across a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import ReputationSection
from coordinator.reputation import Reputation, ban_duration
from coordinator.store import Store

NODE = b"n" * 32


def test_ban_duration_doubles_and_caps() -> None:
    assert [ban_duration(n, 60.0, 300.0) for n in (1, 2, 3, 4)] == [60.0, 120.0, 240.0, 300.0]
    with pytest.raises(ValueError):
        ban_duration(0, 60.0, 300.0)


def test_strikes_ban_with_growing_backoff(tmp_path: Path) -> None:
    cfg = ReputationSection(strikes_to_ban=2, ban_base_s=60, ban_max_s=1000, strike_window_s=100)
    rep = Reputation(Store(tmp_path / "s.sqlite"), cfg)
    t = 1000.0
    assert rep.strike(NODE, "bad_termination", "x", t) is None
    ban = rep.strike(NODE, "logprob_mismatch", "y", t + 1)
    assert ban is not None and ban.count == 1 and ban.until == pytest.approx(t + 61)
    assert rep.banned(NODE, t + 60) is not None and rep.banned(NODE, t + 62) is None
    # strikes were consumed by the ban: one more is not enough
    assert rep.strike(NODE, "bad_termination", "z", t + 70) is None
    # an old strike falls out of the window (t + 70 is more than 100 s before t + 171)
    assert rep.strike(NODE, "bad_termination", "z", t + 171) is None
    ban2 = rep.strike(NODE, "bad_termination", "z", t + 172)
    assert ban2 is not None and ban2.count == 2 and ban2.until == pytest.approx(t + 172 + 120)
    assert rep.strikes(NODE) == {"bad_termination": 4, "logprob_mismatch": 1}
    # persisted: a fresh object on the same file sees the ban and the back-off level
    rep2 = Reputation(Store(tmp_path / "s.sqlite"), cfg)
    assert rep2.banned(NODE, t + 200) is not None
    rep2.strike(NODE, "a", "", t + 400)
    ban3 = rep2.strike(NODE, "a", "", t + 401)
    assert ban3 is not None and ban3.until == pytest.approx(t + 401 + 240)
