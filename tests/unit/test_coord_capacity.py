"""Capacity rule and cost-aware activation against hand-computed cases (docs/capacity.md).

The rule against measured behaviour is in test_capacity_measured.py."""

from __future__ import annotations

import math

import pytest

from coordinator.capacity import (
    NodeCapacity,
    Pipeline,
    admissible_fraction,
    handover_period,
    node_rate,
    plan_activation,
    predicted_idle,
    required_rate,
    step_period,
    supply,
)


def test_duty_cycle_and_version_loads_discount_a_node() -> None:
    pipe = Pipeline(batch=100, t_train=1.0, kappa=2)
    # g/(g+o) = 1/1.25: 100 rollouts/s while generating, 80 over whole lease cycles
    node = NodeCapacity("a", 100.0, lease_s=1.0, overhead_s=0.25)
    assert node_rate(node, pipe) == pytest.approx(80.0)
    # a load of 0.5 s per version, one version per κ·T = 2 s (> g + o + d = 1.75): 80 · 0.75
    loaded = NodeCapacity("a", 100.0, lease_s=1.0, overhead_s=0.25, load_s=0.5)
    assert node_rate(loaded, pipe) == pytest.approx(60.0)
    # a node whose lease cycle (3.5 s) outlasts the window switches once per lease: 80 · (1 − 2/3.5)
    slow = NodeCapacity("a", 100.0, lease_s=1.0, overhead_s=0.25, load_s=2.25)
    assert node_rate(slow, pipe) == pytest.approx(80.0 * (1 - 2.25 / 3.5))
    # reliability scales it all; the effective rate (no pipeline) is μ·r
    flaky = NodeCapacity("a", 100.0, reliability=0.5, lease_s=1.0, overhead_s=0.25)
    assert node_rate(flaky, pipe) == pytest.approx(40.0) and flaky.effective_rate == 50.0


def test_admissible_fraction_hand_computed() -> None:
    # S = 2, κ = 1, T_train = 1, T_bcast = 0.5; g + o = 1.25
    pipe = Pipeline(batch=100, t_train=1.0, kappa=1, t_bcast=0.5, staleness_bound=2)
    node = NodeCapacity("a", 100.0, lease_s=1.0, overhead_s=0.25)
    # at T = 1: deadline (S+1)·T − T_train = 2, latest start X = 2 − 0.5 − 1.25 = 0.25; the
    # window W = max(κ·T, g + o + d) = 1.25 (its lease cycle is longer than a version)
    assert admissible_fraction(node, pipe, 1.0) == pytest.approx(0.25 / 1.25)
    # the learner waiting (T = 2) gives results more time: X = 5 − 1.75 = 3.25 > W = 2 → all
    assert admissible_fraction(node, pipe, 2.0) == 1.0
    assert node_rate(node, pipe) == pytest.approx(80.0 * 0.2)
    # a load delay is age too: with d = 0.1 generation on a version starts 0.1 s late
    # (X − d)/(W − d) = 0.15/1.25, and the load costs d/W of the time: ρ = 80·(0.15/1.35)
    loads = NodeCapacity("b", 100.0, lease_s=1.0, overhead_s=0.25, load_s=0.1)
    assert admissible_fraction(loads, pipe, 1.0) == pytest.approx(0.15 / 1.25)
    assert node_rate(loads, pipe) == pytest.approx(80.0 * 0.15 / 1.35)
    # without S nothing is late
    assert admissible_fraction(node, Pipeline(100, 1.0, 1, 0.5), 1.0) == 1.0


