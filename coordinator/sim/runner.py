"""Pools, provisioning policies and the list of runs of a scenario.

* The pool is drawn once per scenario seed: GPU kinds by ``mix`` (largest remainders), per-node
  throughput noise, links, prices (a ``volunteer_fraction`` of consumer nodes ask none) and the
  cheaters; every policy starts from the same draws.
* ``cost_aware``: the whole pool registers, the coordinator's planner (``capacity.activation``)
  decides who works. ``all_nodes``: the whole pool, activation off. ``fastest_first`` and
  ``premium_only`` are provisioning baselines: nodes are rented in that order (fastest first; only
  datacenter GPUs, cheapest per rollout first) until their nominal rate reaches the planner's own
  target (``Plan.required`` with headroom, computed by :func:`coordinator.capacity.plan_activation`
  on the nominal rates), then run with activation off. ``premium_colocated`` rents what
  ``premium_only`` rents as the learner's own cluster (ECHO-2's centralized baseline): trusted
  (no cheater among them, nothing re-scored, no probation, no verifier billed).
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from coordinator.capacity import NodeCapacity, plan_activation
from coordinator.sim.base import PoolNode
from coordinator.sim.calibration import Calibration
from coordinator.sim.catalogue import GpuKind
from coordinator.sim.costs import Figures
from coordinator.sim.network import draw_link
from coordinator.sim.results import RunResult, collect
from coordinator.sim.scenario import Policy, Scenario, ScenarioError
from coordinator.sim.world import World


def build_pool(scenario: Scenario, catalogue: dict[str, GpuKind]) -> list[PoolNode]:
    rng = random.Random(scenario.seed)
    unknown = [k for k in scenario.mix if k not in catalogue]
    if unknown:
        raise ScenarioError(
            f"mix: unknown GPU kind(s) {', '.join(unknown)}; the catalogue has "
            f"{', '.join(sorted(catalogue))}"
        )
    size = scenario.model.params_b
    kinds = [(catalogue[k], v) for k, v in sorted(scenario.mix.items()) if v > 0]
    fits = [(k, v) for k, v in kinds if k.tokens_per_s(size) > 0]
    if not fits:
        raise ScenarioError(f"mix: no GPU kind of the mix fits a {size:g}B model")
    total = sum(v for _, v in fits)
    exact = [(k, scenario.nodes * v / total) for k, v in fits]
    counts = {k.name: math.floor(x) for k, x in exact}
    rest = scenario.nodes - sum(counts.values())
    by_remainder = sorted(exact, key=lambda kx: (-(kx[1] - math.floor(kx[1])), kx[0].name))
    for kind, _ in by_remainder[:rest]:
        counts[kind.name] += 1
    pool: list[PoolNode] = []
    for kind, _ in fits:
        link_spec = (
            scenario.network.consumer if kind.klass == "consumer" else scenario.network.datacenter
        )
        for _ in range(counts[kind.name]):
            tps = kind.tokens_per_s(size) * math.exp(rng.gauss(0.0, scenario.throughput_sigma))
            volunteer = kind.klass == "consumer" and rng.random() < scenario.volunteer_fraction
            price = None if volunteer else kind.price_per_hour
            pool.append(PoolNode(kind, price, tps, draw_link(rng, link_spec), None))
    rng.shuffle(pool)
    b = scenario.byzantine
    n_cheat = round(b.fraction * len(pool))
    share = b.garbage / (b.garbage + b.forger) if b.garbage + b.forger > 0 else 1.0
    for i in rng.sample(range(len(pool)), n_cheat):
        cheat = "garbage" if rng.random() < share else "forger"
        p = pool[i]
        pool[i] = PoolNode(p.gpu, p.price, p.tps, p.link, cheat)
    return pool


def nominal_rate(node: PoolNode, scenario: Scenario) -> float:
    """Rollouts per second the catalogue promises for this node."""
    return node.tps / scenario.model.completion_tokens_mean


def planner_target(pool: list[PoolNode], scenario: Scenario, headroom: float) -> tuple[float, str]:
    """The planner's rate target (rollouts/s, headroom included) on nominal rates."""
    lrn = scenario.learner
    m = scenario.model
    t_bcast = (
        m.checkpoint_bytes * m.version_fraction / (scenario.network.coordinator_mbit * 1e6 / 8)
    )
    rates = [nominal_rate(p, scenario) for p in pool]
    plan = plan_activation(
        [
            NodeCapacity(str(i), r, p.price)
            for i, (p, r) in enumerate(zip(pool, rates, strict=True))
        ],
        batch=lrn.batch_rollouts,
        t_train=lrn.step_s,
        kappa=lrn.kappa,
        t_bcast=t_bcast,
        headroom=headroom,
        staleness_bound=lrn.staleness_bound,
        t_gen=lrn.group_size * m.completion_tokens_max / max(1e-9, min(p.tps for p in pool)),
    )
    if math.isfinite(plan.required):
        return plan.required * (1 + headroom), plan.explanation
    demand = lrn.batch_rollouts / lrn.step_s * (1 + headroom)
    return demand, f"{plan.explanation} (baselines sized to B/T_train with headroom instead)"


