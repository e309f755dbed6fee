"""Liveness and the active set: who is alive, what each node can do, the plan (a mixin of the
coordinator).

:class:`ActiveSet` is a mixin of :class:`coordinator.core.Coordinator`, which sets the state
declared below in its ``__init__``. :meth:`ActiveSet.replan` hands the planner
(:func:`coordinator.capacity.plan_activation`, docs/capacity.md) the live nodes' measured figures
and the learner's (B, T_train and its variability, κ, T_bcast) and keeps the resulting plan;
:meth:`ActiveSet.is_active` is what a lease request consults.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Gauge

from coordinator.capacity import NodeCapacity, Plan, plan_activation
from coordinator.config import CoordinatorConfig
from coordinator.store import NodeRecord, Store
from coordinator.throughput import NodeFigures, ThroughputBook


class ActiveSet:
    """Liveness and activation, as a mixin of :class:`~coordinator.core.Coordinator` (which sets
    every attribute below in its ``__init__``)."""

    config: CoordinatorConfig
    store: Store
    clock: Callable[[], float]
    throughput: ThroughputBook
    t_bcast_s: float
    t_train_s: float
    t_train_cv: float
    batch_rollouts: int
    kappa: int
    published_kappa: float | None
    plan: Plan | None
    _standby: frozenset[str]
    _planned_at: float
    #: node_key -> last_seen not yet written to the store (see :mod:`coordinator.core`)
    _seen: dict[bytes, float]
    _g_active: Gauge

    def flush_liveness(self) -> None:
        """Write the ``last_seen`` of every node heard from since the last flush (one commit)."""
        if self._seen:
            seen, self._seen = self._seen, {}
            self.store.touch_nodes(seen.items())

    def alive_nodes(self) -> list[NodeRecord]:
        """Registered, heard from within the heartbeat horizon, not banned (one query; the
        adverts are not loaded)."""
        self.flush_liveness()
        now = self.clock()
        horizon = now - self.config.heartbeat_interval_s * self.config.heartbeat_misses
        return self.store.live_nodes(horizon, now)

    def node_capacity(self, node: NodeRecord) -> NodeCapacity | None:
        """What the planner knows of ``node``: its lease-by-lease figures (generation rate, lease
        time, round-trip overhead, version-load delay); before any, the durable end-to-end rate;
        None when it has not completed a lease yet."""
        fig = self.throughput.get(node.node_key)
        if fig is not None:
            return NodeCapacity(
                node.node_key.hex(), fig.gen_rate, node.price_per_hour, node.reliability,
                overhead_s=fig.overhead_s, lease_s=fig.lease_s, load_s=fig.load_s or 0.0,
            )  # fmt: skip
        if not node.rollouts_per_s:
            return None
        return NodeCapacity(node.node_key.hex(), node.rollouts_per_s, node.price_per_hour,
                            node.reliability)  # fmt: skip

    def _planner_inputs(self) -> tuple[int, list[NodeCapacity], float]:
        """(live nodes, the measured ones' :class:`NodeCapacity`, t_gen) from bare rows
        (:meth:`Store.planner_rows`); a node's NodeCapacity is rebuilt only when its inputs
        changed (a completed lease, a price, its lease record), so a re-plan of 10,000 nodes
        does not construct 10,000 objects every 5 s."""
        self.flush_liveness()
        now = self.clock()
        horizon = now - self.config.heartbeat_interval_s * self.config.heartbeat_misses
        rows = self.store.planner_rows(horizon, now)
        # soft state (rebuilt after a restart); created here so Coordinator.__init__ stays as is
        cache: dict[bytes, tuple[tuple[object, ...], NodeCapacity | None]] = (
            self.__dict__.setdefault("_capacity_cache", {})
        )
        measured: list[NodeCapacity] = []
        fastest_gen = 0.0
        for key, price, tps, rps, done, expired in rows:
            if tps:
                fastest_gen = max(fastest_gen, 1.0 / tps)
            fig = self.throughput.get(key)
            stamp = (id(fig), fig.leases if fig else 0, fig.lease_s if fig else 0.0, price, rps,
                     done, expired)  # fmt: skip
            hit = cache.get(key)
            if hit is not None and hit[0] == stamp:
                capacity = hit[1]
            else:
                capacity = self._capacity(key, fig, price, rps, (done + 1) / (done + expired + 2))
                cache[key] = (stamp, capacity)
            if capacity is not None:
                measured.append(capacity)
        if len(cache) > 2 * max(1, len(rows)):  # forget departed nodes now and then
            live = {r[0] for r in rows}
            for key in [k for k in cache if k not in live]:
                del cache[key]
        t_gen = self.config.group_size * self.config.sampling.max_new_tokens * fastest_gen
        return len(rows), measured, t_gen

    def _capacity(
        self, key: bytes, fig: NodeFigures | None, price: float | None, rps: float | None,
        reliability: float,
    ) -> NodeCapacity | None:  # fmt: skip
        """:meth:`node_capacity` on bare inputs (the same rule)."""
        if fig is not None:
            return NodeCapacity(
                key.hex(), fig.gen_rate, price, reliability, overhead_s=fig.overhead_s,
                lease_s=fig.lease_s, load_s=fig.load_s or 0.0,
            )  # fmt: skip
        if not rps:
            return None
        return NodeCapacity(key.hex(), rps, price, reliability)

    def replan(self) -> Plan:
        """Recompute the active set (call when nodes join/leave or their μ changes)."""
        cap = self.config.capacity
        alive, measured, t_gen = self._planner_inputs()
        plan = plan_activation(
            measured,
            batch=self.batch_rollouts,
            t_train=self.t_train_s,
            kappa=self.effective_kappa,
            t_bcast=self.t_bcast_s,
            t_train_cv=self.t_train_cv,
            headroom=cap.headroom,
            staleness_bound=self.config.staleness_bound,
            t_gen=t_gen,
        )
        self.plan = plan
        self._planned_at = self.clock()
        self._standby = frozenset(plan.standby)
        self._g_active.set(len(plan.active) + alive - len(measured))
        return plan

    @property
    def effective_kappa(self) -> float:
        """κ of the rule: the learner's, or the observed versions per publication if larger."""
        return max(float(self.kappa), self.published_kappa or 0.0)

    def is_active(self, node_key: bytes) -> bool:
        """Unmeasured nodes are always active (they must run a lease to be measured)."""
        if not self.config.capacity.activation or self.plan is None:
            return True
        return node_key.hex() not in self._standby
