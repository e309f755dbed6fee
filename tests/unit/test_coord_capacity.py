"""Capacity rule and cost-aware activation against hand-computed cases (DESIGN.md §9)."""

from __future__ import annotations

import math

import pytest

from coordinator.capacity import (
    NodeCapacity,
    plan_activation,
    required_rate,
    staleness_feasible,
    staleness_lag,
)


def test_overlap_rule_hand_computed() -> None:
    # κ·B / (κ·T_train − T_bcast) = 3·256 / (3·1 − 0.5) = 307.2 rollouts/s
    assert required_rate(256, 1.0, 3, 0.5) == pytest.approx(307.2)
    assert required_rate(100, 2.0, 1, 0.0) == pytest.approx(50.0)


@pytest.mark.parametrize("t_bcast", [3.0, 4.5])
def test_infeasible_when_broadcast_eats_the_window(t_bcast: float) -> None:
    assert math.isinf(required_rate(256, 1.0, 3, t_bcast))  # T_bcast >= κ·T_train
    nodes = [NodeCapacity("a", 100.0, 1.0), NodeCapacity("b", 100.0, 1.0)]
    plan = plan_activation(nodes, batch=256, t_train=1.0, kappa=3, t_bcast=t_bcast)
    assert not plan.meets_rule and plan.active == ("a", "b") and plan.standby == ()
    assert "infeasible" in plan.explanation and "κ" in plan.explanation


def test_staleness_feasibility() -> None:
    # 3 + ⌈(0.5 + 1.2) / 1⌉ = 5
    assert staleness_lag(3, 0.5, 1.2, 1.0) == 5
    assert not staleness_feasible(3, 0.5, 1.2, 1.0, 4)
    assert staleness_feasible(3, 0.5, 1.2, 1.0, 5)
    assert staleness_lag(3, 0.4, 0.6, 1.0) == 4  # exactly one step: ⌈1.0⌉ = 1


@pytest.mark.parametrize(
    ("t_gen", "t_train"),
    [(16 / 5e-324, 1.0), (1.0, 5e-324), (math.inf, math.inf), (1.7976931348623157e308, 1e-10)],
)
def test_staleness_with_peer_supplied_extremes_is_infeasible_not_a_crash(
    t_gen: float, t_train: float
) -> None:
    """t_gen = G·L / tokens_per_s comes from a node's advert (5e-324 passes the schema) and
    T_train from the trainer's stats: an infinite lag is infeasible, not an OverflowError."""
    assert staleness_lag(1, 0.5, t_gen, t_train) == math.inf
    assert not staleness_feasible(1, 0.5, t_gen, t_train, 10)
    plan = plan_activation(
        [NodeCapacity("a", 1.0)], batch=8, t_train=t_train, kappa=1, t_bcast=0.5,
        staleness_bound=10, t_gen=t_gen,
    )  # fmt: skip
    assert plan.staleness_ok is False and plan.active == ("a",)


def test_cheapest_set_is_not_the_greedy_one() -> None:
    # required = 1·10 / (1·1 − 0) = 10 rollouts/s, no headroom.
    nodes = [
        NodeCapacity("a", 6.0, 6.0),  # best price/rate (1.0): greedy takes it first
        NodeCapacity("b", 5.0, 5.5),  # 1.1
        NodeCapacity("c", 5.0, 5.5),  # 1.1
    ]
    kw = dict(batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.0)
    exact = plan_activation(nodes, **kw)  # type: ignore[arg-type]
    assert exact.active == ("b", "c") and exact.cost_per_hour == pytest.approx(11.0)
    assert exact.standby == ("a",) and exact.meets_rule
    greedy = plan_activation(nodes, exact_limit=0, **kw)  # type: ignore[arg-type]
    assert greedy.active == ("a", "b") and greedy.cost_per_hour == pytest.approx(11.5)


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


def test_short_pool_activates_everyone() -> None:
    nodes = [NodeCapacity("a", 1.0, 1.0), NodeCapacity("b", 2.0, None)]
    plan = plan_activation(nodes, batch=100, t_train=1.0, kappa=1, t_bcast=0.0)
    assert not plan.meets_rule and plan.active == ("a", "b")
    assert "short of capacity" in plan.explanation


def test_greedy_prune_on_a_large_pool() -> None:
    # 14 nodes -> greedy. Cheap-per-rate big node first, then small ones; prune drops redundancy.
    nodes = [NodeCapacity(f"n{i:02d}", 1.0, 1.0) for i in range(13)]
    nodes.append(NodeCapacity("big", 9.0, 8.0))  # 0.89 per rollout/s: greedy's first pick
    plan = plan_activation(nodes, batch=10, t_train=1.0, kappa=1, t_bcast=0.0, headroom=0.0)
    assert plan.meets_rule and plan.active_rate >= 10.0
    assert "big" in plan.active and len(plan.active) == 2  # big + one small node
    assert plan.cost_per_hour == pytest.approx(9.0)
