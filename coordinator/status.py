"""The coordinator's status document: ``/status`` JSON, ``rswarm/status`` and the learner gauges.

:func:`build_status` merges :meth:`~coordinator.core.Coordinator.status` with the service's own
figures (per-node states, rejections by reason, queue depth, plan, versions held, the trainer's
last report, the per-node details of :mod:`coordinator.node_view`, how many nodes hold each
recent version); :func:`wire_status` fits it into :class:`~protocol.messages.StatusResponse`'s
bounded shape; :class:`TrainerGauges` exports the trainer's figures on ``/metrics``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from coordinator.capacity import Pipeline, node_rate
from coordinator.core import Coordinator
from coordinator.dissemination import HolderCensus
from coordinator.node_view import OPERATOR_ONLY_FIELDS, node_details
from coordinator.store import NodeRecord
from coordinator.trust import TrustState
from protocol.limits import MAX_NAME_LEN, MAX_STATUS_KEYS
from swarm.broadcast import BroadcastNode

NEW = TrustState(0, False, None, None)

#: The verification budget's figures (:meth:`coordinator.verify_budget.VerificationBudget.status`)
#: stay on the operator's ``/status``: in a small swarm the demand D is a few nodes' check rates
#: times their known rates, so a node could read its own check rate from it (issue 34).
VERIFY_BUDGET_FIELDS = frozenset(
    {
        "verify_tokens_per_s", "verify_tokens_per_s_measured", "verify_verifiers",
        "verify_demand_tokens_per_s", "verify_budget_tokens_per_s", "verify_budget_meets",
        "verify_tokens_per_rollout", "admission_admitted", "admission_refused",
        "admission_waiting", "leases_in_verification", "leases_held_for_verification",
        "verify_jobs_queued", "verify_jobs_taken", "verify_jobs_redelivered",
        "verify_jobs_timed_out", "verifier_processes",
    }
)  # fmt: skip
#: Keys :func:`wire_status` leaves out of the unsigned ``rswarm/status`` answer.
OPERATOR_ONLY = OPERATOR_ONLY_FIELDS | VERIFY_BUDGET_FIELDS


#: Above this many registered nodes the per-tick document carries counts (``node_counts``), not
#: the per-node maps: building them cost ~1 s of the event loop every tick at 10,000 nodes
#: (issue 35). The dashboard then reads its node table page by page (:func:`node_page`,
#: ``/api/nodes``); ``node_maps_omitted`` says how many nodes the maps would have held.
NODE_MAPS_MAX = 500


def build_status(
    core: Coordinator,
    *,
    fingerprint: str,
    peer_id: str,
    started_at: float,
    trainer_stats: dict[str, Any],
    broadcast: BroadcastNode | None,
    census: HolderCensus | None = None,
    node_maps_max: int = NODE_MAPS_MAX,
) -> dict[str, Any]:
    """The ``/status`` document (also served over ``rswarm/status``). ``census``: who holds
    which recent version (:mod:`coordinator.dissemination`), for ``version_holders`` and
    ``node_versions_held``. The per-node maps (:func:`node_maps`) are included up to
    ``node_maps_max`` registered nodes; above, ``node_counts`` alone (its cost no longer grows
    with the swarm: counts come from SQL, not rows)."""
    snap = core.status()
    now = time.time()
    registered = int(snap["nodes_registered"])
    rejected = _counter_by_label(core.metrics.rejected, "reason")
    plan = core.plan
    snap.update(
        {
            "coordinator_fingerprint": fingerprint,
            "peer_id": peer_id,
            "uptime_s": round(now - started_at, 1),
            "rejected_by_reason": rejected,
            "queue_depth": core.store.rollout_count()
            - count_of(trainer_stats.get("rollout_cursor")),
            "plan_available_rollouts_per_s": plan.available if plan else None,
            "plan_meets_rule": plan.meets_rule if plan else None,
            "versions_held": [
                v for v in broadcast.store.versions() if broadcast.store.is_complete(v)
            ]
            if broadcast
            else [],
        }
    )
    snap.update(core.budget.status())  # the verification budget (issue 35): operator only
    if registered <= node_maps_max:
        maps = node_maps(core, core.store.nodes(), census, now)
        snap.update(maps)
        snap["node_counts"] = dict(Counter(maps["node_states"].values()))
    else:
        snap["node_counts"] = _estimated_counts(core, snap)
        snap["node_maps_omitted"] = registered
    snap["version_holders"] = {str(v): n for v, n in census.counts.items()} if census else {}
    snap["version_holders_age_s"] = (
        round(now - census.taken_at, 1) if census and census.taken_at else None
    )
    for key, value in trainer_stats.items():
        snap[f"trainer_{key}"] = value
    finite: dict[str, Any] = _finite(snap)
    return finite


def _estimated_counts(core: Coordinator, snap: dict[str, Any]) -> dict[str, int]:
    """Nodes by state from the counts of :meth:`Coordinator.status`: banned, alive (active or on
    standby: the plan's standby list, taken at the last re-plan), gone."""
    banned = len(snap.get("nodes_banned") or [])
    alive = int(snap["nodes_alive"])
    plan = core.plan
    standby = (
        min(alive, len(plan.standby)) if plan is not None and core.config.capacity.activation else 0
    )
    gone = max(0, int(snap["nodes_registered"]) - alive - banned)
    counts = {"active": alive - standby, "standby": standby, "gone": gone, "banned": banned}
    return {k: v for k, v in counts.items() if v}


def node_page(
    core: Coordinator, offset: int, limit: int, census: HolderCensus | None = None
) -> dict[str, Any]:
    """One page of the node table: the maps of :func:`node_maps` for the registered nodes
    ``offset`` .. ``offset + limit`` in fingerprint order, with ``total`` (registered nodes),
    ``offset`` and ``limit``. Costs the page, not the swarm."""
    core.flush_liveness()
    page = core.store.node_page(offset, limit)
    out: dict[str, Any] = {"total": core.store.node_count(), "offset": offset, "limit": limit}
    out.update(node_maps(core, page, census, time.time()))
    finite: dict[str, Any] = _finite(out)
    return finite


def node_maps(
    core: Coordinator, nodes: list[NodeRecord], census: HolderCensus | None, now: float
) -> dict[str, Any]:
    """Every per-node map of the status document for ``nodes``: state, last seen, throughput,
    the trust maps (operator only, :data:`coordinator.node_view.OPERATOR_ONLY_FIELDS`), the
    last problem, :func:`~coordinator.node_view.node_details` and :func:`capacity_maps`."""
    clock = core.clock()
    horizon = core.liveness.horizon(clock)
    banned = core.store.banned_keys(clock)
    states: dict[str, str] = {}
    last_seen: dict[str, float] = {}
    tokens_per_s: dict[str, float | None] = {}
    leases_done: dict[str, int] = {}
    for n in nodes:
        tokens_per_s[n.fingerprint] = n.tokens_per_s
        leases_done[n.fingerprint] = n.leases_completed
        if n.node_key in banned:
            states[n.fingerprint] = "banned"
        elif n.last_seen < horizon:  # Store.live_nodes' rule, on the rows already read
            states[n.fingerprint] = "gone"
        else:
            states[n.fingerprint] = "active" if core.is_active(n.node_key) else "standby"
        last_seen[n.fingerprint] = round(now - n.last_seen, 1)
    trust = core.trust.all_states()
    check_rate: dict[str, float] = {}
    trust_level: dict[str, str] = {}
    clean: dict[str, int] = {}
    for n in nodes:
        t = trust.get(n.node_key, NEW)  # no row yet: never checked, never struck
        check_rate[n.fingerprint] = round(core.trust.rate_of(t), 4)
        trust_level[n.fingerprint] = core.trust.level_of(t)
        clean[n.fingerprint] = t.clean_checks
    flagged = [n.fingerprint for n in nodes if trust.get(n.node_key, NEW).flagged_at]
    out: dict[str, Any] = {
        "node_states": states,
        "node_last_seen_s": last_seen,
        "node_tokens_per_s": tokens_per_s,
        "node_leases_completed": leases_done,
        "node_check_rate": check_rate,
        "node_trust": trust_level,
        "node_clean_checks": clean,
        "nodes_flagged": flagged,
        # what a node said when it last gave a lease back (cleared by its next accepted work)
        "node_problems": {
            n.fingerprint: core.node_problems[n.node_key]
            for n in nodes
            if n.node_key in core.node_problems
        },
    }
    suspects = frozenset(
        k for k, t in trust.items() if t.suspect and core.config.intake.suspect_full_check
    )
    out.update(
        node_details(core.store, nodes, census.by_peer if census else {}, now, suspects=suspects)
    )
    out.update(capacity_maps(core, nodes))
    return out


#: Per-node capacity figures on /status (docs/capacity.md, "Measured inputs").
CAPACITY_FIELDS = (
    "node_reliability",
    "node_gen_rollouts_per_s",
    "node_lease_s",
    "node_lease_overhead_s",
    "node_load_delay_s",
    "node_admissible_rollouts_per_s",
)


def capacity_maps(core: Coordinator, nodes: list[NodeRecord]) -> dict[str, dict[str, Any]]:
    """What the planner knows of each node: r_i, μ_i (per second of generation), g_i, o_i, d_i,
    and ρ_i at T_train (admissible rollouts/s it counts for); None where not measured yet."""
    out: dict[str, dict[str, Any]] = {key: {} for key in CAPACITY_FIELDS}
    pipe = Pipeline(
        max(1, core.batch_rollouts), core.t_train_s, core.effective_kappa, core.t_bcast_s,
        core.config.staleness_bound,
    )  # fmt: skip
    for n in nodes:
        fp = n.fingerprint
        fig = core.throughput.get(n.node_key)
        out["node_reliability"][fp] = n.reliability
        out["node_gen_rollouts_per_s"][fp] = fig.gen_rate if fig else None
        out["node_lease_s"][fp] = fig.lease_s if fig else None
        out["node_lease_overhead_s"][fp] = fig.overhead_s if fig else None
        out["node_load_delay_s"][fp] = fig.load_s if fig else None
        cap = core.node_capacity(n)
        out["node_admissible_rollouts_per_s"][fp] = node_rate(cap, pipe) if cap else None
    return out


class TrainerGauges:
    """Learner figures on /metrics: one gauge per scalar, the staleness histogram by label."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._trainer_gauge = Gauge(
            "swarm_trainer", "Learner figures reported with each fetch (docs/operations.md)",
            ["figure"], registry=registry,
        )  # fmt: skip
        self._staleness_gauge = Gauge(
            "swarm_trainer_staleness_rollouts",
            "Rollouts of the learner's last step by staleness (versions behind)",
            ["staleness"], registry=registry,
        )  # fmt: skip

    def export(self, trainer_stats: dict[str, Any]) -> None:
        for key, value in trainer_stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self._trainer_gauge.labels(figure=key).set(value)
        hist = trainer_stats.get("staleness_hist")
        if isinstance(hist, dict):
            self._staleness_gauge.clear()
            for k, v in hist.items():
                if isinstance(v, int | float):
                    self._staleness_gauge.labels(staleness=str(k)).set(v)


def _counter_by_label(counter: Any, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and label in sample.labels:
                out[sample.labels[label]] = sample.value
    return out


def wire_status(status: dict[str, Any]) -> dict[str, Any]:
    """Fit the status document into StatusResponse's bounded shape (depth <= 2, scalars, at most
    MAX_STATUS_KEYS keys of at most MAX_NAME_LEN characters per map). Keys beyond the limit are
    dropped, the last-added first: the trainer's report comes after the coordinator's figures.
    Any peer may call ``rswarm/status``: how closely each node is watched
    (:data:`~coordinator.node_view.OPERATOR_ONLY_FIELDS`) and the verification budget
    (:data:`VERIFY_BUDGET_FIELDS`) stay on the operator's ``/status``."""
    out: dict[str, Any] = {}
    public = [(k, v) for k, v in status.items() if k not in OPERATOR_ONLY]
    for key, value in public[:MAX_STATUS_KEYS]:
        name = str(key)[:MAX_NAME_LEN]
        if isinstance(value, dict):
            items = list(value.items())[:MAX_STATUS_KEYS]
            out[name] = {str(k)[:MAX_NAME_LEN]: _scalar(v) for k, v in items}
        elif isinstance(value, list | tuple):
            out[name] = [_scalar(v) for v in list(value)[:MAX_STATUS_KEYS]]
        else:
            out[name] = _scalar(value)
    return out


def count_of(value: Any) -> int:
    """A count from the trainer's report; 0 unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0
    return int(value)


def positive_of(value: Any) -> float | None:
    """``value`` if it is a finite number > 0, else None (the trainer's report is loosely typed)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, float) and not math.isfinite(value):  # NaN/inf: not on the wire
            return None
        return value[:1000] if isinstance(value, str) else value
    return str(value)[:1000]


def _finite(value: Any) -> Any:
    """Replace NaN/inf anywhere in a status document with None (JSON and the wire refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