def provision(policy: Policy, pool: list[PoolNode], scenario: Scenario) -> list[PoolNode]:
    """The nodes a policy rents."""
    if policy in ("cost_aware", "all_nodes"):
        return list(pool)
    headroom = float(scenario.coordinator.get("capacity", {}).get("headroom", 0.2))
    target, _ = planner_target(pool, scenario, headroom)
    if policy == "premium_colocated":  # premium_only's nodes, the operator's own: no cheater
        return [replace(p, cheat=None) for p in provision("premium_only", pool, scenario)]
    if policy == "fastest_first":
        order = sorted(pool, key=lambda p: -nominal_rate(p, scenario))
    else:
        premium = [p for p in pool if p.gpu.premium]
        order = sorted(premium, key=lambda p: (p.price or 0.0) / nominal_rate(p, scenario))
    chosen: list[PoolNode] = []
    rate = 0.0
    for node in order:
        if rate >= target:
            break
        chosen.append(node)
        rate += nominal_rate(node, scenario)
    return chosen


def run_one(
    scenario: Scenario,
    policy: Policy,
    catalogue: dict[str, GpuKind],
    figures: Figures,
    *,
    label: str = "base",
    calibration: Calibration | None = None,
) -> RunResult:
    pool = provision(policy, build_pool(scenario, catalogue), scenario)
    if not pool:
        raise ScenarioError(f"policy {policy}: the pool has no node to rent")
    hours = scenario.policy_hours.get(policy, scenario.hours)
    world = World(scenario, policy, pool, figures, hours=hours, calibration=calibration)
    quiet = logging.getLogger("coordinator")  # bans and expiries by the thousand: not news here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        world.run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return collect(world, label, wall, cpu)
    finally:
        quiet.setLevel(level)
        world.close()


def plan_runs(scenario: Scenario) -> list[tuple[str, Policy, Scenario]]:
    """(label, policy, scenario) of every run: the policies at the base point, then each sweep
    value alone with ``cost_aware``."""
    runs: list[tuple[str, Policy, Scenario]] = [("base", p, scenario) for p in scenario.policies]
    for key, values in scenario.sweep.items():
        for value in values:
            variant = scenario.with_values({key: value, "sweep": {}})
            runs.append((f"{key}={value}", "cost_aware", variant))
    return runs


def run_scenario(
    scenario: Scenario,
    catalogue: dict[str, GpuKind],
    figures: Figures,
    *,
    calibration: Calibration | None = None,
    only: Callable[[str, Policy], bool] | None = None,
    log: Callable[[str], None] | None = None,
    on_result: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:
    """Every run of the scenario in turn; ``on_result`` sees the results so far after each one
    (the CLI writes its report then, so a long scenario interrupted keeps what it finished)."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    results = []
    runs = [r for r in plan_runs(scenario) if only is None or only(r[0], r[1])]
    for i, (label, policy, variant) in enumerate(runs, 1):
        say(f"[{scenario.name}] run {i}/{len(runs)}: {policy} {label} ...")
        res = run_one(variant, policy, catalogue, figures, label=label, calibration=calibration)
        bad = [k for k, (ok, _) in res.invariants.items() if not ok]
        say(
            f"[{scenario.name}]   {res.hours:g} h simulated in {res.wall_s:.1f} s wall "
            f"({res.sim_hours_per_wall_minute:.2f} sim-h/min), accepted {res.accepted}, "
            f"trained {res.trained}, ${res.cost_per_accepted:.4g}/accepted, idle "
            f"{res.learner_idle:.1%}, invariants {'ok' if not bad else 'BROKEN: ' + ', '.join(bad)}"
        )
        results.append(res)
        if on_result is not None:
            on_result(results)
    return results