def test_step_period_and_predicted_idle_hand_computed() -> None:
    # supply 80 < B/T_train = 100: T* = B / 80 = 1.25, idle 1 − 1/1.25 = 0.2
    pipe = Pipeline(batch=100, t_train=1.0, kappa=1)
    short = [NodeCapacity("a", 100.0, lease_s=1.0, overhead_s=0.25)]
    assert step_period(short, pipe) == pytest.approx(1.25)
    assert predicted_idle(short, pipe) == pytest.approx(0.2)
    # loads: ρ(T) = 100·(1 − 0.5/max(T, 1.5)); T·ρ(T) = B = 100 at T = 1.5: idle 1/3
    loads = [NodeCapacity("a", 100.0, lease_s=1.0, load_s=0.5)]
    assert step_period(loads, pipe) == pytest.approx(1.5)
    assert predicted_idle(loads, pipe) == pytest.approx(1 / 3)
    # staleness: S = 1, T_bcast = 0.5, g = 0.5: a(T) = (2T − 2)/T, T·ρ = 100·(2T − 2) = 50 at
    # T = 1.25; at full speed (T = 1) nothing would arrive in time
    stale_pipe = Pipeline(batch=50, t_train=1.0, kappa=1, t_bcast=0.5, staleness_bound=1)
    late = [NodeCapacity("a", 100.0, lease_s=0.5)]
    assert node_rate(late[0], stale_pipe) == 0.0
    assert step_period(late, stale_pipe) == pytest.approx(1.25)
    assert predicted_idle(late, stale_pipe) == pytest.approx(0.2)
    # enough supply: the learner never waits
    assert predicted_idle([NodeCapacity("a", 200.0)], pipe) == 0.0
    assert predicted_idle([], pipe) == 1.0 and math.isinf(step_period([], pipe))


def test_the_issue_example_has_no_pole() -> None:
    """T_train = 0.22 s, κ = 1, B = 256, T_bcast = 0.196 s, 834 rollouts/s: the old rule asked
    κB/(κT_train − T_bcast) ≈ 10,667 rollouts/s; the demand is B/T_train ≈ 1,164 and the pool
    gives 834, so the learner steps every 256/834 s: ~28% idle."""
    assert required_rate(256, 0.22) == pytest.approx(1163.64, abs=0.01)
    pipe = Pipeline(batch=256, t_train=0.22, kappa=1, t_bcast=0.196, staleness_bound=2)
    pool = [NodeCapacity("pool", 834.0)]
    assert step_period(pool, pipe) == pytest.approx(256 / 834)
    assert predicted_idle(pool, pipe) == pytest.approx(1 - 0.22 * 834 / 256)
    plan = plan_activation(pool, batch=256, t_train=0.22, kappa=1, t_bcast=0.196, staleness_bound=2)
    assert not plan.meets_rule and plan.pool_idle == pytest.approx(0.2833, abs=1e-3)
    assert "short of capacity" in plan.explanation and "idle 28%" in plan.explanation


def test_broadcast_longer_than_the_staleness_budget_slows_the_learner() -> None:
    # T_bcast = 5 s ≥ (S + 1)·T_train − T_train = 4 s: nothing arrives in time at full speed;
    # the learner slows until it does. Not a pole: a finite, predictable slowdown.
    nodes = [NodeCapacity("a", 1000.0, 1.0), NodeCapacity("b", 1000.0, 1.0)]
    plan = plan_activation(
        nodes, batch=256, t_train=1.0, kappa=3, t_bcast=5.0, staleness_bound=4, t_gen=0.0
    )
    assert not plan.meets_rule and plan.active == ("a", "b") and plan.standby == ()
    assert plan.available == 0.0 and plan.staleness_ok is False
    # on average: a(T) = (5T − 1 − 5)/(3T); T·Σρ = 2000·(5T − 6)/3 = 256 at T = 1.2768
    pipe = Pipeline(256, 1.0, 3, 5.0, 4)
    mean_period = (256 * 3 / 2000 + 6) / 5
    assert supply(nodes, pipe, mean_period) * mean_period == pytest.approx(256)
    # but the hand-over binds: the step after version u − 3 expires (u + 2) has only u, which
    # needs T_bcast + B/2000 = 5.128 s to deliver a batch, and comes (S − κ + 1)·T_train = 2 s
    # of training plus one wait w after u was made: w = 3.128 s per κ = 3 steps
    assert handover_period(nodes, pipe) == pytest.approx(1.0 + (5.0 + 256 / 2000 - 2.0) / 3)
    # the prediction (the fluid model, step by step) agrees with the hand-over bound
    assert plan.step_period == pytest.approx(handover_period(nodes, pipe), rel=0.03)
    assert plan.step_period > mean_period and 0.4 < plan.predicted_idle < 0.55


