"""The active set and the learner's figures, built alone (no Coordinator): liveness flushed
before it reads, the plan from the live nodes' rows, standby for the pricier node, and κ as
observed from publications."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_harness import FakeClock, config
from prometheus_client import CollectorRegistry

from coordinator.activation import ActiveSet, LearnerFigures
from coordinator.liveness import HeartbeatSchedule, Liveness
from coordinator.store import NodeRecord, Store
from coordinator.throughput import ThroughputBook


def test_kappa_follows_the_observed_publication_pace_not_a_renumbering() -> None:
    figures = LearnerFigures(t_bcast_s=1.0, t_train_s=2.0, batch_rollouts=8, kappa=2)
    for version in (1, 4, 7):  # every 3 versions although the learner says κ = 2
        figures.published(version)
    # a running mean of equal steps: 3 up to the rounding of 0.7·3 + 0.3·3 (one ulp)
    assert figures.effective_kappa == pytest.approx(3.0, rel=1e-12)
    figures.published(10)
    figures.published(500)  # a restarted trainer renumbering: far beyond 8·κ, not a pace
    assert figures.published_kappa == pytest.approx(3.0, rel=1e-12)
    assert figures.last_published == 500
    figures.published(501)  # one step: the mean falls to 0.7·3 + 0.3·1, still above κ = 2
    assert figures.effective_kappa == pytest.approx(2.4, rel=1e-12)
    figures.published(502)
    figures.published(503)  # 2.4 -> 1.98 -> 1.686: below κ, so the learner's κ holds
    assert figures.published_kappa == pytest.approx(1.686, rel=1e-12)
    assert figures.effective_kappa == 2.0


def test_the_active_set_plans_over_live_rows_and_puts_the_pricier_node_on_standby(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    cfg = config(tmp_path, capacity={"activation": True, "batch_rollouts": 10, "t_train_s": 10.0})
    store = Store(tmp_path / "s.sqlite")
    liveness = Liveness(store, HeartbeatSchedule.from_config(cfg))
    active = ActiveSet(
        cfg, store=store, clock=clock, liveness=liveness, throughput=ThroughputBook(0.3),
        learner=LearnerFigures.from_config(cfg), registry=CollectorRegistry(),
    )  # fmt: skip
    old = clock() - 3600.0  # registered long ago, silent since
    cheap, dear = b"a" * 32, b"b" * 32
    for key, price in ((cheap, 1.0), (dear, 10.0)):
        store.upsert_node(
            NodeRecord(key, key.hex()[:8], None, old, old, 100.0, 50.0, price, "hf", "float32")
        )
    assert active.alive_nodes() == [] and active.is_active(dear)  # no plan yet: all active
    liveness.saw(cheap, clock())
    liveness.saw(dear, clock())  # held in memory until a read needs it
    assert [n.node_key for n in active.alive_nodes()] == [cheap, dear]
    plan = active.replan()
    assert list(plan.active) == [cheap.hex()] and list(plan.standby) == [dear.hex()]
    assert active.is_active(cheap) and not active.is_active(dear)
    assert active.planned_at == clock() and not active.replan_due()
    clock.advance(cfg.capacity.replan_interval_s)
    assert active.replan_due()
