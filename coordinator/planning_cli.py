"""``swarm coordinator plan``: the capacity rule (DESIGN.md §9) worked out for a config and a pool.

Reads the coordinator config (B, T_train, κ, S, T_bcast, headroom, G), an optional JSON pool of
nodes, applies the ``--t-train`` / ``--t-bcast`` overrides, runs
:func:`coordinator.capacity.plan_activation` and prints every number of the rule, so an operator
can check by hand what the coordinator does at run time
(:meth:`~coordinator.core.Coordinator.replan`).

Pool file: a JSON list of objects ``{"id": str, "rollouts_per_s": number >= 0, "price_per_hour":
number >= 0 or null (free volunteer, optional), "reliability": number in [0, 1] (default 1)}``.
Unknown keys are an error, as in the TOML configs.

t_gen (one group's generation time, for the staleness check) is estimated as the coordinator does,
from the slowest node of the pool: G / μ_min (here from rollouts/s; the coordinator uses
G · max_new_tokens / tokens_per_s, the same quantity when completions run to the length cap).

Exit status: 0 the plan works (overlap rule met with headroom, or feasible when no pool is given,
and the staleness bound holds), 1 it does not (T_bcast ≥ κ·T_train, the whole pool is too slow, or
κ + ⌈(T_bcast + t_gen)/T_train⌉ > S), 2 bad input (one line on stderr).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.capacity import (
    NodeCapacity,
    Plan,
    plan_activation,
    required_rate,
    staleness_lag,
)
from coordinator.config import CoordinatorConfig, load_config, parse_config
from coordinator.errors import ConfigError

_POOL_KEYS = frozenset({"id", "rollouts_per_s", "price_per_hour", "reliability"})


class PoolError(ValueError):
    """The pool file is unreadable or an entry is invalid; the message names the entry and field."""


@dataclass(frozen=True)
class PlanInputs:
    """The rule's inputs after config loading and CLI overrides."""

    batch: int
    t_train: float
    kappa: int
    kappa_from_default: bool
    staleness_bound: int
    t_bcast: float
    headroom: float
    group_size: int
    activation: bool


def _num(x: float) -> str:
    """Compact number: 6 significant digits, no float noise (307.2, not 307.20000000000005)."""
    return f"{x:.6g}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def load_pool(path: Path) -> list[NodeCapacity]:
    """Parse and validate a pool JSON file; raises :class:`PoolError` with a one-line message."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PoolError(f"{path}: no such pool file; see coordinator/pool.example.json") from exc
    except OSError as exc:
        raise PoolError(f"{path}: cannot read pool file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PoolError(f"{path}: pool file is not UTF-8 text") from exc
    except json.JSONDecodeError as exc:
        raise PoolError(
            f"{path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
        ) from exc
    if not isinstance(raw, list):
        raise PoolError(f"{path}: the pool must be a JSON list of node objects")
    nodes: list[NodeCapacity] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        nodes.append(_pool_entry(path, index, entry, seen))
    return nodes


def _pool_entry(path: Path, index: int, entry: object, seen: set[str]) -> NodeCapacity:
    where = f"{path}: entry {index}"
    if not isinstance(entry, dict):
        raise PoolError(f"{where}: must be an object with id and rollouts_per_s")
    unknown = sorted(str(k) for k in entry if k not in _POOL_KEYS)
    if unknown:
        raise PoolError(
            f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_POOL_KEYS))})"
        )
    node_id = entry.get("id")
    if not isinstance(node_id, str) or not node_id.strip():
        raise PoolError(f"{where}: id must be a non-empty string")
    where = f"{path}: entry {index} (id {node_id!r})"
    if node_id in seen:
        raise PoolError(f"{where}: duplicate id")
    seen.add(node_id)
    rate = _field(where, entry, "rollouts_per_s", required=True, low=0.0, high=math.inf)
    assert rate is not None
    price = _field(where, entry, "price_per_hour", required=False, low=0.0, high=math.inf)
    reliability = _field(where, entry, "reliability", required=False, low=0.0, high=1.0)
    return NodeCapacity(
        node_id=node_id,
        rollouts_per_s=rate,
        price_per_hour=price,
        reliability=1.0 if reliability is None else reliability,
    )


def _field(
    where: str, entry: dict[str, Any], key: str, *, required: bool, low: float, high: float
) -> float | None:
    if key not in entry or entry[key] is None:
        if required:
            raise PoolError(f"{where}: {key} is required (a number >= {_num(low)})")
        return None
    value = entry[key]
    bound = f">= {_num(low)}" if math.isinf(high) else f"in [{_num(low)}, {_num(high)}]"
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise PoolError(f"{where}: {key} must be a number {bound}, got {value!r}")
    return float(value)


def plan_inputs(config: Path | None, t_train: float | None, t_bcast: float | None) -> PlanInputs:
    """Load the config and apply the overrides (validated like the config file itself)."""
    cfg = load_config(config) if config is not None else parse_config({})
    overrides: dict[str, float] = {}
    for flag, key, value in (
        ("--t-train", "t_train_s", t_train),
        ("--t-bcast", "t_bcast_s", t_bcast),
    ):
        if value is None:
            continue
        if not math.isfinite(value):
            raise ConfigError(f"{flag}: must be a finite number of seconds, got {value}")
        overrides[key] = value
    if overrides:
        data = cfg.model_dump()
        data["capacity"] = {**data["capacity"], **overrides}
        cfg = parse_config(data, source="--t-train/--t-bcast")
    return _inputs(cfg)


def _inputs(cfg: CoordinatorConfig) -> PlanInputs:
    cap = cfg.capacity
    return PlanInputs(
        batch=cap.batch_rollouts,
        t_train=cap.t_train_s,
        kappa=cfg.kappa,
        kappa_from_default=cfg.publish_every is None,
        staleness_bound=cfg.staleness_bound,
        t_bcast=cap.t_bcast_s,
        headroom=cap.headroom,
        group_size=cfg.group_size,
        activation=cap.activation,
    )


def slowest_group_time(nodes: list[NodeCapacity], group_size: int) -> tuple[float, str] | None:
    """t_gen = G / μ_min over nodes with μ > 0, and the slowest node's id; None if none."""
    usable = [n for n in nodes if n.rollouts_per_s > 0]
    if not usable:
        return None
    slowest = min(usable, key=lambda n: (n.rollouts_per_s, n.node_id))
    return group_size / slowest.rollouts_per_s, slowest.node_id


