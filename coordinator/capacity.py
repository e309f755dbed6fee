"""Capacity model and cost-aware activation (docs/capacity.md). Pure functions, no I/O.

The model is the one this pipeline runs: leases name a version the coordinator already holds,
nodes keep generating while the next version travels (and prefetch it), and a rollout stays
usable until the learner is S versions past it. Symbols (docs/capacity.md has the derivation):

* B rollouts per learner step, T_train seconds per step (when it does not wait), κ steps between
  published versions, S the staleness bound, T_bcast seconds from a version's weights existing to
  the coordinator leasing it;
* per node i: μ_i rollouts per second *of generation*, r_i reliability, g_i generation seconds of
  one lease, o_i seconds per lease spent on round trips (not generating, not loading), d_i the
  node's own version-load delay (seconds it cannot generate when it switches to a new version),
  c_i price per hour.

With the learner stepping every T seconds, node i delivers admissible rollouts at

    ρ_i(T) = μ_i · r_i · g_i/(g_i + o_i) · (1 − d_i / W_i) · a_i(T)
    a_i(T) = clamp((X_i − d_i) / (W_i − d_i), 0, 1)
    W_i = max(κ·T, g_i + o_i + d_i),   X_i = (S + 1)·T − T_train − T_bcast − g_i − o_i

(a_i: the share of a node's generation on a version whose results arrive before the learner is
S versions past it; generation on a version starts d_i after it became leasable, the node
loading it first, so together ρ_i = μ_i·r_i·g_i/(g_i + o_i)·clamp(X_i − d_i, 0, W_i − d_i)/W_i).
The learner is busy when Σ ρ_i(T_train) ≥ B / T_train; otherwise it steps every T* > T_train
with T*·Σ ρ_i(T*) = B and its predicted idle fraction is 1 − T_train / T*.

Activation: the cheapest set meeting the rule with headroom (ρ_i at T = T_train); exact search
for pools of at most :data:`EXACT_LIMIT` paid nodes, otherwise greedy by c_i/ρ_i followed by a
prune. Nodes without a price are free volunteers (always active).

Public API (kept stable for ``swarm simulate`` and ``swarm coordinator plan``):
:class:`NodeCapacity`, :class:`Pipeline`, :class:`Plan`, :func:`node_rate`, :func:`supply`,
:func:`step_period`, :func:`predicted_idle`, :func:`required_rate`,
:func:`admissible_fraction`, :func:`choose_active`, :func:`plan_activation`,
:func:`verification_rule`, :func:`with_verification`; for the coordinator's in-memory inputs
(:mod:`coordinator.planner_inputs`) :func:`plan_pool` and :func:`capacity_columns`.

The verification rule (issue 35): the active nodes' re-scoring demand D = Σ_i rate_i·ρ_i·τ
(check rate, rollouts/s, re-scored tokens per rollout) within (1 − h)·V, V the verifiers'
measured throughput (:mod:`coordinator.verify_budget`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from coordinator.capacity_fluid import MAX_FLOWS, Flow, fluid_period

#: Pools up to this size are searched exhaustively (2^12 = 4096 subsets).
EXACT_LIMIT = 12
_EPS = 1e-12


@dataclass(frozen=True)
class NodeCapacity:
    """What the planner knows about one node."""

    node_id: str
    #: μ_i: rollouts (samples) per second of generation.
    rollouts_per_s: float
    #: c_i: price per hour; None = free volunteer (counts as 0).
    price_per_hour: float | None = None
    #: Fraction of leases the node completes in time, in [0, 1]; scales μ_i.
    reliability: float = 1.0
    #: o_i: seconds per lease the node spends on round trips (asking, submitting, the verdict).
    overhead_s: float = 0.0
    #: g_i: generation seconds of one of its leases; None = unknown (the plan's t_gen is used).
    lease_s: float | None = None
    #: d_i: seconds it cannot generate when it switches to a new version (its version-load delay).
    load_s: float = 0.0

    @property
    def price(self) -> float:
        return 0.0 if self.price_per_hour is None else self.price_per_hour

    @property
    def effective_rate(self) -> float:
        """μ_i · r_i: rollouts/s while generating, discounted by reliability (0 when the figure
        is not a finite number: it comes from a peer)."""
        rate, rel = self.rollouts_per_s, self.reliability
        if not (math.isfinite(rate) and math.isfinite(rel)):
            return 0.0
        return max(0.0, rate) * min(1.0, max(0.0, rel))


@dataclass(frozen=True)
class Pipeline:
    """The learner's side of the rule."""

    #: B: rollouts per learner step.
    batch: int
    #: T_train: seconds per learner step when it does not wait.
    t_train: float
    #: κ: learner steps between published versions (a mean may be fractional).
    kappa: float
    #: T_bcast: seconds from a version's weights existing to the coordinator leasing it.
    t_bcast: float = 0.0
    #: S: staleness bound; None = no admissibility check.
    staleness_bound: int | None = None
    #: generation seconds of one lease for nodes that do not know theirs (0 = negligible).
    t_gen: float = 0.0
    #: coefficient of variation of the learner's step time (0: every step takes T_train); the
    #: fluid model draws its steps from T_train·(1 ± √3·cv), uniform
    t_train_cv: float = 0.0

    def __post_init__(self) -> None:
        if self.batch <= 0 or not self.t_train > 0 or self.kappa <= 0 or not self.t_bcast >= 0:
            raise ValueError("Pipeline: batch, t_train, kappa must be > 0 and t_bcast >= 0")