@pytest.mark.parametrize(
    ("lease_s", "load_s", "t_train"),
    [(math.inf, 0.0, 1.0), (1.0, math.nan, 1.0), (1.0, math.inf, 1.0), (0.5, 0.0, 5e-324)],
)
def test_peer_supplied_extremes_count_for_nothing_not_a_crash(
    lease_s: float, load_s: float, t_train: float
) -> None:
    """Figures come from peers and the trainer's report: a non-finite one makes a node deliver
    nothing (or a tiny T_train an impossible demand), never an exception."""
    node = NodeCapacity("a", 10.0, lease_s=lease_s, load_s=load_s)
    plan = plan_activation(
        [node], batch=8, t_train=t_train, kappa=1, t_bcast=0.5, staleness_bound=10
    )
    assert plan.active == ("a",) and not plan.meets_rule
    assert 0.0 <= plan.predicted_idle <= 1.0


def test_cheapest_set_is_not_the_greedy_one() -> None:
    # required = B / T_train = 10 rollouts/s, no headroom.
    nodes = [
        NodeCapacity("a", 6.0, 6.0),  # best price/rate (1.0): greedy takes it first
        NodeCapacity("b", 5.0, 5.5),  # 1.1
        NodeCapacity("c", 5.0, 5.5),  # 1.1
    ]
    kw = dict(batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.0)
    exact = plan_activation(nodes, **kw)  # type: ignore[arg-type]
    assert exact.active == ("b", "c") and exact.cost_per_hour == pytest.approx(11.0)
    assert exact.standby == ("a",) and exact.meets_rule and exact.predicted_idle == 0.0
    greedy = plan_activation(nodes, exact_limit=0, **kw)  # type: ignore[arg-type]
    assert greedy.active == ("a", "b") and greedy.cost_per_hour == pytest.approx(11.5)


def test_activation_prices_each_node_by_its_admissible_rate() -> None:
    # "fast" generates 4× faster but loses 80% of its time to version loads (d = 4 s per
    # κ·T = 5 s window): ρ = 20 < 24 needed. "steady" (ρ = 25) costs more per hour and is the
    # only one that suffices: the planner buys admissible rollouts, not generation speed.
    pipe_kw = dict(batch=24, t_train=1.0, kappa=5, t_bcast=0.0, headroom=0.0)
    fast = NodeCapacity("fast", 100.0, 1.0, lease_s=0.5, load_s=4.0)
    steady = NodeCapacity("steady", 25.0, 1.5, lease_s=0.5)
    plan = plan_activation([fast, steady], **pipe_kw)  # type: ignore[arg-type]
    assert node_rate(fast, Pipeline(24, 1.0, 5)) == pytest.approx(20.0)
    assert plan.active == ("steady",) and plan.active_rate == pytest.approx(25.0)
    assert plan.standby == ("fast",) and plan.cost_per_hour == pytest.approx(1.5)


def test_headroom_volunteers_and_reliability() -> None:
    nodes = [
        NodeCapacity("paid", 10.0, 2.0),
        NodeCapacity("v1", 4.0, None),  # no price: free volunteer
        NodeCapacity("v2", 8.0, None),
    ]
    # need 10 · 1.2 = 12: the two volunteers give exactly 12 for free
    plan = plan_activation(nodes, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.2)
    assert plan.active == ("v1", "v2") and plan.cost_per_hour == 0.0
    assert plan.standby == ("paid",) and plan.required == pytest.approx(10.0)
    # an unreliable volunteer (half its leases expire) only counts for half: 4 + 8·0.5 = 8 < 12,
    # so the paid node is activated too; free volunteers always stay active (no saving in standby)
    flaky = [nodes[0], NodeCapacity("v1", 4.0, None), NodeCapacity("v2", 8.0, None, 0.5)]
    plan = plan_activation(flaky, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.2)
    assert plan.active == ("paid", "v1", "v2") and plan.active_rate == pytest.approx(18.0)
    assert plan.cost_per_hour == pytest.approx(2.0)


def test_free_volunteers_never_on_standby() -> None:
    # paid alone suffices (400 ≥ 12), but dropping the free node saves nothing
    nodes = [NodeCapacity("free", 50.0, None), NodeCapacity("paid", 400.0, 1.0)]
    plan = plan_activation(nodes, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.2)
    assert plan.active == ("free",) and plan.standby == ("paid",)
    nodes = [NodeCapacity("free", 5.0, 0.0), NodeCapacity("paid", 400.0, 1.0)]
    plan = plan_activation(nodes, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.2)
    assert plan.active == ("free", "paid") and plan.cost_per_hour == pytest.approx(1.0)


