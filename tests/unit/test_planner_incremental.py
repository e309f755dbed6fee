"""The planner's inputs kept in memory (coordinator/planner_inputs.py, issue 35): on random pools
and random event sequences the incremental re-plan chooses what a plan from the store's rows
chooses; each event that changes an input (a lease, a price, a departure, a ban, a write by
another connection) reaches the next re-plan; reused predictions never change the choice.

Float margins: the incremental path holds the nodes in its own order (slots), the store returns
them in rowid order, so sums of ≤ 300 rates may differ in their last bits (≤ 300 · 2⁻⁵³ ≈ 3e-14
relative): rates and prices are compared to 1e-9. The step-period predictions come out of
bisections to a relative 1e-9 whose inputs may differ by such a last bit, over ≤ 240 steps: 1e-6.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from coord_harness import FakeClock, config
from prometheus_client import CollectorRegistry

from coordinator.activation import ActiveSet, LearnerFigures
from coordinator.capacity import Plan
from coordinator.liveness import HeartbeatSchedule, Liveness
from coordinator.planner_inputs import Predictions
from coordinator.store import NodeRecord, Store
from coordinator.throughput import ThroughputBook


def _setup(tmp_path: Path, **capacity: object) -> tuple[ActiveSet, Store, FakeClock]:
    clock = FakeClock()
    cfg = config(tmp_path, capacity={"activation": True, "batch_rollouts": 64, "t_train_s": 10.0,
                                     **capacity})  # fmt: skip
    store = Store(tmp_path / "s.sqlite")
    active = ActiveSet(
        cfg, store=store, clock=clock, liveness=Liveness(store, HeartbeatSchedule.from_config(cfg)),
        throughput=ThroughputBook(0.3), learner=LearnerFigures.from_config(cfg),
        registry=CollectorRegistry(),
    )  # fmt: skip
    return active, store, clock


def _register(store: Store, clock: FakeClock, key: bytes, price: float | None, tps: float,
              rps: float | None) -> None:  # fmt: skip
    now = clock()
    store.upsert_node(NodeRecord(key, key.hex()[:8], None, now, now, tps, rps, price, "hf", "f"))


def _same(a: Plan, b: Plan, *, periods: bool = True) -> None:
    assert a.active == b.active and a.standby == b.standby
    assert a.meets_rule == b.meets_rule and a.staleness_ok == b.staleness_ok
    assert a.required == b.required
    for field in ("available", "active_rate", "cost_per_hour"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9, abs=1e-12), field
    if periods:
        for field in ("step_period", "predicted_idle", "pool_idle"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-6, abs=1e-9)


def _plans(active: ActiveSet) -> tuple[Plan, Plan]:
    incremental = active.replan()
    return incremental, active.plan_from_scratch()


@pytest.mark.parametrize("seed", [1, 2])
def test_incremental_replans_match_plans_from_the_store_on_random_event_sequences(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    active, store, clock = _setup(tmp_path, batch_rollouts=rng.choice([16, 64, 400]))
    book, seen = active.throughput, active.liveness
    other = Store(tmp_path / "s.sqlite")  # another connection (another process's writes)
    keys: list[bytes] = []
    for _ in range(rng.randrange(20, 60)):
        key = rng.randbytes(32)
        _register(store, clock, key, rng.choice([None, 0.0, 0.2, 0.5, 1.4]),
                  rng.uniform(200, 5000), rng.choice([None, 0.0, rng.uniform(0.1, 3)]))  # fmt: skip
        keys.append(key)
    reuse = Predictions(clock, min_nodes=0, max_age_s=1e9, tolerance=1e9)
    for step in range(20):
        for _ in range(rng.randrange(1, 12)):
            key = rng.choice(keys)
            event = rng.randrange(10)
            if event <= 3:  # a completed lease: figures and the count change
                gen = rng.uniform(2, 30)
                book.record(key, samples=16, version=rng.randrange(1, 4), generate_s=gen,
                            load_s=rng.uniform(0, 5), overhead_s=rng.uniform(0, 2),
                            observed_s=gen + rng.uniform(0, 8))  # fmt: skip
                store.bump_node(key, "leases_completed")
            elif event == 4:
                store.bump_node(key, "leases_expired")
            elif event == 5:  # a new price or speed (an advert)
                store.update_node(key, price_per_hour=rng.choice([None, 0.0, 0.3, 2.0]),
                                  tokens_per_s=rng.uniform(200, 5000))  # fmt: skip
            elif event == 6:  # a ban, or its end
                store.put_ban(key, 1, clock() + rng.choice([-1.0, 60.0]), "test")
            elif event == 7:  # departure: the row deleted, or a newcomer
                if rng.random() < 0.5:
                    store.delete_node(key)
                    book.forget(key)
                    keys.remove(key)
                new = rng.randbytes(32)
                _register(store, clock, new, rng.choice([0.2, 0.9]), 1000.0, rng.uniform(0.1, 2))
                keys.append(new)
            elif event == 8:  # another connection writes: the next re-plan reads every row
                other.update_node(key, price_per_hour=rng.choice([0.1, 3.0]))
            else:  # the durable rate, rewritten at registration
                store.update_node(key, rollouts_per_s=rng.uniform(0.1, 3))
        for key in keys:  # most nodes heartbeat; the others drift towards the horizon
            if rng.random() < 0.9:
                seen.saw(key, clock())
        clock.advance(rng.choice([1.0, 5.0, 12.0]))
        active.learner.batch_rollouts = rng.choice([16, 64, 400, 3000])
        if step % 5 == 0:  # the predictions made afresh on both sides (they cost: not always)
            active.predictions = Predictions(clock)
            incremental, scratch = _plans(active)
            _same(incremental, scratch)
        # the choice with the predictions reused (made once here; nothing else reads them)
        active.predictions = reuse
        _same(active.replan(), active.plan_from_scratch(period=lambda pool, which: 1.0),
              periods=False)  # fmt: skip
    other.close()
    assert reuse.made <= 2  # the pool's and the active set's, once


def test_each_event_that_changes_an_input_reaches_the_next_replan(tmp_path: Path) -> None:
    active, store, clock = _setup(tmp_path, batch_rollouts=10)
    cheap, mid, dear = b"a" * 32, b"b" * 32, b"c" * 32
    for key, price in ((cheap, 1.0), (mid, 2.0), (dear, 10.0)):
        _register(store, clock, key, price, 100.0, 50.0)
        active.liveness.saw(key, clock())

    def check(want_active: list[bytes]) -> Plan:
        incremental, scratch = _plans(active)
        _same(incremental, scratch)
        assert list(incremental.active) == [k.hex() for k in want_active]
        return incremental

    assert check([cheap]).meets_rule  # each node alone gives 50 · 1/2 ≫ B/T_train · 1.2
    store.update_node(cheap, price_per_hour=20.0)  # a price: the cheap node is now the dearest
    check([mid])
    store.put_ban(mid, 1, clock() + 600.0, "test")  # a ban
    check([dear])
    store.put_ban(mid, 1, clock() - 1.0, "test")  # the ban is over
    check([mid])
    clock.advance(10.0)  # mid falls silent past the 30 s horizon: it left
    for key in (cheap, dear):
        active.liveness.saw(key, clock())
    clock.advance(25.0)
    check([dear])
    store.delete_node(dear)  # deleted
    assert check([cheap]).meets_rule
    for _ in range(51):  # expired leases: reliability 1/53, 50/53 < 1.2: short
        store.bump_node(cheap, "leases_expired")
    assert not check([cheap]).meets_rule
    active.liveness.saw(mid, clock())  # mid is back
    assert check([mid]).meets_rule
    gen = 100.0  # a measured lease: 1 sample in 100 s, mid alone no longer meets the rule
    active.throughput.record(mid, samples=1, version=1, generate_s=gen, load_s=0.0,
                             overhead_s=0.0, observed_s=gen)  # fmt: skip
    plan = check([cheap, mid])
    assert not plan.meets_rule and plan.cost_per_hour == pytest.approx(22.0)
    other = Store(tmp_path / "s.sqlite")  # another process makes cheap free
    other.update_node(cheap, price_per_hour=0.0)
    other.close()
    assert check([cheap, mid]).cost_per_hour == pytest.approx(2.0)


def test_predictions_are_reused_within_the_tolerance_and_the_age_limit(tmp_path: Path) -> None:
    from coordinator.capacity import NodeCapacity, Pipeline, _period_of, _Pool

    clock = FakeClock()
    predict = Predictions(clock, min_nodes=2, max_age_s=60.0, tolerance=0.02)
    pipe = Pipeline(64, 10.0, 2, 1.0, 4, 3.0)
    nodes = [NodeCapacity(f"n{i}", 1.0 + i / 10, 0.5, lease_s=5.0, load_s=2.0) for i in range(8)]
    pool = _Pool(nodes, pipe)
    predict.next_plan()
    first = predict(pool, "pool")
    assert first == _period_of(pool) and predict.made == 1
    assert predict(pool, "pool") == first and predict.made == 1  # reused
    assert predict(pool, "active") == first and predict.made == 2  # each kind its own (new)
    slower = [NodeCapacity(n.node_id, n.rollouts_per_s * 0.99, 0.5, lease_s=5.0, load_s=2.0)
              for n in nodes]  # fmt: skip
    predict.next_plan()
    predict(_Pool(slower, pipe), "pool")  # 1 % less: within 2 %
    assert predict.made == 2
    slower = [NodeCapacity(n.node_id, n.rollouts_per_s * 0.9, 0.5, lease_s=5.0, load_s=2.0)
              for n in nodes]  # fmt: skip
    assert predict(_Pool(slower, pipe), "pool") == _period_of(_Pool(slower, pipe))
    assert predict.made == 3  # 10 % less: made afresh
    assert predict(_Pool(slower, pipe), "active") == first  # stale too, but one per re-plan
    assert predict.made == 3
    predict.next_plan()
    assert predict(_Pool(slower, pipe), "active") == _period_of(_Pool(slower, pipe))
    assert predict.made == 4  # the next re-plan makes it
    clock.advance(61.0)
    predict.next_plan()
    predict(_Pool(slower, pipe), "pool")
    assert predict.made == 5  # older than a minute
    predict(_Pool(slower, Pipeline(64, 10.0, 3, 1.0, 4, 3.0)), "pool")
    assert predict.made == 6  # κ changed: made whatever else this re-plan made
    predict(_Pool(slower[:1], pipe), "pool")
    assert predict.made == 7  # below min_nodes: always afresh
    clock.advance(121.0)
    predict.next_plan()
    predict(_Pool(slower, pipe), "pool")
    predict(_Pool(slower, pipe), "active")
    assert predict.made == 9  # the second one was two minutes old: made in the same re-plan
