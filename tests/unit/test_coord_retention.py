"""Bounded storage (issue 35): consumed rollouts past the audit window leave the database, the
counts the status shows do not move, and the file stops growing once the window is full."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from coordinator.records import RolloutRow
from coordinator.retention import Retention
from coordinator.store import Store

# bench/storage.py by path (bench/ on sys.path would let bench/protocol.py shadow the package)
_spec = importlib.util.spec_from_file_location(
    "bench_storage", Path(__file__).resolve().parents[2] / "bench" / "storage.py"
)
assert _spec is not None and _spec.loader is not None
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
grow = _bench.grow


def _rows(t: float, n: int, first: int) -> list[RolloutRow]:
    return [
        RolloutRow(f"L{first + i}", first + i, 0, b"k" * 32, 1, f"p{first + i}", b"\x00" * 8,
                   b"\x01" * 64, b"\x02" * 64, "eos", 1.0, True, t, 1)
        for i in range(n)
    ]  # fmt: skip


def test_only_consumed_rollouts_past_the_window_are_pruned(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.insert_rollouts(_rows(100.0, 10, 0))  # seq 1..10, accepted at t = 100
    store.insert_rollouts(_rows(200.0, 10, 10))  # seq 11..20, accepted at t = 200
    now = [150.0]
    ret = Retention(store, lambda: now[0], retention_s=60.0, interval_s=10.0, batch=4)
    assert ret.tick() == 0  # no learner report yet: nothing is consumed
    store.set_meta("learner_cursor", "15")  # the learner consumed seq 1..15
    now[0] = 155.0
    assert ret.tick() == 0  # within interval_s of the last run
    now[0] = 170.0  # seq 1..10 are 70 s old, 11..15 consumed but only -30 s old
    assert [ret.tick() for _ in range(1)] == [4]  # a batch at a time
    now[0] = 180.0
    assert ret.tick() == 4
    now[0] = 190.0
    assert ret.tick() == 2
    now[0] = 300.0  # 11..20 now 100 s old, but 16..20 are not consumed
    assert ret.tick() == 4 and ret.tick() == 0
    now[0] = 310.0
    assert ret.tick() == 1
    left = [r.seq for r in store.rollouts_after(0, 100)]
    assert left == [16, 17, 18, 19, 20]
    assert store.rollout_count() == 20  # rollouts_accepted still counts the pruned ones
    assert ret.pruned == 15


def test_retention_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="retention_s"):
        Retention(Store(":memory:"), lambda: 0.0, retention_s=-1.0)


def test_the_database_stops_growing_after_the_window(tmp_path: Path) -> None:
    # bench/storage.py at a toy scale: 60 rollouts/s of 512 tokens for 4 simulated minutes, a
    # 30 s window, the learner 10 s behind. Without pruning the file grows by the same amount
    # every minute; with it, it stops once the window is full (freed pages are reused).
    pruned = grow(tmp_path / "a.sqlite", rate=60, tokens=512, seconds=240, retention_s=30.0,
                  lag_s=10.0, report_s=60)  # fmt: skip
    kept = grow(tmp_path / "b.sqlite", rate=60, tokens=512, seconds=240, retention_s=None,
                lag_s=10.0, report_s=60)  # fmt: skip
    sizes = [size for _, size, _ in pruned]
    assert max(sizes[1:]) <= 1.1 * sizes[1]  # flat from the second minute on
    assert all(rows <= 60 * 45 for _, _, rows in pruned)  # window + lag + a tick, no more
    grown = [size for _, size, _ in kept]
    assert grown[-1] > 3 * sizes[-1]  # what it would have been


def test_the_coordinator_prunes_with_its_configured_window(tmp_path: Path) -> None:
    """``rollout_retention_s`` sets the audit window of the coordinator's pruning (the default
    is a day); a negative window is refused with the key named."""
    from coord_harness import Harness
    from pydantic import ValidationError

    from coordinator.config import CoordinatorConfig
    from coordinator.retention import RETENTION_S

    assert Harness(tmp_path / "a").core.retention.retention_s == RETENTION_S
    h = Harness(tmp_path / "b", rollout_retention_s=60.0)
    assert h.core.retention.retention_s == 60.0
    h.store.insert_rollouts(_rows(h.clock(), 4, 0))
    h.store.set_meta("learner_cursor", "4")
    h.clock.advance(59.0)
    assert h.core.retention.prune(h.clock()) == 0
    h.clock.advance(2.0)
    assert h.core.retention.prune(h.clock()) == 4
    with pytest.raises(ValidationError, match="rollout_retention_s"):
        CoordinatorConfig.model_validate({"rollout_retention_s": -1.0})