def test_short_pool_activates_everyone_and_predicts_the_idle() -> None:
    # 3 rollouts/s against 100 needed: a step every 100/3 s, idle 1 − 3/100
    nodes = [NodeCapacity("a", 1.0, 1.0), NodeCapacity("b", 2.0, None)]
    plan = plan_activation(nodes, batch=100, t_train=1.0, kappa=1, t_bcast=0.0)
    assert not plan.meets_rule and plan.active == ("a", "b")
    assert "short of capacity" in plan.explanation
    assert plan.predicted_idle == pytest.approx(0.97) and plan.pool_idle == plan.predicted_idle


def test_greedy_prune_on_a_large_pool() -> None:
    # 14 nodes -> greedy. Cheap-per-rate big node first, then small ones; prune drops redundancy.
    nodes = [NodeCapacity(f"n{i:02d}", 1.0, 1.0) for i in range(13)]
    nodes.append(NodeCapacity("big", 9.0, 8.0))  # 0.89 per rollout/s: greedy's first pick
    plan = plan_activation(nodes, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.0)
    assert plan.meets_rule and plan.active_rate >= 10.0
    assert "big" in plan.active and len(plan.active) == 2  # big + one small node
    assert plan.cost_per_hour == pytest.approx(9.0)


def test_array_rates_equal_the_per_node_rule_exactly() -> None:
    # plan_activation reads the pool into arrays (_Pool) instead of calling node_rate node by node
    # (5 s per re-plan at 10,000 nodes): the figures must be the very same numbers, edge cases
    # (no lease figure, non-finite, zero rate, no load, loads longer than the window) included.
    import random

    from coordinator.capacity import _Pool

    rng = random.Random(3)
    nodes = [
        NodeCapacity(
            f"n{i}",
            rng.choice([0.0, rng.uniform(0.1, 50)]),
            rng.choice([None, 0.3, 2.0]),
            rng.uniform(0.5, 1.0),
            overhead_s=rng.choice([0.0, rng.uniform(0, 3), math.nan]),
            lease_s=rng.choice([None, 0.0, rng.uniform(0.1, 40), math.inf]),
            load_s=rng.choice([0.0, rng.uniform(0, 30)]),
        )
        for i in range(400)
    ]
    for s_bound in (None, 1, 4):
        pipe = Pipeline(256, 2.0, 2, 0.7, s_bound, t_gen=3.0)
        pool = _Pool(nodes, pipe)
        for period in (None, 2.0, 7.5):
            assert pool.rates(period).tolist() == [node_rate(n, pipe, period) for n in nodes]
            assert pool.supply(period) == supply(nodes, pipe, period)
            want = [admissible_fraction(n, pipe, period or 2.0) for n in nodes]
            assert pool.admissible(period).tolist() == want


def test_array_greedy_picks_the_same_nodes_as_the_per_node_greedy() -> None:
    # Above EXACT_LIMIT paid nodes plan_activation sorts with numpy (_greedy_arrays); the choice
    # must be _greedy's, ties in price/rate and in rate included (few distinct prices and rates).
    import random

    import numpy as np

    from coordinator.capacity import _greedy, _greedy_arrays

    rng = random.Random(7)
    for trial in range(30):
        nodes = [
            NodeCapacity(f"n{rng.randrange(10**6):06d}-{i}", rng.choice([0.0, 1.0, 2.0, 4.0]),
                         rng.choice([0.1, 0.2, 0.4]))
            for i in range(rng.randrange(13, 120))
        ]  # fmt: skip
        rates = {n.node_id: n.effective_rate for n in nodes}
        target = rng.uniform(0.0, 1.2) * sum(rates.values())
        at = np.arange(len(nodes))
        price = np.array([n.price for n in nodes])
        rate = np.array([rates[n.node_id] for n in nodes])
        assert _greedy_arrays(nodes, at, price, rate, target) == _greedy(nodes, rates, target), (
            trial
        )
