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
    cfg = ReputationSection(strikes_to_ban=2, ban_base_s=60, ban_max_s=1000)
    rep = Reputation(Store(tmp_path / "s.sqlite"), cfg)
    t = 1000.0
    assert rep.strike(NODE, "bad_termination", "x", t) is None
    ban = rep.strike(NODE, "logprob_mismatch", "y", t + 1)
    assert ban is not None and ban.count == 1 and ban.until == pytest.approx(t + 61)
    assert rep.banned(NODE, t + 60) is not None and rep.banned(NODE, t + 62) is None
    # strikes were consumed by the ban: one more is not enough
    assert rep.strike(NODE, "bad_termination", "z", t + 70) is None
    # time alone never clears a strike (issue 34: a patient cheater waited a 1 h window out):
    # the strike of t + 70 still counts a day later
    ban2 = rep.strike(NODE, "bad_termination", "z", t + 86_400)
    assert ban2 is not None and ban2.count == 2 and ban2.until == pytest.approx(t + 86_400 + 120)
    assert rep.strikes(NODE) == {"bad_termination": 3, "logprob_mismatch": 1}
    t += 86_400 - 172  # the rest of the test as before, a day later
    # persisted: a fresh object on the same file sees the ban and the back-off level
    rep2 = Reputation(Store(tmp_path / "s.sqlite"), cfg)
    assert rep2.banned(NODE, t + 200) is not None
    rep2.strike(NODE, "a", "", t + 400)
    ban3 = rep2.strike(NODE, "a", "", t + 401)
    assert ban3 is not None and ban3.until == pytest.approx(t + 401 + 240)


def test_forgiven_strikes_and_the_ban_at_once(tmp_path: Path) -> None:
    cfg = ReputationSection(strikes_to_ban=2, ban_base_s=60, ban_max_s=1000)
    rep = Reputation(Store(tmp_path / "s.sqlite"), cfg)
    assert rep.strike(NODE, "logprob_mismatch", "x", 0.0) is None
    assert rep.forgive(NODE) == 1  # the node earned its floor rate back
    assert rep.strike(NODE, "logprob_mismatch", "y", 1.0) is None  # the forgiven one is gone
    ban = rep.ban_now(NODE, "logprob_mismatch", "max_abs=3 (limit 0.01)", 2.0)
    assert ban is not None and ban.until == 1002.0 and "far beyond" in ban.reason
    assert rep.ban_now(NODE, "logprob_mismatch", "again", 3.0) is None  # one in force
    assert rep.strikes(NODE) == {"logprob_mismatch": 3}
