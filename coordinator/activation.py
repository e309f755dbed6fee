"""The active set: who is alive, what each node can do, the plan.

:class:`ActiveSet` owns the current :class:`~coordinator.capacity.Plan` and the standby set. It
receives what it reads: the store (live nodes' rows), the injected clock, the
:class:`~coordinator.liveness.Liveness` buffer (flushed before it reads ``last_seen``), the
:class:`~coordinator.throughput.ThroughputBook` (measured figures) and the
:class:`LearnerFigures` (B, T_train and its variability, κ, T_bcast) that the network service
updates. :meth:`ActiveSet.replan` hands the planner (:func:`coordinator.capacity.plan_activation`,
docs/capacity.md) those inputs and keeps the resulting plan, with the verification rule of the
:class:`~coordinator.verify_budget.VerificationBudget` beside the learner's when it has one;
:meth:`ActiveSet.is_active` is what a lease request consults.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from coordinator.capacity import (
    NodeCapacity,
    PeriodFn,
    Pipeline,
    Plan,
    _Pool,
    plan_activation,
    plan_pool,
    with_verification,
)
from coordinator.config import CoordinatorConfig
from coordinator.liveness import Liveness
from coordinator.planner_inputs import PlannerInputs, Predictions
from coordinator.store import NodeRecord, Store
from coordinator.throughput import NodeFigures, ThroughputBook
from coordinator.verify_budget import PlannerRow, VerificationBudget

#: Seconds a learner's "blocked for rollouts" report stands (it fetches every ~2 s while blocked)
WANTING_FRESH_S = 10.0


@dataclass
class LearnerFigures:
    """The learner's figures the capacity rule reads (configured until the trainer reports its
    own; the service and the simulation write them)."""

    #: T_bcast: weights ready at the trainer -> leases name them (seconds)
    t_bcast_s: float
    #: T_train: seconds per learner step
    t_train_s: float
    #: B: rollouts consumed per learner step
    batch_rollouts: int
    #: κ: learner steps between published versions
    kappa: int
    #: the variability of the learner's step time (coefficient of variation), as reported
    t_train_cv: float = 0.0
    #: versions per publication as observed (a trainer whose publication outlasts κ steps
    #: publishes less often: the window a version is the newest grows); running mean
    published_kappa: float | None = None
    #: the last version published (for :meth:`published`)
    last_published: int | None = None
    #: the learner's own staleness bound, as reported (None: not reported, the coordinator's S)
    max_staleness: int | None = None
    #: rollouts the learner said it is blocked waiting for (``rollouts_wanted``), when it said
    #: so (the coordinator's clock), and the seq it had fetched up to then
    wanting: int = 0
    wanting_at: float | None = None
    fetched_after: int = 0

    def wanting_now(self, now: float) -> int:
        """The rollouts the learner is blocked for now: its last report, if it is recent (a
        blocked learner fetches every few seconds; an older report is from one that went away)."""
        if self.wanting_at is None or now - self.wanting_at > WANTING_FRESH_S:
            return 0
        return self.wanting

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> LearnerFigures:
        cap = config.capacity
        return cls(cap.t_bcast_s, cap.t_train_s, cap.batch_rollouts, config.kappa)

    def published(self, version: int) -> None:
        """A version was published: fold its step from the previous one into ``published_kappa``."""
        step = version - (self.last_published or 0)
        # a jump far beyond κ is a restarted trainer renumbering, not its publication pace
        if self.last_published is not None and 0 < step <= 8 * self.kappa:
            old = self.published_kappa
            self.published_kappa = step if old is None else 0.7 * old + 0.3 * step
        self.last_published = version

    @property
    def effective_kappa(self) -> float:
        """κ of the rule: the learner's, or the observed versions per publication if larger."""
        return max(float(self.kappa), self.published_kappa or 0.0)


