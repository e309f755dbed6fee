"""The learner's step period in the pipeline's own dynamics: a fluid model (docs/capacity.md,
"Step by step: the fluid model"). Pure functions, no I/O; used by :mod:`coordinator.capacity`.

The closed-form rule averages: a pool whose admissible supply covers B per step keeps the learner
busy. Step by step that is not enough, because each step may only train on the versions of its
last S + 1 and each version's rollouts arrive late and in one go:

* a version is the newest for as long as the step after it took — a learner that ran a step
  at full speed made a *thin* version (little time to generate on it, minus the nodes' loads),
  one that waited made a *fat* one; a later step that can only use that version starves, or
  cannot use all of it (a step takes B; the rest expires);
* with κ close to S, the step after a version has become too stale can only train on the next
  published one, whose first rollouts take T_bcast + d_i + g_i + o_i to arrive (the hand-over).

This module runs those dynamics deterministically with the rule's own measured inputs: node i
generates on the newest leasable version at μ_i·r_i·g_i/(g_i + o_i) rollouts/s, loses d_i when it
switches, and each result arrives g_i + o_i after its generation started; a version is leasable
T_bcast after the step that made it ends, every κ-th version is published; the learner starts
step k as soon as B rollouts of versions ≥ k − S are in (oldest version first), trains T_train,
and makes version k + 1 (its step times varying as the trainer reports: a short step outruns
the rollouts of the next). Discrete leases and the nodes' noise are left out. The mean step
period over the settled steps is the prediction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: steps simulated; the period is measured over the last ``MEASURED`` of them (more when the
#: step times vary: the mean over a sample of draws must settle)
STEPS, MEASURED = 96, 48
STEPS_VARYING, MEASURED_VARYING = 240, 200


@dataclass(frozen=True)
class Flow:
    """A node as the fluid model sees it: output rate while generating (q_i = μ_i·r_i·g_i/(g_i
    + o_i)), version-load delay d_i, and the delay from generation start to arrival g_i + o_i."""

    rate: float
    load_s: float
    delay_s: float


#: pools larger than this are merged into this many groups of similar lag (sums of rates,
#: rate-weighted lags): the model's cost grows with the flows, a re-plan must stay cheap
MAX_FLOWS = 64


def _grouped(flows: Sequence[Flow]) -> list[Flow]:
    if len(flows) <= MAX_FLOWS:
        return list(flows)
    ordered = sorted(flows, key=lambda f: f.load_s + f.delay_s)
    out = []
    for i in range(MAX_FLOWS):
        part = ordered[i * len(ordered) // MAX_FLOWS : (i + 1) * len(ordered) // MAX_FLOWS]
        rate = sum(f.rate for f in part)
        if rate <= 0:
            continue
        out.append(
            Flow(
                rate,
                sum(f.rate * f.load_s for f in part) / rate,
                sum(f.rate * f.delay_s for f in part) / rate,
            )
        )
    return out


def first_time_available(
    leasable: np.ndarray, q: np.ndarray, d: np.ndarray, lag: np.ndarray, need: float, ready: float
) -> float:
    """The first time t ≥ ``ready`` by which ``need`` rollouts of the versions made leasable at
    ``leasable`` (ascending; the last one is generated on until further notice) have arrived
    (``math.inf``: never). Flow i generates version v from leasable_v + d_i until the next
    version is leasable, at q_i, each result arriving g_i + o_i later, so the arrivals of (v, i)
    by t are q_i·clip(t − leasable_v − lag_i, 0, span_vi) with lag_i = d_i + g_i + o_i and
    span_vi = max(0, leasable_{v+1} − leasable_v − d_i): a sum of ramps, piecewise linear and
    non-decreasing in t. It is solved exactly on the sorted breakpoints (slope +q_i where a
    ramp starts, −q_i where it ends) instead of by bisection."""
    ends = np.append(leasable[1:], math.inf)
    span = np.maximum(0.0, (ends - leasable)[:, None] - d[None, :])  # versions × flows
    rise = leasable[:, None] + lag[None, :]  # where each ramp starts
    flat = rise + span  # where it ends (inf for the newest version)
    rates = np.broadcast_to(q[None, :], rise.shape)
    keep = span > 0
    t_ev = np.concatenate([rise[keep], flat[keep]])
    slope_ev = np.concatenate([rates[keep], -rates[keep]])
    finite = np.isfinite(t_ev)
    t_ev, slope_ev = t_ev[finite], slope_ev[finite]
    order = np.argsort(t_ev, kind="stable")
    t_ev, slope_ev = t_ev[order], slope_ev[order]
    # after event j the total is slope_j·t − offset_j (running sums of slopes and slope·time)
    slope = np.cumsum(slope_ev)
    offset = np.cumsum(slope_ev * t_ev)
    value = slope * t_ev - offset  # the total at each event time

    def total_at(t: float) -> float:
        j = int(np.searchsorted(t_ev, t, side="right")) - 1
        return 0.0 if j < 0 else float(slope[j] * t - offset[j])

    if total_at(ready) >= need:
        return ready
    later = np.nonzero((t_ev > ready) & (value >= need))[0]
    if len(later) == 0:  # the newest version's ramps go on: the last slope, if any
        if len(t_ev) == 0 or slope[-1] <= 0:
            return math.inf
        base_t = max(ready, float(t_ev[-1]))
        return base_t + (need - total_at(base_t)) / float(slope[-1])
    j = int(later[0])  # the total crosses ``need`` in (max(ready, t_{j-1}), t_j]
    lo = ready if j == 0 else max(ready, float(t_ev[j - 1]))
    rate = float(slope[j - 1]) if j > 0 else 0.0
    if rate <= 0:
        return float(t_ev[j])
    return min(float(t_ev[j]), lo + (need - total_at(lo)) / rate)


def fluid_period(
    flows: Sequence[Flow],
    *,
    batch: int,
    t_train: float,
    kappa: float,
    t_bcast: float,
    staleness_bound: int,
    t_train_cv: float = 0.0,
) -> float:
    """The learner's mean seconds per step in the fluid dynamics (module docstring);
    ``math.inf`` when the pool never delivers a batch. With ``t_train_cv`` > 0 the steps take
    T_train·(1 + √3·cv·u), u uniform in [−1, 1] from a fixed seed (the same sequence every
    call: the prediction is deterministic); the mean step is still T_train."""
    live = _grouped([f for f in flows if f.rate > 0 and math.isfinite(f.rate)])
    if not live:
        return math.inf
    q = np.array([f.rate for f in live])
    d = np.array([f.load_s for f in live])
    lag = np.array([f.load_s + f.delay_s for f in live])
    # published versions: their leasable times and what the learner consumed of each
    leasable: list[float] = [t_bcast]  # version 0, made at time 0
    published: list[int] = [0]
    consumed: list[float] = [0.0]

    def arrived(i: int, t: float) -> float:
        """Rollouts of published version ``published[i]`` that have arrived by ``t``."""
        start = leasable[i]
        end = leasable[i + 1] if i + 1 < len(leasable) else math.inf
        span = np.maximum(0.0, end - start - d)
        return float(np.sum(q * np.clip(t - start - lag, 0.0, span)))

    spread = math.sqrt(3.0) * min(max(0.0, t_train_cv), 0.5)  # at most ±87 %: steps stay > 0
    draws = random.Random(0)
    steps, measured = (STEPS_VARYING, MEASURED_VARYING) if spread > 0 else (STEPS, MEASURED)
    first = 0  # index of the oldest published version still admissible
    ready = 0.0  # when the learner can start its next step
    starts: list[float] = []
    for k in range(steps):
        while first < len(published) - 1 and published[first] < k - staleness_bound:
            first += 1
        if published[first] < k - staleness_bound:
            return math.inf  # nothing admissible left and nothing newer made
        start = first_time_available(
            np.asarray(leasable[first:]), q, d, lag, batch + sum(consumed[first:]), ready
        )
        if start - ready > 1e6 * t_train:
            return math.inf
        need = float(batch)
        for i in range(first, len(published)):  # oldest version first
            take = min(need, arrived(i, start) - consumed[i])
            consumed[i] += max(0.0, take)
            need -= max(0.0, take)
            if need <= 1e-9:
                break
        starts.append(start)
        ready = start + t_train * (1.0 + spread * (2.0 * draws.random() - 1.0))
        version = k + 1
        if math.floor(version / kappa) > math.floor((version - 1) / kappa):
            published.append(version)
            leasable.append(ready + t_bcast)
            consumed.append(0.0)
    return (starts[-1] - starts[-measured]) / (measured - 1)