def _lease_figures(node: NodeCapacity, pipe: Pipeline) -> tuple[float, float, float] | None:
    """(g_i, o_i, d_i) of ``node``, or None when one is not a finite number (a node that never
    finishes a lease or a load delivers nothing)."""
    g = node.lease_s if node.lease_s is not None and node.lease_s > 0 else pipe.t_gen
    o, d = node.overhead_s, node.load_s
    if not (math.isfinite(g) and math.isfinite(o) and math.isfinite(d)) or g < 0:
        return None
    return g, max(0.0, o), max(0.0, d)


def _window(pipe: Pipeline, period: float, g: float, o: float, d: float) -> float:
    """W_i: the stretch of time one version of a node's work covers — the κ·T seconds a version
    is the newest, or the node's own lease cycle with a load when that is longer (it then
    switches at most once per cycle)."""
    return max(pipe.kappa * period, g + o + d)


def admissible_fraction(node: NodeCapacity, pipe: Pipeline, period: float) -> float:
    """a_i(T): the share of a node's generation on a version whose results still arrive within
    S versions when the learner steps every ``period`` seconds (1 when S is not given).

    The node starts generating on a version d_i after the version became leasable at the
    earliest (it loads it first) and keeps generating on it until W_i; its generation starts
    spread evenly over [d_i, W_i], and a lease started at t arrives t + g_i + o_i later."""
    if pipe.staleness_bound is None:
        return 1.0
    figures = _lease_figures(node, pipe)
    if figures is None:
        return 0.0
    g, o, d = figures
    # A result of version u is used if it arrives before the learner, at version u + S, starts
    # training: (S + 1)·T − T_train after u was made (the step's wait for rollouts counts).
    deadline = (pipe.staleness_bound + 1) * period - pipe.t_train
    latest_start = deadline - pipe.t_bcast - g - o  # X_i: the last generation start in time
    span = _window(pipe, period, g, o, d) - d  # ≥ g + o
    if span <= 0:
        return 1.0 if latest_start >= d else 0.0
    return min(1.0, max(0.0, (latest_start - d) / span))


def node_rate(node: NodeCapacity, pipe: Pipeline, period: float | None = None) -> float:
    """ρ_i(T): admissible rollouts/s of ``node`` when the learner steps every ``period`` seconds
    (default T_train: the learner busy)."""
    period = pipe.t_train if period is None else period
    rate = node.effective_rate
    figures = _lease_figures(node, pipe)
    if rate <= 0 or figures is None:
        return 0.0
    g, o, d = figures
    duty = g / (g + o) if g + o > 0 else 1.0  # share of a lease cycle spent generating
    loading = d / _window(pipe, period, g, o, d) if d > 0 else 0.0
    return rate * duty * (1.0 - loading) * admissible_fraction(node, pipe, period)


def supply(nodes: Sequence[NodeCapacity], pipe: Pipeline, period: float | None = None) -> float:
    """Σ ρ_i(T): admissible rollouts/s of ``nodes``."""
    return sum(node_rate(n, pipe, period) for n in nodes)


