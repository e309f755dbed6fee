"""``swarm coordinator plan``: the capacity rule (docs/capacity.md) for a config and a pool.

Reads the coordinator config (B, T_train, κ, S, T_bcast, headroom, G), an optional JSON pool of
nodes, applies the ``--t-train`` / ``--t-bcast`` overrides, runs
:func:`coordinator.capacity.plan_activation` and prints every number of the rule — each node's
admissible rate, the active set, and the learner's predicted idle fraction with it and with the
whole pool — so an operator can check by hand what the coordinator does at run time
(:meth:`~coordinator.core.Coordinator.replan`).

Pool file: a JSON list of objects ``{"id": str, "rollouts_per_s": number >= 0 (μ: rollouts per
second of generation), "price_per_hour": number >= 0 or null (free volunteer, optional),
"reliability": number in [0, 1] (default 1), "lease_s": seconds of generation per lease
(optional), "overhead_s": round-trip seconds per lease (default 0), "load_s": the node's
version-load delay in seconds (default 0)}``. Unknown keys are an error, as in the TOML configs.

Exit status: 0 the plan works (the active set meets B/T_train with headroom, counting only the
results that arrive within S; without a pool: S·T_train > T_bcast), 1 it does not, 2 bad input
(one line on stderr).
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
    Pipeline,
    Plan,
    admissible_fraction,
    node_rate,
    plan_activation,
    required_rate,
)
from coordinator.config import CoordinatorConfig, load_config, parse_config
from coordinator.errors import ConfigError

_POOL_KEYS = frozenset(
    {"id", "rollouts_per_s", "price_per_hour", "reliability", "lease_s", "overhead_s", "load_s"}
)


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
    lease_s, overhead_s, load_s = (
        _field(where, entry, key, required=False, low=0.0, high=math.inf)
        for key in ("lease_s", "overhead_s", "load_s")
    )
    return NodeCapacity(
        node_id=node_id,
        rollouts_per_s=rate,
        price_per_hour=price,
        reliability=1.0 if reliability is None else reliability,
        overhead_s=overhead_s or 0.0,
        lease_s=lease_s or None,
        load_s=load_s or 0.0,
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


def render(inp: PlanInputs, nodes: list[NodeCapacity] | None) -> tuple[list[str], bool]:
    """The report lines, and whether the plan works (the active set meets the rule with
    headroom)."""
    out: list[str] = []
    kappa_note = "(publish_every unset: S − 1)" if inp.kappa_from_default else "(publish_every)"
    out += [
        "capacity rule (docs/capacity.md)",
        f"  B        rollouts per learner step        {inp.batch}",
        f"  T_train  seconds per learner step         {_num(inp.t_train)} s",
        f"  κ        steps per published version      {inp.kappa} {kappa_note}",
        f"  S        staleness bound                  {inp.staleness_bound}",
        f"  T_bcast  weights ready -> leases name it  {_num(inp.t_bcast)} s",
        f"  G        samples per prompt               {inp.group_size}",
        f"  headroom                                  {inp.headroom:.0%}",
    ]
    required = required_rate(inp.batch, inp.t_train)
    target = required * (1.0 + inp.headroom)
    out.append(
        f"demand: B / T_train = {inp.batch} / {_num(inp.t_train)} = {_num(required)} admissible "
        f"rollouts/s; with {inp.headroom:.0%} headroom {_num(target)}"
    )
    out.append(
        "per node at T = T_train: ρ = μ·r · g/(g+o) · (1 − d/W) · a, W = max(κ·T, g+o+d), "
        "a = clamp((X − d)/(W − d), 0, 1), X = (S+1)·T − T_train − T_bcast − g − o"
    )
    slack = inp.staleness_bound * inp.t_train - inp.t_bcast
    if slack <= 0:
        out.append(
            f"  STALENESS: S·T_train = {_num(inp.staleness_bound * inp.t_train)} s ≤ T_bcast = "
            f"{_num(inp.t_bcast)} s: at full speed no result arrives within S versions; the "
            "learner slows down until they do (raise S or cut T_bcast)"
        )
    if nodes is None:
        out.append("no --pool given: pass a JSON list of nodes to choose the active set")
        return out, slack > 0
    pipe = Pipeline(inp.batch, inp.t_train, inp.kappa, inp.t_bcast, inp.staleness_bound)
    plan = plan_activation(
        nodes,
        batch=inp.batch,
        t_train=inp.t_train,
        kappa=inp.kappa,
        t_bcast=inp.t_bcast,
        headroom=inp.headroom,
        staleness_bound=inp.staleness_bound,
    )
    out += _sets(plan, nodes, pipe)
    if not inp.activation:
        out.append(
            "note: capacity.activation = false, so the coordinator keeps every node active; "
            "the standby set above is what activation would choose"
        )
    out.append(
        f"predicted learner idle: {plan.predicted_idle:.1%} with the active set (a step every "
        f"{plan.step_period:.4g} s), {plan.pool_idle:.1%} with the whole pool"
    )
    out.append(f"plan: {plan.explanation}")
    return out, plan.meets_rule


def _sets(plan: Plan, nodes: list[NodeCapacity], pipe: Pipeline) -> list[str]:
    by_id = {n.node_id: n for n in nodes}
    out = [f"pool: {len(nodes)} nodes, Σρ = {plan.available:.4g} rollouts/s at T_train"]
    header = (
        f"    {'id':<18} {'μ/s':>7} {'reliab.':>7} {'g s':>6} {'o s':>6} {'d s':>6} "
        f"{'a':>5} {'ρ/s':>8} {'price/h':>7}"
    )

    def row(node: NodeCapacity) -> str:
        price = "free" if node.price_per_hour is None else _num(node.price)
        g = "-" if node.lease_s is None else _num(node.lease_s)
        a = admissible_fraction(node, pipe, pipe.t_train)
        return (
            f"    {node.node_id:<18} {_num(node.rollouts_per_s):>7} "
            f"{_num(node.reliability):>7} {g:>6} {_num(node.overhead_s):>6} "
            f"{_num(node.load_s):>6} {a:>5.2f} {node_rate(node, pipe):>8.4g} {price:>7}"
        )

    out.append(
        f"active ({len(plan.active)}): Σρ = {plan.active_rate:.4g} rollouts/s, "
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