def render(inp: PlanInputs, nodes: list[NodeCapacity] | None) -> tuple[list[str], bool]:
    """The report lines, and whether both the overlap rule and the staleness bound hold."""
    out: list[str] = []
    kappa_note = "(publish_every unset: S − 1)" if inp.kappa_from_default else "(publish_every)"
    out += [
        "capacity rule (DESIGN.md §9)",
        f"  B        rollouts per learner step     {inp.batch}",
        f"  T_train  seconds per learner step      {_num(inp.t_train)} s",
        f"  κ        steps per published version   {inp.kappa} {kappa_note}",
        f"  S        staleness bound               {inp.staleness_bound}",
        f"  T_bcast  checkpoint dissemination      {_num(inp.t_bcast)} s",
        f"  G        samples per prompt            {inp.group_size}",
        f"  headroom                               {inp.headroom:.0%}",
    ]
    window = inp.kappa * inp.t_train - inp.t_bcast
    required = required_rate(inp.batch, inp.t_train, inp.kappa, inp.t_bcast)
    out.append("overlap rule: Σμ ≥ κ·B / (κ·T_train − T_bcast), needs T_bcast < κ·T_train")
    feasible = not math.isinf(required)
    if feasible:
        out.append(
            f"  = {inp.kappa}·{inp.batch} / ({inp.kappa}·{_num(inp.t_train)} − "
            f"{_num(inp.t_bcast)}) = {inp.kappa * inp.batch} / {_num(window)} "
            f"= {_num(required)} rollouts/s"
        )
        target = required * (1.0 + inp.headroom)
        out.append(f"  with {inp.headroom:.0%} headroom: Σμ ≥ {_num(target)} rollouts/s")
    else:
        out.append(
            f"  INFEASIBLE: T_bcast = {_num(inp.t_bcast)} s ≥ κ·T_train = "
            f"{_num(inp.kappa * inp.t_train)} s, no rate keeps the learner busy; raise κ "
            "(publish_every, needs a larger S) or speed up dissemination"
        )
    t_gen = slowest_group_time(nodes, inp.group_size) if nodes else None
    out.append("staleness: κ + ⌈(T_bcast + t_gen)/T_train⌉ ≤ S")
    if t_gen is None:
        floor = staleness_lag(inp.kappa, inp.t_bcast, 0.0, inp.t_train)
        stale_ok = floor <= inp.staleness_bound
        verdict = "ok so far" if stale_ok else "VIOLATED whatever t_gen is"
        why = "give --pool" if nodes is None else "no node in the pool has rollouts_per_s > 0"
        out.append(
            f"  t_gen unknown ({why}); with t_gen = 0: {inp.kappa} + "
            f"⌈{_num(inp.t_bcast)}/{_num(inp.t_train)}⌉ = {floor} vs S = {inp.staleness_bound}: "
            f"{verdict}"
        )
    else:
        tg, slowest = t_gen
        lag = staleness_lag(inp.kappa, inp.t_bcast, tg, inp.t_train)
        ok = stale_ok = lag <= inp.staleness_bound
        slow = next(n for n in nodes or [] if n.node_id == slowest)
        out.append(
            f"  t_gen = G/μ_min = {inp.group_size}/{_num(slow.rollouts_per_s)} = {_num(tg)} s "
            f"(one group on the slowest node, {slowest})"
        )
        out.append(
            f"  {inp.kappa} + ⌈({_num(inp.t_bcast)} + {_num(tg)})/{_num(inp.t_train)}⌉"
            f" = {lag} {'≤' if ok else '>'} S = {inp.staleness_bound}: "
            + (
                "ok"
                if ok
                else "VIOLATED, results would arrive too stale (raise S, lower κ, or cut T_bcast)"
            )
        )
    if nodes is None:
        out.append("no --pool given: pass a JSON list of nodes to choose the active set")
        return out, feasible and stale_ok
    plan = plan_activation(
        nodes,
        batch=inp.batch,
        t_train=inp.t_train,
        kappa=inp.kappa,
        t_bcast=inp.t_bcast,
        headroom=inp.headroom,
        staleness_bound=inp.staleness_bound,
        t_gen=None if t_gen is None else t_gen[0],
    )
    out += _sets(plan, nodes)
    if not inp.activation:
        out.append(
            "note: capacity.activation = false, so the coordinator keeps every node active; "
            "the standby set above is what activation would choose"
        )
    out.append(f"plan: {plan.explanation}")
    return out, plan.meets_rule and stale_ok


