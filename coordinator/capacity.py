"""Capacity model and cost-aware activation (DESIGN.md §9). Pure functions, no I/O.

Symbols: B rollouts per learner step, T_train seconds per step, κ steps between published
versions, T_bcast dissemination time, μ_i rollouts/s of node i (discounted by its reliability),
c_i price per hour.

* Overlap rule: Σ_{i∈A} μ_i ≥ κ·B / (κ·T_train − T_bcast), feasible only when T_bcast < κ·T_train.
* Staleness feasibility: κ + ⌈(T_bcast + t_gen) / T_train⌉ ≤ S.
* Activation: the cheapest set meeting the rule with headroom; exact search for pools of at most
  :data:`EXACT_LIMIT` nodes, otherwise greedy by c_i/μ_i followed by a prune. Nodes without a price
  are free volunteers (price 0).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Pools up to this size are searched exhaustively (2^12 = 4096 subsets).
EXACT_LIMIT = 12
_EPS = 1e-12


@dataclass(frozen=True)
class NodeCapacity:
    """What the planner knows about one node."""

    node_id: str
    #: μ_i: measured rollouts (samples) per second.
    rollouts_per_s: float
    #: c_i: price per hour; None = free volunteer (counts as 0).
    price_per_hour: float | None = None
    #: Fraction of leases the node completes in time, in [0, 1]; scales μ_i.
    reliability: float = 1.0

    @property
    def effective_rate(self) -> float:
        return max(0.0, self.rollouts_per_s) * min(1.0, max(0.0, self.reliability))

    @property
    def price(self) -> float:
        return 0.0 if self.price_per_hour is None else self.price_per_hour


@dataclass(frozen=True)
class Plan:
    """Result of :func:`plan_activation`."""

    #: Σμ the overlap rule needs (rollouts/s), before headroom; inf when infeasible.
    required: float
    #: Effective Σμ of the whole pool.
    available: float
    #: Effective Σμ of the active set.
    active_rate: float
    active: tuple[str, ...]
    standby: tuple[str, ...]
    #: Total price per hour of the active set.
    cost_per_hour: float
    #: True when the overlap rule (with headroom) holds for the active set.
    meets_rule: bool
    #: True when κ + ⌈(T_bcast + t_gen)/T_train⌉ ≤ S (None when S or t_gen was not given).
    staleness_ok: bool | None
    explanation: str


def required_rate(batch: int, t_train: float, kappa: int, t_bcast: float) -> float:
    """κ·B / (κ·T_train − T_bcast) rollouts/s; ``math.inf`` when T_bcast ≥ κ·T_train."""
    if batch <= 0 or t_train <= 0 or kappa <= 0 or t_bcast < 0:
        raise ValueError("required_rate: batch, t_train, kappa must be > 0 and t_bcast >= 0")
    window = kappa * t_train - t_bcast
    if window <= 0:
        return math.inf
    return kappa * batch / window


def staleness_lag(kappa: int, t_bcast: float, t_gen: float, t_train: float) -> float:
    """κ + ⌈(T_bcast + t_gen) / T_train⌉: versions a result can lag behind the learner.

    An integer, or ``math.inf`` when the quotient is not finite: the figures come from peers (a
    node advertising 5e-324 tokens/s has an infinite t_gen), and planning must not crash on them.
    """
    steps = (t_bcast + t_gen) / t_train - _EPS
    if not math.isfinite(steps):
        return math.inf
    return kappa + math.ceil(steps)


def staleness_feasible(kappa: int, t_bcast: float, t_gen: float, t_train: float, s: int) -> bool:
    return staleness_lag(kappa, t_bcast, t_gen, t_train) <= s


def _meets(rate: float, target: float) -> bool:
    return rate + _EPS * max(1.0, target) >= target


def _exact(nodes: Sequence[NodeCapacity], target: float) -> tuple[NodeCapacity, ...] | None:
    best: tuple[tuple[float, int, float, tuple[str, ...]], tuple[NodeCapacity, ...]] | None = None
    for r in range(len(nodes) + 1):
        for combo in itertools.combinations(nodes, r):
            rate = sum(n.effective_rate for n in combo)
            if not _meets(rate, target):
                continue
            key = (sum(n.price for n in combo), r, -rate, tuple(n.node_id for n in combo))
            if best is None or key < best[0]:
                best = (key, combo)
    return None if best is None else best[1]


def _greedy(nodes: Sequence[NodeCapacity], target: float) -> tuple[NodeCapacity, ...] | None:
    usable = [n for n in nodes if n.effective_rate > 0]
    order = sorted(usable, key=lambda n: (n.price / n.effective_rate, -n.effective_rate, n.node_id))
    chosen: list[NodeCapacity] = []
    rate = 0.0
    for node in order:
        if _meets(rate, target):
            break
        chosen.append(node)
        rate += node.effective_rate
    if not _meets(rate, target):
        return None
    # Prune: drop the most expensive members (then the slowest) while the rule still holds.
    for node in sorted(chosen, key=lambda n: (-n.price, n.effective_rate, n.node_id)):
        if _meets(rate - node.effective_rate, target):
            chosen.remove(node)
            rate -= node.effective_rate
    return tuple(chosen)


def choose_active(
    nodes: Sequence[NodeCapacity], target: float, *, exact_limit: int = EXACT_LIMIT
) -> tuple[NodeCapacity, ...] | None:
    """Cheapest subset whose effective rate reaches ``target``; None when all nodes fall short."""
    if len(nodes) <= exact_limit:
        return _exact(nodes, target)
    return _greedy(nodes, target)


def plan_activation(
    nodes: Sequence[NodeCapacity],
    *,
    batch: int,
    t_train: float,
    kappa: int,
    t_bcast: float,
    headroom: float = 0.2,
    staleness_bound: int | None = None,
    t_gen: float | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> Plan:
    """Choose the active set: cheapest nodes meeting the overlap rule with ``headroom``."""
    ids = sorted(n.node_id for n in nodes)
    available = sum(n.effective_rate for n in nodes)
    staleness_ok = None
    if staleness_bound is not None and t_gen is not None:
        staleness_ok = staleness_feasible(kappa, t_bcast, t_gen, t_train, staleness_bound)
    required = required_rate(batch, t_train, kappa, t_bcast)
    if math.isinf(required):
        return _all_active(
            nodes,
            required,
            staleness_ok,
            f"infeasible: T_bcast={t_bcast:g}s >= κ·T_train={kappa * t_train:g}s, no rate can keep "
            "the learner busy; publish less often (raise κ) or speed up dissemination; "
            "all nodes kept active",
        )
    target = required * (1.0 + headroom)
    # Free volunteers (price 0 or unpriced) are always active: standing one down saves nothing and
    # only adds staleness. The paid nodes cover what the free ones leave of the target.
    free = tuple(n for n in nodes if n.price <= 0.0 and n.effective_rate > 0)
    free_ids = {n.node_id for n in free}  # sets: these lines run on every tick for every node
    paid = [n for n in nodes if n.node_id not in free_ids]
    residual = target - sum(n.effective_rate for n in free)
    picked = () if _meets(0.0, residual) else choose_active(paid, residual, exact_limit=exact_limit)
    chosen = None if picked is None else free + picked
    method = "exact search" if len(paid) <= exact_limit else "greedy by price/rate + prune"
    if chosen is None:
        return _all_active(
            nodes,
            required,
            staleness_ok,
            f"short of capacity: need {target:.3g} rollouts/s (rule {required:.3g} + "
            f"{headroom:.0%} headroom), the whole pool gives {available:.3g}; all nodes active",
        )
    active = tuple(sorted(n.node_id for n in chosen))
    rate = sum(n.effective_rate for n in chosen)
    active_ids = set(active)
    standby = tuple(i for i in ids if i not in active_ids)
    cost = _cost(chosen)
    note = "" if staleness_ok is not False else "; WARNING: staleness bound S cannot be met"
    return Plan(
        required=required,
        available=available,
        active_rate=rate,
        active=active,
        standby=standby,
        cost_per_hour=cost,
        meets_rule=True,
        staleness_ok=staleness_ok,
        explanation=f"need {target:.3g} rollouts/s (rule {required:.3g} + {headroom:.0%} "
        "headroom); "
        f"{len(active)} of {len(ids)} nodes active give {rate:.3g} at {cost:.3g}/h ({method}); "
        f"{len(standby)} on standby{note}",
    )


def _all_active(
    nodes: Sequence[NodeCapacity], required: float, staleness_ok: bool | None, why: str
) -> Plan:
    rate = sum(n.effective_rate for n in nodes)
    return Plan(
        required=required,
        available=rate,
        active_rate=rate,
        active=tuple(sorted(n.node_id for n in nodes)),
        standby=(),
        cost_per_hour=_cost(nodes),
        meets_rule=False,
        staleness_ok=staleness_ok,
        explanation=why,
    )


def _cost(nodes: Sequence[NodeCapacity]) -> float:
    return sum(n.price for n in nodes)