class ActiveSet:
    """Liveness queries and activation (module docstring)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        store: Store,
        clock: Callable[[], float],
        liveness: Liveness,
        throughput: ThroughputBook,
        learner: LearnerFigures,
        registry: CollectorRegistry,
        verification: VerificationBudget | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.liveness = liveness
        self.throughput = throughput
        self.learner = learner
        #: the verification budget whose demand each re-plan recomputes (None: no such rule)
        self.verification = verification
        self.plan: Plan | None = None
        #: when the plan was made (clock seconds; -inf: never)
        self.planned_at = -math.inf
        self._standby: frozenset[str] = frozenset()
        #: the planner's inputs in memory and its reused predictions: soft state, rebuilt
        #: after a restart
        self.inputs = PlannerInputs(store, throughput)
        self.predictions = Predictions(clock)
        self._g_active = Gauge("swarm_nodes_active", "Nodes in the active set", registry=registry)

    def horizon(self, now: float) -> float:
        """Nodes last seen before this are not alive (:meth:`Liveness.horizon`)."""
        return self.liveness.horizon(now)

    def alive_nodes(self) -> list[NodeRecord]:
        """Registered, heard from within the heartbeat horizon, not banned (one query; the
        adverts are not loaded)."""
        self.liveness.flush()
        now = self.clock()
        return self.store.live_nodes(self.horizon(now), now)

    def node_capacity(self, node: NodeRecord) -> NodeCapacity | None:
        """What the planner knows of ``node``: its lease-by-lease figures (generation rate, lease
        time, round-trip overhead, version-load delay); before any, the durable end-to-end rate;
        None when it has not completed a lease yet."""
        fig = self.throughput.get(node.node_key)
        return _capacity(
            node.node_key, fig, node.price_per_hour, node.rollouts_per_s, node.reliability
        )

    def _pipeline(self, t_gen: float) -> Pipeline:
        figures = self.learner
        return Pipeline(
            figures.batch_rollouts, figures.t_train_s, figures.effective_kappa,
            figures.t_bcast_s, self.config.staleness_bound, t_gen, figures.t_train_cv,
        )  # fmt: skip

    def replan(self) -> Plan:
        """Recompute the active set (call when nodes join/leave or their μ changes).

        The inputs come from :class:`~coordinator.planner_inputs.PlannerInputs` (in memory,
        updated by the writes that change them); the step-period predictions of a large pool
        are reused for up to a minute (:class:`~coordinator.planner_inputs.Predictions`). The
        plan is :meth:`plan_from_scratch`'s (tests/unit/test_planner_incremental.py)."""
        self.liveness.flush()
        now = self.clock()
        inputs = self.inputs
        live = inputs.refresh(self.horizon(now), now)
        at = inputs.measured(live)
        t_gen = self.config.group_size * self.config.sampling.max_new_tokens
        pool, rank = inputs.pool(at, self._pipeline(t_gen * inputs.t_gen_rate(live)))
        self.predictions.next_plan()
        plan = plan_pool(
            pool, headroom=self.config.capacity.headroom, rank=rank, period=self.predictions
        )
        rows = inputs.rows(live) if self.verification is not None else []
        return self._keep(plan, rows, len(live), len(at))

    def plan_from_scratch(self, period: PeriodFn | None = None) -> Plan:
        """The plan of every live node's row read from the store and its figures rebuilt, the
        predictions made afresh (what :meth:`replan` did before issue 35; the reference the
        incremental inputs are tested against), or by ``period``. Keeps the plan like
        :meth:`replan`."""
        self.liveness.flush()
        now = self.clock()
        rows = self.store.planner_rows(self.horizon(now), now)
        measured: list[NodeCapacity] = []
        fastest_gen = 0.0
        for key, price, tps, rps, done, expired in rows:
            if tps:
                fastest_gen = max(fastest_gen, 1.0 / tps)
            fig = self.throughput.get(key)
            capacity = _capacity(key, fig, price, rps, (done + 1) / (done + expired + 2))
            if capacity is not None:
                measured.append(capacity)
        t_gen = self.config.group_size * self.config.sampling.max_new_tokens * fastest_gen
        pipe = self._pipeline(t_gen)
        headroom = self.config.capacity.headroom
        if period is not None:
            plan = plan_pool(_Pool(measured, pipe), headroom=headroom, period=period)
        else:
            plan = plan_activation(
                measured, batch=pipe.batch, t_train=pipe.t_train, kappa=pipe.kappa,
                t_bcast=pipe.t_bcast, headroom=headroom, staleness_bound=pipe.staleness_bound,
                t_gen=t_gen, t_train_cv=pipe.t_train_cv,
            )  # fmt: skip
        return self._keep(plan, rows, len(rows), len(measured))

    def _keep(self, plan: Plan, rows: list[PlannerRow], alive: int, measured: int) -> Plan:
        cap = self.config.capacity
        budget = self.verification
        if budget is not None:  # D <= (1 − h)·V beside the learner's rule (issue 35)
            demand = budget.observe(rows, plan.standby if cap.activation else ())
            plan = with_verification(plan, demand, budget.capacity(), budget.config.headroom)
        self.plan = plan
        self.planned_at = self.clock()
        self._standby = frozenset(plan.standby)
        self._g_active.set(len(plan.active) + alive - measured)
        return plan

    def replan_due(self) -> bool:
        """``capacity.replan_interval_s`` has passed since the last plan."""
        return self.clock() - self.planned_at >= self.config.capacity.replan_interval_s

    def is_active(self, node_key: bytes) -> bool:
        """Unmeasured nodes are always active (they must run a lease to be measured)."""
        if not self.config.capacity.activation or self.plan is None:
            return True
        return node_key.hex() not in self._standby


def _capacity(
    key: bytes, fig: NodeFigures | None, price: float | None, rps: float | None,
    reliability: float,
) -> NodeCapacity | None:  # fmt: skip
    """What the planner knows of one node: its lease-by-lease figures; before any, the durable
    end-to-end rate ``rps``; None when it has not completed a lease yet."""
    if fig is not None:
        return NodeCapacity(
            key.hex(), fig.gen_rate, price, reliability, overhead_s=fig.overhead_s,
            lease_s=fig.lease_s, load_s=fig.load_s or 0.0,
        )  # fmt: skip
    if not rps:
        return None
    return NodeCapacity(key.hex(), rps, price, reliability)