def _sets(plan: Plan, nodes: list[NodeCapacity]) -> list[str]:
    by_id = {n.node_id: n for n in nodes}
    out = [f"pool: {len(nodes)} nodes, effective Σμ = {_num(plan.available)} rollouts/s"]
    header = f"    {'id':<20} {'μ/s':>9} {'reliab.':>8} {'μ_eff/s':>9} {'price/h':>8}"

    def row(node: NodeCapacity) -> str:
        price = "free" if node.price_per_hour is None else _num(node.price)
        return (
            f"    {node.node_id:<20} {_num(node.rollouts_per_s):>9} {_num(node.reliability):>8} "
            f"{_num(node.effective_rate):>9} {price:>8}"
        )

    out.append(
        f"active ({len(plan.active)}): Σμ_eff = {_num(plan.active_rate)} rollouts/s, "
        f"cost {_num(plan.cost_per_hour)} per hour"
    )
    if plan.active:
        out += [header] + [row(by_id[i]) for i in plan.active]
    standby_cost = sum(by_id[i].price for i in plan.standby)
    out.append(
        f"standby ({len(plan.standby)}): no leases while the active set suffices; "
        f"saves {_num(standby_cost)} per hour"
    )
    if plan.standby:
        out += [header] + [row(by_id[i]) for i in plan.standby]
    return out


def plan_from_cli(
    *, config: Path | None, pool: Path | None, t_train: float | None, t_bcast: float | None
) -> int:
    """``swarm coordinator plan``: print the rule; exit 0 plan works, 1 it does not, 2 bad input."""
    try:
        inputs = plan_inputs(config, t_train, t_bcast)
        nodes = load_pool(pool) if pool is not None else None
    except (ConfigError, PoolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --config names a directory or an unreadable file
        print(f"error: {config}: cannot read config: {exc.strerror or exc}", file=sys.stderr)
        return 2
    lines, met = render(inputs, nodes)
    print("\n".join(lines))
    return 0 if met else 1
