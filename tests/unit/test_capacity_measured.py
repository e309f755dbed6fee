"""The capacity rule against measured behaviour: the learner's idle fraction measured in a
simulated pipeline around the real coordinator core (tests/unit/pipeline_sim.py: real leases,
intake, staleness refusals, rollout feed, per-node measurements and plan) against the idle
fraction the coordinator's own plan predicts from what it measured. Nothing here evaluates the
formula; the real-process validation (``swarm demo`` runs) is ``bench/capacity.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from pipeline_sim import SimLearner, SimNode, simulate

#: the target of the capacity issue: prediction within 5 percentage points of the measurement
TOLERANCE = 0.05

CASES: dict[str, tuple[Any, ...]] = {
    # two nodes short of B/T_train; round trips (o) and version loads (d) both cost
    "short, loads and round trips": (
        [SimNode("a", 200.0, 0.05, 0.2), SimNode("b", 150.0, 0.05, 0.2)],
        SimLearner(batch=256, t_train=0.5, kappa=1, staleness_bound=2, t_bcast=0.1),
    ),
    # the regime: T_bcast ≈ κ·T_train, where κB/(κT_train − T_bcast) explodes
    "T_bcast near κ·T_train": (
        [SimNode(f"n{i}", 250.0, 0.05, 0.05) for i in range(3)],
        SimLearner(batch=256, t_train=0.22, kappa=1, staleness_bound=2, t_bcast=0.196),
    ),
    # S = 1: part of every version's results arrives too late
    "staleness bites (S = 1)": (
        [SimNode(f"n{i}", 300.0, 0.1, 0.1) for i in range(3)],
        SimLearner(batch=256, t_train=0.5, kappa=1, staleness_bound=1, t_bcast=0.2),
    ),
    # κ = 3, S = 4, slow dissemination and long loads
    "κ = 3, slow loads": (
        [SimNode(f"n{i}", 100.0, 0.3, 0.5) for i in range(4)],
        SimLearner(batch=256, t_train=0.5, kappa=3, staleness_bound=4, t_bcast=1.0),
    ),
    # a version load delays a node's results as well as costing it time: fast nodes whose loads
    # eat most of the S = 1 slack (a rule that counts d_i only as lost time predicts 11 % idle
    # here, where the learner waits 20 %)
    "loads are age (S = 1)": (
        [SimNode(f"n{i}", 2000.0, 0.05, 0.2) for i in range(4)],
        SimLearner(batch=256, t_train=0.3, kappa=1, staleness_bound=1, t_bcast=0.1),
    ),
    # κ = S − 1 with fast nodes: on average the pool keeps up (the mean rule: 3 % idle), but the
    # step after a version expires can train on the next published one only, whose first B
    # rollouts take T_bcast + d + g + o + B/rate; the learner waits there every κ steps
    "hand-over (κ = 3, S = 4)": (
        [SimNode(f"n{i}", 2000.0, 0.1, 0.2) for i in range(3)],
        SimLearner(batch=256, t_train=0.3, kappa=3, staleness_bound=4, t_bcast=0.4),
    ),
    # κ = 1, rollouts that arrive in the last step before they expire (the demo's regime): a
    # step run at full speed leaves a thin version, a wait a fat one whose surplus expires;
    # the mean rule predicts 21 % idle where the learner waits 31 %
    "thin and fat versions (κ = 1)": (
        [SimNode(f"n{i}", 1600.0, 0.1, 0.18) for i in range(3)],
        SimLearner(batch=256, t_train=0.3, kappa=1, staleness_bound=2, t_bcast=0.35),
    ),
    # a learner whose steps vary ±80 % (a shared machine): with steady 0.45 s steps this pool
    # keeps it busy (0.1 % idle), but a short step outruns the rollouts of the next one and the
    # learner waits 17 % of the time; the rule sees it through the trainer's t_train_cv
    "a learner whose steps vary": (
        [SimNode(f"n{i}", 1600.0, 0.1, 0.18) for i in range(3)],
        SimLearner(
            batch=256, t_train=0.45, kappa=1, staleness_bound=2, t_bcast=0.35, t_train_jitter=0.8
        ),
    ),
    # generation times that vary ±60 % from lease to lease (a shared CPU): μ_i must be samples
    # over generation seconds (a ratio of means); a mean of each lease's rate overstates it
    # (E[n/g] > n/E[g]) and predicted 16 % idle where the learner waits 30 %. A slow running
    # mean (0.05) so that the test sees the estimator's bias, not its noise.
    "noisy generation times": (
        [SimNode(f"n{i}", 300.0, 0.05, 0.05) for i in range(2)],
        SimLearner(batch=256, t_train=0.4, kappa=1, staleness_bound=4, t_bcast=0.1),
        {"jitter": 0.6, "ewma": 0.05},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_predicted_idle_matches_the_measured_idle(case: str) -> None:
    nodes, learner, *extra = CASES[case]
    options = extra[0] if extra else {}
    result = simulate(nodes, learner, seconds=30.0, warmup=8.0, max_prompts=8, **options)
    assert result.steps > 10
    assert result.measured_idle > 0.15  # a real shortage to predict, not 0 against 0
    assert result.predicted_idle == pytest.approx(result.measured_idle, abs=TOLERANCE), result


@pytest.mark.slow
def test_a_pool_meeting_the_rule_with_headroom_keeps_the_learner_busy() -> None:
    """Activation on: free volunteers plus priced nodes; the planner stands the expensive ones
    by (measured rates), and the learner still waits less than 5% of the time."""
    nodes = [SimNode(f"free{i}", 300.0, 0.05, 0.1) for i in range(2)]
    nodes += [SimNode(f"paid{i}", 300.0, 0.05, 0.1, price=1.0 + i) for i in range(4)]
    learner = SimLearner(batch=256, t_train=0.5, kappa=1, staleness_bound=2, t_bcast=0.1)
    result = simulate(nodes, learner, seconds=30.0, warmup=8.0, max_prompts=8, activation=True)
    assert result.standby >= 1 and result.predicted_idle == 0.0, result
    assert result.measured_idle <= TOLERANCE, result
    # the most expensive node is the one left out
    assert next(n for n in nodes if n.name == "paid3").standby_answers > 0
