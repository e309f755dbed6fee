"""The dashboard's history (coordinator.history): steps, ticks, rates, bounds, incremental reads."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.history import DecimatingBuffer, StatusHistory


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _status(accepted: int, **kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "rollouts_accepted": accepted,
        "rejected_by_reason": {"bad_signature": 2.0, "stale_version": 0.0},
        "policy_version": 3,
        "queue_depth": 7,
        "node_states": {"ed25519:a": "active", "ed25519:b": "active", "ed25519:c": "banned"},
        "plan_required_rollouts_per_s": 12.5,
        "plan_meets_rule": True,  # not a number: not kept
        "plan": "text",
    }
    doc.update(kw)
    return doc


def test_a_step_is_kept_once_with_every_number_of_its_report() -> None:
    h = StatusHistory(clock=Clock())
    report = {"step": 4, "reward_mean": 0.5, "exact_match": 0.25, "new_monitor": 3.0,
              "flag": True, "note": "x", "bad": float("nan"),
              "staleness_hist": {"0": 6, "1": 2}}  # fmt: skip
    assert h.record_trainer(report)
    assert not h.record_trainer(dict(report))  # the next fetch repeats the last step's report
    assert h.record_trainer({**report, "step": 5, "staleness_hist": {"1": 4, "2": 1}})
    assert not h.record_trainer({"reward_mean": 1.0})  # no step number
    assert not h.record_trainer({"step": True})
    doc = h.since()
    assert [r["step"] for r in doc["steps"]] == [4, 5]
    row = doc["steps"][0]
    assert row["reward_mean"] == 0.5 and row["new_monitor"] == 3.0  # whatever the trainer adds
    assert "flag" not in row and "note" not in row and "bad" not in row
    assert doc["staleness_hist"] == {"0": 6, "1": 6, "2": 1}  # summed over the steps, ordered


def test_ticks_measure_the_intake_rate_over_the_window() -> None:
    clock = Clock()
    h = StatusHistory(clock=clock, rate_window_s=10.0)
    for i in range(31):  # 100 rollouts a second for 30 s
        h.record_tick(_status(100 * i), {3: 2, 2: 1} if i else None)
        clock.t += 1.0
    ticks = h.since()["ticks"]
    assert ticks[0]["intake_per_s"] is None and ticks[0]["holders"] is None
    assert all(t["intake_per_s"] == pytest.approx(100.0) for t in ticks[1:])
    last = ticks[-1]
    assert last["rejected"] == {"bad_signature": 2.0}  # zero counts left out
    assert last["holders"] == {"3": 2, "2": 1} and last["version"] == 3
    assert last["nodes"] == {"active": 2, "banned": 1}
    assert last["plan_required_rollouts_per_s"] == 12.5 and "plan_meets_rule" not in last
    clock.t += 5.0  # intake stops: the rate falls within the window
    h.record_tick(_status(3000), None)
    assert h.since()["ticks"][-1]["intake_per_s"] < 100.0


def test_reads_are_incremental_and_restart_safe() -> None:
    h = StatusHistory(clock=Clock())
    h.record_tick(_status(1), None)
    h.record_trainer({"step": 1})
    first = h.since()
    assert first["full"] and len(first["ticks"]) == 1 and len(first["steps"]) == 1
    h.record_tick(_status(2), None)
    more = h.since(first["seq"], first["epoch"])
    assert not more["full"] and [t["accepted"] for t in more["ticks"]] == [2] and not more["steps"]
    assert h.since(more["seq"], more["epoch"])["ticks"] == []
    # another epoch (the coordinator restarted) or a seq from the future: start over
    assert h.since(more["seq"], "other")["full"]
    again = h.since(more["seq"] + 100, more["epoch"])
    assert again["full"] and len(again["ticks"]) == 2


def test_buffers_stay_bounded_and_keep_the_whole_run() -> None:
    buf = DecimatingBuffer(100)
    for i in range(1, 10_001):
        buf.append({"seq": i})
    seqs = [r["seq"] for r in buf.rows]
    assert len(seqs) <= 100
    assert seqs[0] == 1 and seqs[-1] == 10_000  # the start and the newest rows survive
    assert seqs == sorted(seqs)
    assert seqs[-20:] == list(range(9_981, 10_001))  # the recent end at full resolution
    assert [r["seq"] for r in buf.after(9_995)] == [9_996, 9_997, 9_998, 9_999, 10_000]
    with pytest.raises(ValueError):
        DecimatingBuffer(2)


def test_history_memory_is_bounded() -> None:
    clock = Clock()
    h = StatusHistory(max_steps=50, max_ticks=60, clock=clock)
    for i in range(5_000):
        h.record_trainer({"step": i, "reward_mean": 0.1})
        h.record_tick(_status(i), {i: 1})
        clock.t += 1
    doc = h.since()
    assert len(doc["steps"]) <= 50 and len(doc["ticks"]) <= 60
    assert doc["steps"][-1]["step"] == 4_999 and doc["steps"][0]["step"] == 0
