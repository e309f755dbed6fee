"""``swarm simulate`` with the verification budget (issue 35): a pool that joins at once no longer
saturates the verifiers until honest leases expire in the queue (``stale_epoch`` refusals of
honest work), and the coordinator's measured V is the throughput the simulation charges."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.sim.catalogue import load_catalogue
from coordinator.sim.costs import RECORDED
from coordinator.sim.results import RunResult, collect
from coordinator.sim.runner import build_pool, provision, run_one
from coordinator.sim.scenario import parse_scenario
from coordinator.sim.world import World

CATALOGUE = load_catalogue()

#: 30 nodes join within 10 s for 5 simulated minutes, one verifier GPU at 50 TFLOP/s: every new
#: node's lease is re-scored (probation), ~4x what one verifier absorbs. No churn and no cheats:
#: every refused submission is honest work lost. A re-plan every 30 s keeps the test at ~1 s of
#: CPU per run (the planner's fluid model is most of a run's time).
JOIN: dict[str, Any] = {
    "name": "join", "nodes": 30, "hours": 5 / 60, "warmup_minutes": 1.0, "seed": 3,
    "model": {"params_b": 4.0, "version_fraction": 0.02, "completion_tokens_mean": 2048,
              "completion_tokens_max": 8192, "load_s": 2.0},
    "learner": {"batch_rollouts": 512, "group_size": 8, "step_s": 16.0, "staleness_bound": 4},
    "churn": {"per_hour": 0.0, "ramp_s": 10.0},
    "byzantine": {"fraction": 0.0},
    "verification": {"workers": 1, "verifier_tflops": 50.0},
    # the budget limits admission from the first node (by default only from 32 registered)
    "coordinator": {"capacity": {"replan_interval_s": 30.0},
                    "verification": {"admission_min_nodes": 0}},
}  # fmt: skip
#: the coordinator before issue 35: no admission limit, leases expire while their check queues
WITHOUT = {"verification": {"admission": False, "hold_verifying_leases": False}}


def _run_with_budget() -> tuple[RunResult, dict[str, Any]]:
    sc = parse_scenario(JOIN)
    pool = provision("all_nodes", build_pool(sc, CATALOGUE), sc)
    world = World(sc, "all_nodes", pool, RECORDED)
    try:
        world.run()
        budget = world.core.budget
        seen = {
            "v": budget.capacity(),
            "charged": world.verify_tokens_per_s(),
            "measured": budget.meter.tokens_per_s(world.clock()) is not None,
            "refused": world.stats.registrations_refused,
        }
        return collect(world, "budget", 0.0, 0.0), seen
    finally:
        world.close()


def test_a_joining_pool_no_longer_makes_honest_leases_expire() -> None:
    without = run_one(
        parse_scenario({**JOIN, "coordinator": {**JOIN["coordinator"], **WITHOUT}}),
        "all_nodes", CATALOGUE, RECORDED,
    )  # fmt: skip
    with_budget, seen = _run_with_budget()
    # without: the verifier's queue holds submissions for a minute and more; their leases expire
    # meanwhile, are re-issued, and the honest results are refused stale_epoch
    assert without.verdicts.get("stale_epoch", 0) >= 5, without.verdicts
    assert without.queue_wait_mean_s > 30.0
    # with: newcomers wait for the budget (refused swarm_full, told when to come back) and
    # nothing honest is refused; the queue stays short and no less work is accepted
    assert with_budget.verdicts.get("stale_epoch", 0) == 0, with_budget.verdicts
    assert set(with_budget.verdicts) == {"ack"}, with_budget.verdicts
    assert seen["refused"] > 0
    assert with_budget.queue_wait_mean_s < 0.2 * without.queue_wait_mean_s
    assert with_budget.accepted >= 0.9 * without.accepted
    for r in (without, with_budget):
        broken = {k: d for k, (ok, d) in r.invariants.items() if not ok}
        assert not broken, broken
    # V is the throughput the simulation charges: measured from the same simulated seconds
    # (a constant rate, so the running mean equals it up to float rounding)
    assert seen["measured"]
    assert seen["v"] == pytest.approx(seen["charged"], rel=1e-9)