def capacity_columns(nodes: Sequence[NodeCapacity]) -> np.ndarray:
    """One row per node: μ_i, r_i, g_i (NaN when unknown), o_i, d_i, c_i (0 when free)."""
    nan = math.nan
    # one pass over the objects (reading attributes is what costs at 10,000 nodes)
    return np.array(
        [
            (
                x.rollouts_per_s, x.reliability, nan if x.lease_s is None else x.lease_s,
                x.overhead_s, x.load_s, 0.0 if x.price_per_hour is None else x.price_per_hour,
            )
            for x in nodes
        ],
        dtype=float,
    ).reshape(len(nodes), 6)  # fmt: skip


def _node_of(node_id: str, row: Sequence[float]) -> NodeCapacity:
    """The NodeCapacity of one :func:`capacity_columns` row (an unknown g_i is None)."""
    rate, rel, lease, over, load, price = row
    return NodeCapacity(
        node_id, rate, price, rel, overhead_s=over, lease_s=None if math.isnan(lease) else lease,
        load_s=load,
    )  # fmt: skip


class _Pool:
    """The per-node inputs of ``nodes`` as arrays, read once: ρ_i(T) of every node for any period
    at numpy speed (a re-plan evaluates it ~50 times while it bisects the step period; node by
    node that cost 5 s at 10,000 nodes). Element by element the same arithmetic as
    :func:`node_rate` (IEEE operations in the same order, so the same figures); sums run in node
    order as :func:`supply`'s do."""

    def __init__(
        self,
        nodes: Sequence[NodeCapacity] | None,
        pipe: Pipeline,
        *,
        cols: np.ndarray | None = None,
        ids: Sequence[str] | None = None,
    ) -> None:
        """From ``nodes``, or from ``cols`` (one row per node: μ_i, r_i, g_i (NaN: unknown), o_i,
        d_i, c_i (0: free), the columns :func:`capacity_columns` gives) and their ``ids``
        (:mod:`coordinator.planner_inputs` keeps them in memory; no NodeCapacity objects)."""
        self.pipe = pipe
        self._nodes = nodes
        if cols is None:
            if nodes is None:
                raise ValueError("_Pool: give nodes or cols")
            cols = capacity_columns(nodes)
            ids = [x.node_id for x in nodes]
        elif ids is None or len(ids) != len(cols):
            raise ValueError("_Pool: cols need one id per row")
        n = len(cols)
        self.cols = cols
        self.ids: Sequence[str] = ids if ids is not None else []
        rate, rel = cols[:, 0], cols[:, 1]
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(rate) & np.isfinite(rel)
            eff = np.where(
                finite, np.maximum(0.0, rate) * np.minimum(1.0, np.maximum(0.0, rel)), 0.0
            )
        self.raw_eff = eff  # NodeCapacity.effective_rate of every node
        self.price = cols[:, 5]
        with np.errstate(invalid="ignore"):
            lease = np.where(cols[:, 2] > 0, cols[:, 2], pipe.t_gen)
        over, load = cols[:, 3], cols[:, 4]
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(lease) & np.isfinite(over) & np.isfinite(load) & (lease >= 0)
        self.fig_ok = ok
        self.ok = ok & (eff > 0)
        zero = np.zeros(n)
        self.g = np.where(ok, lease, zero)
        self.o = np.where(ok, np.maximum(0.0, np.where(ok, over, zero)), zero)
        self.d = np.where(ok, np.maximum(0.0, np.where(ok, load, zero)), zero)
        self.eff = np.where(self.ok, eff, zero)
        go = self.g + self.o
        with np.errstate(divide="ignore", invalid="ignore"):
            self.duty = np.where(go > 0, self.g / np.where(go > 0, go, 1.0), 1.0)
        self.cycle = go + self.d  # g + o + d

    @property
    def nodes(self) -> Sequence[NodeCapacity]:
        """The nodes (built from the columns, once, when the pool was made from them)."""
        if self._nodes is None:
            self._nodes = [self.node(i) for i in range(len(self.ids))]
        return self._nodes

    def node(self, i: int) -> NodeCapacity:
        """The ``i``-th node (built from its columns when the pool was made from them)."""
        if self._nodes is not None:
            return self._nodes[i]
        return _node_of(self.ids[i], self.cols[i].tolist())

    def subset(self, at: np.ndarray) -> _Pool:
        """The nodes at indices ``at``, in that order (the same figures, element by element, as
        a pool made from those nodes)."""
        nodes = self._nodes
        return _Pool(
            None if nodes is None else [nodes[i] for i in at.tolist()], self.pipe,
            cols=self.cols[at], ids=[self.ids[i] for i in at.tolist()],
        )  # fmt: skip

    def rates(self, period: float | None = None) -> np.ndarray:
        """ρ_i(period) of every node (T_train by default)."""
        pipe = self.pipe
        period = pipe.t_train if period is None else period
        window = np.maximum(pipe.kappa * period, self.cycle)
        with np.errstate(divide="ignore", invalid="ignore"):
            loading = np.where(self.d > 0, self.d / window, 0.0)
            out = self.eff * self.duty * (1.0 - loading) * self._admissible(period, window)
        return np.where(self.ok, out, 0.0)

    def admissible(self, period: float | None = None) -> np.ndarray:
        """a_i(period) of every node (:func:`admissible_fraction`; 0 where a figure is not a
        finite number)."""
        period = self.pipe.t_train if period is None else period
        window = np.maximum(self.pipe.kappa * period, self.cycle)
        if self.pipe.staleness_bound is None:
            return np.ones_like(window)
        return np.where(self.fig_ok, self._admissible(period, window), 0.0)

    def _admissible(self, period: float, window: np.ndarray) -> np.ndarray:
        pipe = self.pipe
        g, o, d = self.g, self.o, self.d
        if pipe.staleness_bound is None:
            return np.ones_like(g)
        deadline = (pipe.staleness_bound + 1) * period - pipe.t_train
        latest = deadline - pipe.t_bcast - g - o
        span = window - d
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.minimum(1.0, np.maximum(0.0, (latest - d) / np.where(span > 0, span, 1.0)))
        return np.where(span > 0, frac, np.where(latest >= d, 1.0, 0.0))

    def supply(self, period: float | None = None) -> float:
        """Σ ρ_i(period), summed in node order."""
        return float(sum(self.rates(period).tolist()))

    def flows(self) -> list[Flow]:
        """The fluid model's view of the nodes that deliver anything; more than
        :data:`~coordinator.capacity_fluid.MAX_FLOWS` merged here into that many groups of
        similar lag, as :func:`coordinator.capacity_fluid.fluid_period` would (by lag, stable;
        sums of rates, rate-weighted lags), without a Flow object per node."""
        q = self.eff * self.duty
        go = self.g + self.o
        with np.errstate(invalid="ignore"):
            live = np.nonzero(self.ok & (q > 0) & np.isfinite(q))[0]
        if len(live) <= MAX_FLOWS:
            return [Flow(float(q[i]), float(self.d[i]), float(go[i])) for i in live.tolist()]
        order = live[np.argsort((self.d + go)[live], kind="stable")]
        n = len(order)
        out = []
        for i in range(MAX_FLOWS):
            part = order[i * n // MAX_FLOWS : (i + 1) * n // MAX_FLOWS]
            rate = float(q[part].sum())
            if rate <= 0:
                continue
            load = float((q[part] * self.d[part]).sum()) / rate
            out.append(Flow(rate, load, float((q[part] * go[part]).sum()) / rate))
        return out


def required_rate(batch: int, t_train: float) -> float:
    """B / T_train: rollouts/s that keep the learner busy."""
    if batch <= 0 or not t_train > 0:
        raise ValueError("required_rate: batch and t_train must be > 0")
    return batch / t_train


def handover_supply(
    nodes: Sequence[NodeCapacity], pipe: Pipeline, period: float, t: float
) -> float:
    """Rollouts of a published version u and the later ones that have reached the coordinator
    ``t`` seconds after u was made, with the learner stepping every ``period`` seconds: node i
    generates version u + jκ from jκ·T + T_bcast + d_i (it loads it first) until the next one is
    leasable, (j + 1)κ·T + T_bcast, at μ_i·r_i·g_i/(g_i + o_i), each result arriving g_i + o_i
    after its generation started."""
    window = pipe.kappa * period
    total = 0.0
    for node in nodes:
        figures = _lease_figures(node, pipe)
        rate = node.effective_rate
        if figures is None or rate <= 0:
            continue
        g, o, d = figures
        q = rate * (g / (g + o) if g + o > 0 else 1.0)
        lag = pipe.t_bcast + d + g + o
        span = max(0.0, window - d)
        j = 0
        while j * window + lag < t:
            total += q * min(span, t - j * window - lag)
            j += 1
    return total


def handover_period(nodes: Sequence[NodeCapacity], pipe: Pipeline) -> float:
    """T_h: the learner's seconds per step as the *hand-over* of versions allows (T_train when
    it costs nothing; docs/capacity.md, "The hand-over").

    A published version u − κ is too stale from step u − κ + S + 1 on, and that step can train
    only on version u and later ones; it comes S − κ + 1 steps after the step that made u. So
    each version's first B rollouts must be in by then, whatever the pool delivers on average:
    oldest-first service does not help (the older version's surplus expires, u's rollouts are
    not there yet). The learner runs its steps at T_train and waits w before each hand-over
    step (one every κ steps); of those waits, n_w = ⌊(S − κ + 1)/κ⌋ + 1 fall between u being
    made and its hand-over step, so (S − κ + 1)·T_train + n_w·w = τ, with τ the time the
    swarm takes to deliver B rollouts of u and later versions (:func:`handover_supply`), and
    T_h = T_train + w/κ. For κ = 1 this is the rule's own staleness cut; it bites when κ is
    close to S (the default κ = S − 1)."""
    s, kappa, t_train = pipe.staleness_bound, pipe.kappa, pipe.t_train
    if s is None:
        return t_train
    steps = max(0.0, s - kappa + 1)
    waits = math.floor(steps / kappa) + 1
    period = t_train
    for _ in range(4):  # later versions are made every κ·T_h: settle T_h (a few rounds suffice)
        tau = _first_batch_s(nodes, pipe, period)
        if math.isinf(tau):
            return math.inf
        period = t_train + max(0.0, (tau - steps * t_train) / waits) / kappa
    return period


def _first_batch_s(nodes: Sequence[NodeCapacity], pipe: Pipeline, period: float) -> float:
    """τ: the first time :func:`handover_supply` reaches B (``math.inf`` if never)."""
    if handover_supply(nodes, pipe, period, 0.0) >= pipe.batch:
        return 0.0
    start = max(period, pipe.t_train)
    return _least(
        lambda w: handover_supply(nodes, pipe, period, w) >= pipe.batch,
        0.0, start, limit=1e6 * start, rounds=60,
    )  # fmt: skip


def _least(
    ok: Callable[[float], bool], lo: float, hi: float, *, limit: float, rounds: int
) -> float:
    """The smallest x in (lo, ∞) with ``ok(x)`` (``ok`` monotone): double ``hi`` until it holds
    (``math.inf`` past ``limit``), then bisect to a relative 1e-9 in at most ``rounds`` halvings."""
    while not ok(hi):
        lo, hi = hi, 2 * hi
        if hi > limit:
            return math.inf
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def step_period(nodes: Sequence[NodeCapacity], pipe: Pipeline) -> float:
    """T*: the learner's predicted seconds per step with ``nodes`` (T_train when they keep up;
    ``math.inf`` when they deliver no admissible rollout at any pace).

    The closed forms give two bounds: the period at which the pool's admissible supply covers B
    per step (:func:`_supply_period`) and the one the hand-over of versions allows
    (:func:`handover_period`). With S given, the prediction is the fluid model's period
    (:mod:`coordinator.capacity_fluid`: the same inputs, run step by step), which also sees
    thin and fat versions; never below the supply bound."""
    return _period_of(_Pool(nodes, pipe))


def _period_of(pool: _Pool) -> float:
    """:func:`step_period` of a pool already read into arrays."""
    pipe = pool.pipe
    period = _supply_period((), pipe, pool)
    if math.isinf(period) or pipe.staleness_bound is None:
        return period
    flows = pool.flows()
    fluid = fluid_period(
        flows,
        batch=pipe.batch,
        t_train=pipe.t_train,
        kappa=pipe.kappa,
        t_bcast=pipe.t_bcast,
        staleness_bound=pipe.staleness_bound,
        t_train_cv=pipe.t_train_cv,
    )
    return max(period, fluid)


def _supply_period(
    nodes: Sequence[NodeCapacity], pipe: Pipeline, pool: _Pool | None = None
) -> float:
    """The smallest T ≥ T_train with T·Σρ_i(T) ≥ B."""
    pool = pool if pool is not None else _Pool(nodes, pipe)
    if pool.supply() * pipe.t_train >= pipe.batch * (1 - 1e-9):
        return pipe.t_train
    # T · Σρ(T) grows with T (slower steps: fewer switches, fresher results): bracket, bisect.
    return _least(
        lambda t: pool.supply(t) * t >= pipe.batch,
        pipe.t_train, 2 * pipe.t_train, limit=pipe.t_train * 2**60, rounds=100,
    )  # fmt: skip


def predicted_idle(nodes: Sequence[NodeCapacity], pipe: Pipeline) -> float:
    """1 − T_train / T*: the learner's predicted idle fraction with ``nodes``."""
    period = step_period(nodes, pipe)
    return 1.0 if math.isinf(period) else max(0.0, 1.0 - pipe.t_train / period)


@dataclass(frozen=True)
class Plan:
    """Result of :func:`plan_activation`."""

    #: B / T_train: admissible rollouts/s that keep the learner busy (before headroom).
    required: float
    #: Σρ_i(T_train) of the whole pool.
    available: float
    #: Σρ_i(T_train) of the active set.
    active_rate: float
    active: tuple[str, ...]
    standby: tuple[str, ...]
    #: Total price per hour of the active set.
    cost_per_hour: float
    #: True when the active set meets the rule with headroom.
    meets_rule: bool
    #: True when every active node's results all arrive within S at T_train (None: S not given);
    #: informative only: the late share is already left out of each node's rate.
    staleness_ok: bool | None
    explanation: str
    #: Predicted learner idle fraction with the active set, and with the whole pool.
    predicted_idle: float = 0.0
    pool_idle: float = 0.0
    #: Predicted seconds per learner step with the active set.
    step_period: float = 0.0
    #: The verification rule D <= (1 − h)·V (:func:`with_verification`): D the re-scoring
    #: demand of the active set and V the verifiers' throughput (re-scored tokens/s; None:
    #: unknown), and whether it holds (None: V unknown)
    verify_demand: float | None = None
    verify_capacity: float | None = None
    verify_meets: bool | None = None


def verification_rule(demand: float, capacity: float | None, headroom: float) -> bool | None:
    """D <= (1 − h)·V: the verifiers keep up with the check rates of the active nodes with
    ``headroom`` h to spare; None when V is unknown."""
    if capacity is None:
        return None
    return demand <= (1.0 - headroom) * capacity + _EPS * max(1.0, capacity)


def with_verification(plan: Plan, demand: float, capacity: float | None, headroom: float) -> Plan:
    """``plan`` with the verification rule beside the learner's: its figures, and a clause in
    the explanation (the active set is the learner's choice; the rule is what admission keeps,
    :mod:`coordinator.verify_budget`)."""
    meets = verification_rule(demand, capacity, headroom)
    if capacity is None:
        clause = f"; verification: demand {demand:.3g} re-scored tokens/s, verifiers not measured"
    else:
        state = "within" if meets else "OVER"
        clause = (
            f"; verification: demand {demand:.3g} re-scored tokens/s {state} (1 − {headroom:.0%})"
            f" × V {capacity:.3g}"
        )
    return replace(
        plan, verify_demand=demand, verify_capacity=capacity, verify_meets=meets,
        explanation=plan.explanation + clause,
    )  # fmt: skip


def _meets(rate: float, target: float) -> bool:
    if not math.isfinite(target):  # an impossible demand (a T_train of 5e-324 s) is never met
        return False
    return rate + _EPS * max(1.0, target) >= target


def _exact(
    nodes: Sequence[NodeCapacity], rates: dict[str, float], target: float
) -> tuple[NodeCapacity, ...] | None:
    best: tuple[tuple[float, int, float, tuple[str, ...]], tuple[NodeCapacity, ...]] | None = None
    for r in range(len(nodes) + 1):
        for combo in itertools.combinations(nodes, r):
            rate = sum(rates[n.node_id] for n in combo)
            if not _meets(rate, target):
                continue
            key = (sum(n.price for n in combo), r, -rate, tuple(n.node_id for n in combo))
            if best is None or key < best[0]:
                best = (key, combo)
    return None if best is None else best[1]


def _greedy(
    nodes: Sequence[NodeCapacity], rates: dict[str, float], target: float
) -> tuple[NodeCapacity, ...] | None:
    usable = [n for n in nodes if rates[n.node_id] > 0]
    order = sorted(usable, key=lambda n: (n.price / rates[n.node_id], -rates[n.node_id], n.node_id))
    chosen: list[NodeCapacity] = []
    rate = 0.0
    for node in order:
        if _meets(rate, target):
            break
        chosen.append(node)
        rate += rates[node.node_id]
    if not _meets(rate, target):
        return None
    # Prune: drop the most expensive members (then the slowest) while the rule still holds
    # (a set, not list.remove: thousands of members at 10,000 nodes).
    dropped: set[int] = set()
    for i, node in sorted(
        enumerate(chosen), key=lambda x: (-x[1].price, rates[x[1].node_id], x[1].node_id)
    ):
        if _meets(rate - rates[node.node_id], target):
            dropped.add(i)
            rate -= rates[node.node_id]
    return tuple(n for i, n in enumerate(chosen) if i not in dropped)


def _greedy_arrays(
    nodes: Sequence[NodeCapacity],
    at: np.ndarray,
    price: np.ndarray,
    rate: np.ndarray,
    target: float,
) -> tuple[NodeCapacity, ...] | None:
    """:func:`_greedy` over the nodes at indices ``at``, with numpy (:func:`_greedy_at`)."""
    rank = np.argsort(np.argsort(np.array([n.node_id for n in nodes]), kind="stable"))
    picked = _greedy_at(rank, at, price, rate, target)
    return None if picked is None else tuple(nodes[i] for i in picked.tolist())


def _greedy_at(
    rank: np.ndarray, at: np.ndarray, price: np.ndarray, rate: np.ndarray, target: float
) -> np.ndarray | None:
    """:func:`_greedy` over the nodes at indices ``at`` (``rank``: each node's place in id
    order), with numpy: the same keys and so the same order (price/rate, then −rate, then id;
    the prune by −price, rate, id), the running sum a cumulative sum (the same additions in the
    same order). Returns the picked indices in the order :func:`_greedy` returns them."""
    usable = at[rate[at] > 0]
    if len(usable) == 0:
        return None if not _meets(0.0, target) else usable
    order = usable[np.lexsort((rank[usable], -rate[usable], price[usable] / rate[usable]))]
    if not math.isfinite(target):
        return None
    # _meets(x, target) is x + eps >= target; x the sum of the first j picks (0 for j = 0)
    eps = _EPS * max(1.0, target)
    prefix = np.concatenate(([0.0], np.cumsum(rate[order])))
    enough = np.nonzero(prefix + eps >= target)[0]
    if len(enough) == 0:
        return None
    k = int(enough[0])
    chosen = order[:k]
    total = float(prefix[k])
    # Prune: drop the most expensive members (then the slowest) while the rule still holds.
    keep = np.ones(k, dtype=bool)
    pos = np.lexsort((rank[chosen], rate[chosen], -price[chosen]))
    for j, r in zip(pos.tolist(), rate[chosen][pos].tolist(), strict=True):
        if total - r + eps >= target:
            keep[j] = False
            total -= r
    out: np.ndarray = chosen[keep]
    return out


def choose_active(
    nodes: Sequence[NodeCapacity],
    target: float,
    *,
    exact_limit: int = EXACT_LIMIT,
    rates: dict[str, float] | None = None,
) -> tuple[NodeCapacity, ...] | None:
    """Cheapest subset whose rate (``rates[id]``, default each node's ``effective_rate``) reaches
    ``target``; None when all nodes together fall short."""
    rates = rates if rates is not None else {n.node_id: n.effective_rate for n in nodes}
    if len(nodes) <= exact_limit:
        return _exact(nodes, rates, target)
    return _greedy(nodes, rates, target)


#: (pool, which) -> the step period of ``pool`` (:func:`_period_of`); ``which`` is "pool" (every
#: node) or "active" (the chosen set). :class:`coordinator.planner_inputs.Predictions` reuses them.
PeriodFn = Callable[["_Pool", str], float]


def _fresh_period(pool: _Pool, which: str) -> float:
    return _period_of(pool)


def plan_activation(
    nodes: Sequence[NodeCapacity],
    *,
    batch: int,
    t_train: float,
    kappa: float,
    t_bcast: float,
    headroom: float = 0.2,
    staleness_bound: int | None = None,
    t_gen: float | None = None,
    t_train_cv: float = 0.0,
    exact_limit: int = EXACT_LIMIT,
) -> Plan:
    """Choose the active set: the cheapest nodes whose admissible rate at T_train meets
    B / T_train with ``headroom``; predict the learner's idle fraction with it and with all.

    ``t_gen`` is the generation time of one lease for nodes whose ``lease_s`` is unknown."""
    pipe = Pipeline(batch, t_train, kappa, t_bcast, staleness_bound, t_gen or 0.0, t_train_cv)
    return plan_pool(_Pool(nodes, pipe), headroom=headroom, exact_limit=exact_limit)


def plan_pool(
    pool: _Pool,
    *,
    headroom: float = 0.2,
    exact_limit: int = EXACT_LIMIT,
    rank: np.ndarray | None = None,
    period: PeriodFn = _fresh_period,
) -> Plan:
    """:func:`plan_activation` of a pool already read into arrays. ``rank`` (each node's place
    in id order) and ``period`` (the step-period predictions, informative only: the choice never
    reads them) let :mod:`coordinator.planner_inputs` reuse what has not changed."""
    pipe = pool.pipe
    batch, t_train = pipe.batch, pipe.t_train
    ids = pool.ids
    n = len(ids)
    if rank is None:
        rank = np.argsort(np.argsort(np.array(ids, dtype=str), kind="stable"))
    by_id = np.argsort(rank)  # node indices in id order
    rates = pool.rates()
    rate_list = rates.tolist()
    available = sum(rate_list)
    required = required_rate(batch, t_train)
    target = required * (1.0 + headroom)
    pool_period = period(pool, "pool")
    pool_idle = 1.0 if math.isinf(pool_period) else max(0.0, 1.0 - t_train / pool_period)
    # Free volunteers (price 0 or unpriced) are always active: standing one down saves nothing and
    # only adds staleness. The paid nodes cover what the free ones leave of the target.
    is_free = (pool.price <= 0.0) & (pool.raw_eff > 0)
    free_at = np.nonzero(is_free)[0]
    paid_at = np.nonzero(~is_free)[0]
    residual = target - sum(rates[free_at].tolist())
    picked: np.ndarray | None
    if _meets(0.0, residual):
        picked = paid_at[:0]
    elif len(paid_at) <= exact_limit:
        paid = [pool.node(i) for i in paid_at.tolist()]
        exact = _exact(paid, dict(zip(ids, rate_list, strict=True)), residual)
        at = {id(x): i for x, i in zip(paid, paid_at.tolist(), strict=True)}
        picked = None if exact is None else np.array([at[id(x)] for x in exact], dtype=np.intp)
    else:
        picked = _greedy_at(rank, paid_at, pool.price, rates, residual)
    method = "exact search" if len(paid_at) <= exact_limit else "greedy by price/rate + prune"
    if picked is None:
        chosen = np.arange(n)
        meets = False
        why = (
            f"short of capacity: need {target:.3g} admissible rollouts/s (B/T_train "
            f"{required:.3g} + {headroom:.0%} headroom), the whole pool gives {available:.3g}; "
            f"all nodes active, predicted learner idle {pool_idle:.0%}"
        )
    else:
        chosen = np.concatenate((free_at, picked))
        meets = True
        why = ""
    mask = np.zeros(n, dtype=bool)
    mask[chosen] = True
    in_order = mask[by_id]
    id_list = [ids[i] for i in by_id.tolist()]
    active = tuple(itertools.compress(id_list, in_order.tolist()))
    standby = tuple(itertools.compress(id_list, (~in_order).tolist()))
    rate = sum(rates[chosen].tolist())
    step = pool_period if picked is None else period(pool.subset(chosen), "active")
    idle = 1.0 if math.isinf(step) else max(0.0, 1.0 - t_train / step)
    late_mask = pool.admissible()[chosen] < 1.0
    staleness_ok = None
    if pipe.staleness_bound is not None:
        staleness_ok = not bool(late_mask.any())
    cost = sum(pool.price[chosen].tolist())
    if meets:
        late = int(late_mask.sum())
        note = (
            f"; {late} active node(s) deliver some results more than S versions late "
            "(only the rest is counted)"
            if late
            else ""
        )
        why = (
            f"need {target:.3g} admissible rollouts/s (B/T_train {required:.3g} + "
            f"{headroom:.0%} headroom); {len(active)} of {n} nodes active give "
            f"{rate:.3g} at {cost:.3g}/h ({method}); {len(standby)} on standby; predicted "
            f"learner idle {idle:.0%}{note}"
        )
    return Plan(
        required=required,
        available=available,
        active_rate=rate,
        active=active,
        standby=standby,
        cost_per_hour=cost,
        meets_rule=meets,
        staleness_ok=staleness_ok,
        explanation=why,
        predicted_idle=idle,
        pool_idle=pool_idle,
        step_period=step,
    )
