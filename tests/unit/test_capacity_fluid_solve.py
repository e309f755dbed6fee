"""The fluid model's step start, solved exactly (coordinator.capacity_fluid.first_time_available)
against a bisection of the arrivals' direct sum, which is how the model found it before.

The arrivals of version v from flow i by time t are q_i·clip(t − leasable_v − lag_i, 0, span_vi):
a non-decreasing sum of ramps, so the first t ≥ ready with arrivals ≥ need is unique and a
bisection converges on it. The exact solve must land on the same t (to a relative 1e-7, far
looser than the bisection's own 1e-9 stopping width and far tighter than anything the planner
reads off a period), say ``ready`` when enough is already in, and say ``math.inf`` when the
ramps never reach ``need``."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.capacity_fluid import Flow, first_time_available, fluid_period


def arrivals(
    leasable: np.ndarray, q: np.ndarray, d: np.ndarray, lag: np.ndarray, t: float
) -> float:
    ends = np.append(leasable[1:], math.inf)
    span = np.maximum(0.0, (ends - leasable)[:, None] - d[None, :])
    got = np.clip(t - leasable[:, None] - lag[None, :], 0.0, span)
    return float(np.sum(q[None, :] * got))


def bisected(leasable: np.ndarray, q: np.ndarray, d: np.ndarray, lag: np.ndarray,
             need: float, ready: float) -> float:  # fmt: skip
    if arrivals(leasable, q, d, lag, ready) >= need:
        return ready
    lo, hi = ready, ready + 1.0
    while arrivals(leasable, q, d, lag, hi) < need:
        lo, hi = hi, hi + 2 * (hi - ready)
        if hi - ready > 1e9:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        if arrivals(leasable, q, d, lag, mid) >= need:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    return hi


pools = st.integers(min_value=1, max_value=12).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0.01, 50.0), min_size=n, max_size=n),  # q_i
        st.lists(st.floats(0.0, 30.0), min_size=n, max_size=n),  # d_i
        st.lists(st.floats(0.0, 60.0), min_size=n, max_size=n),  # g_i + o_i
    )
)
versions = st.lists(st.floats(0.1, 40.0), min_size=1, max_size=5)  # gaps between leasable times


@settings(max_examples=300, deadline=None)
@given(pools, versions, st.floats(0.0, 200.0), st.floats(1.0, 2000.0))
def test_the_exact_solve_lands_where_the_bisection_does(
    pool: tuple[list[float], list[float], list[float]],
    gaps: list[float],
    ready: float,
    need: float,
) -> None:
    q, d, delay = (np.array(x) for x in pool)
    lag = d + delay
    leasable = 5.0 + np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    got = first_time_available(leasable, q, d, lag, need, ready)
    want = bisected(leasable, q, d, lag, need, ready)
    assert got >= ready
    assert math.isclose(got, want, rel_tol=1e-7, abs_tol=1e-7), (got, want)
    # and what arrived by then is what was asked for (the crossing, not a point past it)
    assert arrivals(leasable, q, d, lag, got) >= need * (1 - 1e-9)


def test_enough_already_in_starts_at_ready() -> None:
    q, d, lag = np.array([2.0]), np.array([1.0]), np.array([3.0])
    leasable = np.array([0.0, 10.0])
    # v0 from 3 to 12 at 2/s: 18 by t = 12; v1 from 13 on
    assert first_time_available(leasable, q, d, lag, 10.0, 20.0) == 20.0
    assert math.isclose(first_time_available(leasable, q, d, lag, 10.0, 0.0), 8.0)
    # 18 from v0, then v1 adds 2/s from t = 13: 20 at t = 14
    assert math.isclose(first_time_available(leasable, q, d, lag, 20.0, 0.0), 14.0)


def test_a_version_nobody_generates_on_never_delivers() -> None:
    # one older version whose window is shorter than the load delay: its ramps have no span;
    # the newest version's ramp goes on, so any need is reached eventually
    q, d, lag = np.array([1.0]), np.array([5.0]), np.array([6.0])
    assert math.isinf(first_time_available(np.array([0.0]), np.array([0.0]), d, lag, 1.0, 0.0))
    assert math.isclose(first_time_available(np.array([0.0, 2.0]), q, d, lag, 1.0, 0.0), 9.0)


def test_a_pool_that_keeps_up_steps_at_t_train_and_a_slow_one_at_b_over_q() -> None:
    fast = [Flow(rate=100.0, load_s=0.5, delay_s=1.0)]

    def period(flows: list[Flow]) -> float:
        return fluid_period(flows, batch=32, t_train=10.0, kappa=1, t_bcast=1.0, staleness_bound=2)

    assert math.isclose(period(fast), 10.0, rel_tol=1e-9)
    slow = [Flow(rate=0.5, load_s=0.5, delay_s=1.0)]  # 5 rollouts per 10 s step, B = 32
    assert period(slow) >= 32 / 0.5 * (1 - 1e-9)  # at best B/q per step
