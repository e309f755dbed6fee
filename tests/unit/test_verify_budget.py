"""The verification budget (issue 35): V measured from re-scores, the demand D of the nodes'
check rates, the rule D <= (1 − h)·V in the plan, new identities admitted at the rate the budget
absorbs (oldest first, admitted nodes never refused), and leases whose submission waits for its
check kept from expiring. Fake clocks, no processes."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from coord_harness import TOK, FakeClock, Harness, advert, submission

from coordinator.admission import ProbationBucket
from coordinator.capacity import plan_activation, verification_rule, with_verification
from coordinator.config import CoordinatorConfig, parse_config
from coordinator.errors import ConfigError, Rejection
from coordinator.leases import LeaseManager
from coordinator.logprobs import LogprobVerdict
from coordinator.sim.base import reference_logprob
from coordinator.sim.verifier import ReferenceVerifier
from coordinator.status import build_status, wire_status
from coordinator.store import Store
from coordinator.trust import Trust
from coordinator.verify_budget import MeteredVerifier, VerificationBudget, VerifierMeter
from coordinator.verifying import VerifyingLeases
from protocol.errors import ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.messages import Ack, Lease

KEY = [bytes([i]) * 32 for i in range(10)]


# --- 1. V: the verifiers' measured throughput -----------------------------------------------------
def test_meter_sums_the_running_means_of_the_verifiers_that_answered_recently() -> None:
    meter = VerifierMeter(window_s=60.0, ewma=0.5)
    assert meter.tokens_per_s(0.0) is None and meter.tokens_per_rollout is None
    meter.record("a", tokens=1000, seconds=1.0, samples=10, now=0.0)  # 1000 tokens/s
    meter.record("a", tokens=3000, seconds=1.0, samples=10, now=10.0)  # mean 0.5·1000 + 0.5·3000
    meter.record("b", tokens=500, seconds=2.0, samples=5, now=30.0)  # 250 tokens/s
    assert meter.tokens_per_s(30.0) == pytest.approx(2000.0 + 250.0, rel=1e-12)
    assert meter.tokens_per_rollout == pytest.approx(4500 / 25, rel=1e-12)
    # a past the window (answered at 10 s): only b counts; both gone: the last one to answer
    assert meter.tokens_per_s(75.0) == pytest.approx(250.0, rel=1e-12)
    assert meter.tokens_per_s(1000.0) == pytest.approx(250.0, rel=1e-12)
    meter.record("c", tokens=100, seconds=0.0, samples=1, now=1000.0)  # no time: no speed
    assert meter.verifiers == 2


class _Counting:
    """A verifier keeping the in-process verifier's counters (``tokens``, ``compute_s``):
    the real one scores on a model; this one passes every check and adds what it is told."""

    def __init__(self, per_call: tuple[int, float]) -> None:
        self.tokens, self.compute_s = 0, 0.0
        self.per_call = per_call

    async def check(self, version: int, prompt_ids: list[list[int]],
                    completions: list[list[int]], claimed: list[list[float]],
                    **_: Any) -> LogprobVerdict:  # fmt: skip
        self.tokens += self.per_call[0]
        self.compute_s += self.per_call[1]
        return LogprobVerdict(True, "max_abs", 0.0, 1.0, "ok")


class _NoCounters:
    """The simulation's reference verifier behind a class that keeps no counters."""

    def __init__(self) -> None:
        self._ref = ReferenceVerifier({}, 64)

    async def check(self, *args: Any, **kwargs: Any) -> LogprobVerdict:
        return await self._ref.check(*args, **kwargs)


def test_metered_verifier_records_the_scoring_counters_else_the_wall_time() -> None:
    meter = VerifierMeter(window_s=60.0, ewma=1.0)
    inner = _Counting((600, 0.2))  # 3,000 tokens/s of scoring, whatever the wall time
    ticks = iter([0.0, 5.0])
    metered = MeteredVerifier(inner, meter, lambda: 7.0, timer=lambda: next(ticks))
    asyncio.run(metered.check(1, [[1, 2]], [[3, 4, 5]], [[-1.0] * 3]))
    assert meter.tokens_per_s(7.0) == pytest.approx(3000.0, rel=1e-12)
    assert meter.tokens_per_rollout == pytest.approx(600.0, rel=1e-12)
    # a verifier without those counters: the call's tokens over its wall time
    meter2 = VerifierMeter(window_s=60.0, ewma=1.0)
    ticks2 = iter([0.0, 0.5])
    plain = MeteredVerifier(_NoCounters(), meter2, lambda: 7.0, timer=lambda: next(ticks2))
    comp = [[3, 4, 5], [6, 7]]
    asyncio.run(plain.check(1, [[1, 2], [1]], comp, [[-0.05] * 3, [-0.05] * 2], dtype="float32"))
    assert meter2.tokens_per_s(7.0) == pytest.approx((5 + 3) / 0.5, rel=1e-12)


def test_tokens_per_rollout_counts_the_samples_of_a_check_whose_tokens_another_read() -> None:
    """Two overlapping re-scores of 8 samples and 400 tokens each, read off the verifier's
    counters: the first call to end reads both calls' tokens and seconds, the second nothing.
    τ is still 800 / 16 = 50 tokens per rollout (it was 100: the second call's samples were
    dropped with its zero tokens, and D, which τ multiplies, doubled), and V 400 / 0.2 s."""
    meter = VerifierMeter(window_s=60.0, ewma=1.0)
    inner = _Counting((0, 0.0))
    metered = MeteredVerifier(inner, meter, lambda: 7.0)
    prompts, comps = [[1, 2]] * 8, [[3, 4, 5]] * 8
    inner.tokens, inner.compute_s = 800, 0.4  # both re-scores ran before either call returned
    asyncio.run(metered.check(1, prompts, comps, [[-1.0] * 3] * 8))
    asyncio.run(metered.check(1, prompts, comps, [[-1.0] * 3] * 8))
    assert meter.tokens_per_rollout == pytest.approx(50.0, rel=1e-12)
    assert meter.tokens_per_s(7.0) == pytest.approx(2000.0, rel=1e-12)


# --- 1. D and the rule D <= (1 − h)·V in the plan -------------------------------------------------
def _cfg(tmp_path: Path, **overrides: Any) -> CoordinatorConfig:
    data: dict[str, Any] = {
        "db_path": str(tmp_path / "s.sqlite"), "group_size": 2,
        "sampling": {"max_new_tokens": 4},
        "leases": {"target_lease_s": 10.0, "max_prompts_per_lease": 3},
        "intake": {"spot_check_fraction": 0.05, "new_node_check_rate": 1.0,
                   "target_forged_share": 0.01},
    }  # fmt: skip
    for k, v in overrides.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return CoordinatorConfig.model_validate(data)


def test_demand_is_check_rate_times_rollout_rate_times_tokens_per_rollout(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    store = Store(cfg.db_path)
    trust = Trust(store, cfg.intake)
    budget = VerificationBudget(cfg, trust=trust, clock=lambda: 0.0,
                                lease_size=lambda tps: 3, checks_on=True)  # fmt: skip
    budget.meter.record("v", tokens=2000, seconds=1.0, samples=100, now=0.0)  # τ = 20
    for _ in range(100):  # node 1 has h = 100 clean leases: rate 1/(1 + 100/100) = 0.5
        trust.accepted(KEY[1], checked=False)
    rows = [
        (KEY[0], None, 10.0, 0.4, 1, 0),  # new: rate 1.0, ρ 0.4
        (KEY[1], None, 10.0, 0.2, 100, 0),  # rate 0.5, ρ 0.2
        (KEY[2], None, 10.0, None, 0, 0),  # not measured: the median measured ρ, 0.4
        (KEY[3], 5.0, 10.0, 1.0, 9, 0),  # on standby: no demand (its ρ is in the median)
    ]
    d = budget.observe(rows, standby=[KEY[3].hex()])
    assert d == pytest.approx((1.0 * 0.4 + 0.5 * 0.2 + 1.0 * 0.4) * 20.0, rel=1e-12)
    assert budget.demand == d and budget.capacity(0.0) == pytest.approx(2000.0)
    # nobody measured: a lease's samples (3 prompts × G 2) over target_lease_s (10 s)
    assert budget.observe([(KEY[4], None, 10.0, None, 0, 0)], ()) == pytest.approx(0.6 * 20.0)


def test_the_plan_carries_the_verification_rule_beside_the_learners() -> None:
    assert verification_rule(80.0, 100.0, 0.2) is True
    assert verification_rule(80.5, 100.0, 0.2) is False
    assert verification_rule(1e9, None, 0.2) is None
    plan = plan_activation([], batch=4, t_train=1.0, kappa=1, t_bcast=0.0)
    over = with_verification(plan, 90.0, 100.0, 0.2)
    assert (over.verify_demand, over.verify_capacity, over.verify_meets) == (90.0, 100.0, False)
    assert over.explanation.startswith(plan.explanation) and "OVER" in over.explanation
    assert with_verification(plan, 10.0, None, 0.2).verify_meets is None


def test_the_coordinators_plan_and_status_show_the_budget(tmp_path: Path) -> None:
    h = Harness(tmp_path, verifier=ReferenceVerifier({}, TOK.vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                verification={"assumed_tokens_per_s": 500.0})  # fmt: skip
    h.publish(1)
    h.node()
    plan = h.core.replan()
    assert plan.verify_capacity == 500.0 and plan.verify_demand is not None
    assert plan.verify_demand > 0 and "verification: demand" in plan.explanation
    doc = build_status(h.core, fingerprint="f", peer_id="p", started_at=0.0, trainer_stats={},
                       broadcast=None)  # fmt: skip
    assert doc["verify_tokens_per_s"] == 500.0 and doc["admission_admitted"] == 1
    assert doc["verify_demand_tokens_per_s"] == pytest.approx(plan.verify_demand)
    wire = wire_status(doc)  # the unsigned rswarm/status: no budget figures (issue 34)
    assert "verify_demand_tokens_per_s" not in wire and "verify_tokens_per_s" not in wire
    assert "policy_version" in wire


# --- 2. admission at the rate the budget absorbs, oldest first ------------------------------------
def test_bucket_admits_oldest_first_at_its_refill_rate() -> None:
    b = ProbationBucket(burst=2, retry_s=30.0, max_waiting=100)
    assert b.take(KEY[0], 0.0, per_s=0.5, room=10) is None  # the burst: two at once
    assert b.take(KEY[1], 0.0, per_s=0.5, room=10) is None
    wait = b.take(KEY[2], 0.0, per_s=0.5, room=10)  # empty: a token in 1 / 0.5 = 2 s
    assert wait == pytest.approx(2.0)
    assert b.take(KEY[3], 0.5, per_s=0.5, room=10) == pytest.approx((2 - 0.25) / 0.5)
    assert b.position(KEY[3]) == 1 and b.waiting == 2
    # at 2 s there is one token: it is KEY[2]'s (older), not KEY[3]'s, though KEY[3] asks first
    assert b.take(KEY[3], 2.0, per_s=0.5, room=10) is not None
    assert b.take(KEY[2], 2.0, per_s=0.5, room=10) is None
    assert b.take(KEY[3], 4.0, per_s=0.5, room=10) is None and b.waiting == 0


def test_bucket_without_room_refuses_for_retry_s_and_lapsed_places_free_the_queue() -> None:
    b = ProbationBucket(burst=4, retry_s=30.0, max_waiting=1)
    assert b.take(KEY[0], 0.0, per_s=1.0, room=0.5) == 30.0  # tokens, but no room in the budget
    assert b.take(KEY[1], 0.0, per_s=1.0, room=0.5) == 30.0  # the queue (1 place) is full
    assert b.position(KEY[0]) == 0 and b.position(KEY[1]) is None
    # KEY[0] never comes back: its place lapses 30 s past its told time; then KEY[1] is first
    assert b.take(KEY[1], 61.0, per_s=1.0, room=5.0) is None and b.waiting == 0


def test_registrations_beyond_the_spare_budget_are_refused_oldest_first(tmp_path: Path) -> None:
    clock = FakeClock()
    # V = 1000 tokens/s assumed, h = 0.2: 800 spare. A newcomer at rate 1.0 with ρ = 3 prompts ×
    # G 2 / 10 s = 0.6 rollouts/s and τ = 4 (max_new_tokens, nothing re-scored yet) adds 2.4:
    # room for 333; the bucket's 2 tokens refill at 800 / (6 samples × 4) = 33.3 a second.
    h = Harness(tmp_path, clock=clock, verifier=ReferenceVerifier({}, TOK.vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                leases={"target_lease_s": 10.0},
                verification={"assumed_tokens_per_s": 1000.0, "admission_burst": 2,
                              "admission_min_nodes": 0})  # fmt: skip
    ids = [h.node(), h.node()]
    with pytest.raises(Rejection) as refused:
        h.node()
    assert refused.value.code is ReasonCode.SWARM_FULL
    assert refused.value.retry_after_s == pytest.approx(1.0)  # at least a second
    assert "place 1 in the queue" in refused.value.detail
    # an admitted node registering again is never refused for the budget
    h.core.register(ids[0].public_key, advert(ids[0], clock()))
    clock.advance(1.0)
    h.node()  # a token came back
    # the budget full: D at the next re-plan counts everyone; no room for one more
    h.core.budget.planned_demand = 800.0
    with pytest.raises(Rejection) as full:
        h.node()
    assert full.value.retry_after_s == 30.0 and h.core.budget.refused == 2


def test_a_vouched_node_skips_admission_and_probation(tmp_path: Path) -> None:
    """The operator's own machines (``intake.vouched_nodes``): admitted while the budget refuses
    every newcomer, held to the floor from the first lease, booked at the floor in D. Its
    receipt says it was vouched for. Once struck it earns its rate back like any other node, and
    registering again does not restore the vouch."""
    clock = FakeClock()
    own = Identity.generate()
    fp = fingerprint_of(own.public_key)
    h = Harness(tmp_path, clock=clock, verifier=ReferenceVerifier({}, TOK.vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0,
                        "vouched_nodes": [fp.upper().removeprefix("ED25519:")]},
                verification={"assumed_tokens_per_s": 1000.0, "admission_burst": 1,
                              "admission_min_nodes": 0})  # fmt: skip
    h.core.budget.planned_demand = 800.0  # the budget is full: no stranger gets in
    with pytest.raises(Rejection) as refused:
        h.node()
    assert refused.value.code is ReasonCode.SWARM_FULL
    h.core.register(own.public_key, advert(own, clock()))
    trust = Trust(h.store, h.cfg.intake)
    assert trust.rate(own.public_key) == pytest.approx(0.05)
    assert trust.obligation(own.public_key).checks_to_floor == 0.0
    assert h.core.budget.admitted == 0 and h.core.budget.refused == 1
    entry = [e for e in h.core.receipts.entries() if e.kind == "register"][-1]
    assert entry.data()["node"] == fp and entry.data()["vouched"] is True
    trust.struck(own.public_key)
    h.store.add_strike(own.public_key, "bad_logprobs", "", clock())
    h.core.register(own.public_key, advert(own, clock()))
    assert trust.rate(own.public_key) == 1.0 and trust.is_suspect(own.public_key)


def test_a_malformed_vouched_fingerprint_is_refused_with_its_place(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"intake.vouched_nodes\[1\]: 'zz' is not a node fing"):
        parse_config({"intake": {"vouched_nodes": [fingerprint_of(KEY[0]), "zz"]}})


def test_without_a_verifier_or_a_known_v_nobody_is_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path, intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                verification={"assumed_tokens_per_s": 1.0, "admission_burst": 1,
                              "admission_min_nodes": 0})  # fmt: skip
    for _ in range(3):  # no verifier: nothing is re-scored, nothing to budget
        h.node()
    g = Harness(tmp_path / "g", verifier=ReferenceVerifier({}, TOK.vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                verification={"admission_burst": 1, "admission_min_nodes": 0})  # fmt: skip
    for _ in range(3):  # V neither measured nor assumed
        g.node()


# --- 3. a lease does not expire while its submission waits for its check --------------------------
def _lease_book(tmp_path: Path, clock: FakeClock) -> tuple[LeaseManager, VerifyingLeases, Store]:
    cfg = _cfg(tmp_path)
    store = Store(cfg.db_path)
    verifying = VerifyingLeases()
    leases = LeaseManager(
        store, cfg.leases, clock=clock, group_size=2, max_new_tokens=4, verifying=verifying.holds
    )
    return leases, verifying, store


def test_expiry_skips_a_lease_whose_submission_arrived_before_the_deadline(tmp_path: Path) -> None:
    clock = FakeClock()
    leases, verifying, store = _lease_book(tmp_path, clock)
    kept = leases.issue(KEY[0], version=1, tokens_per_s=100.0)
    silent = leases.issue(KEY[1], version=1, tokens_per_s=100.0)
    late = leases.issue(KEY[2], version=1, tokens_per_s=100.0)
    forged = leases.issue(KEY[3], version=1, tokens_per_s=100.0)
    verifying.arrive(kept.lease_id, KEY[0], clock())  # in verification, arrived in time
    verifying.arrive(forged.lease_id, KEY[9], clock())  # another node's mark holds nothing
    clock.advance(late.deadline - clock() + 1.0)
    verifying.arrive(late.lease_id, KEY[2], clock())  # arrived after its deadline
    expired = {lease.lease_id for lease in leases.expire_due()}
    assert expired == {silent.lease_id, late.lease_id, forged.lease_id}
    assert store.get_lease(kept.lease_id).state == "active"  # type: ignore[union-attr]
    assert verifying.held == 1
    verifying.done(kept.lease_id, KEY[0])  # the verdict: the hold ends with it
    assert [lease.lease_id for lease in leases.expire_due()] == [kept.lease_id]


def test_the_coordinators_lease_book_sees_the_budgets_verification_marks(tmp_path: Path) -> None:
    """The composed coordinator: one VerifyingLeases shared by the budget (which marks a
    submission in verification) and the lease book (whose expiry it holds). An empty one is falsy
    (it has __len__), so `verifying or VerifyingLeases()` gave the budget a second, unshared one
    and leases expired while their check queued (the simulation's doc check: stale_epoch)."""
    h = Harness(tmp_path, verifier=ReferenceVerifier({}, TOK.vocab_size))
    h.publish(1)
    ident = h.node()
    lease = h.lease(ident)
    with h.core.budget.verifying.waiting(lease.lease_id, ident.public_key, h.clock()):
        h.clock.advance(lease.deadline - h.clock() + 1.0)
        assert lease.lease_id not in {r.lease_id for r in h.core.leases.expire_due()}
    assert [r.lease_id for r in h.core.leases.expire_due()] == [lease.lease_id]


class _SlowVerifier(ReferenceVerifier):
    """The simulation's reference verifier, whose check lets ``busy_s`` pass on the coordinator's
    clock while ``meanwhile`` runs (the upkeep and other nodes' requests, as the event loop runs
    them while a check is awaited)."""

    def __init__(self, clock: FakeClock, busy_s: float) -> None:
        super().__init__({}, TOK.vocab_size)
        self.clock, self.busy_s = clock, busy_s
        self.meanwhile: Any = None

    async def check(self, *args: Any, **kwargs: Any) -> LogprobVerdict:
        self.clock.advance(self.busy_s)
        self.charge(sum(len(p) + len(c) for p, c in zip(args[1], args[2], strict=True)),
                    self.busy_s)  # fmt: skip
        if self.meanwhile is not None:
            self.meanwhile()
        return await super().check(*args, **kwargs)


@pytest.mark.parametrize("hold", [True, False])
def test_an_honest_submission_checked_past_its_deadline_is_accepted(
    tmp_path: Path, hold: bool
) -> None:
    """Before issue 34's deferred re-score, without the hold the lease expired while its
    submission was re-scored, its prompts went to another node and the honest work was refused
    stale_epoch (the simulation's finding). The re-score now runs after the ack, which completes
    the lease first: with or without the hold, a slow check cannot expire it, and nothing had
    to be held."""
    clock = FakeClock()
    verifier = _SlowVerifier(clock, busy_s=100.0)
    h = Harness(tmp_path, clock=clock, verifier=verifier,
                intake={"spot_check_fraction": 1.0, "new_node_check_rate": 1.0},
                verification={"hold_verifying_leases": hold})  # fmt: skip
    h.publish(1)
    a, b = h.node(), h.node()
    lease = h.lease(a)
    assert lease.deadline - clock() < verifier.busy_s
    lps = [[[reference_logprob(1, p, t) for p, t in enumerate(answer)] for _ in range(2)]
           for answer in ([*reversed(_text(lease, i)), TOK.eos_token_id]
                          for i in range(len(lease.prompts)))]  # fmt: skip
    sub = submission(lease, logprobs=lps)
    other: list[Any] = []

    def meanwhile() -> None:  # the upkeep's tick, and another node asking for work
        h.core.tick()
        other.append(h.core.request_lease(b.public_key, _request()))

    verifier.meanwhile = meanwhile
    verdict = asyncio.run(h.core.submit(a.public_key, sub, clock() - 1.0))
    assert isinstance(verdict, Ack), verdict
    ids = {p.prompt_id for p in lease.prompts}  # the other node got none of its prompts
    assert isinstance(other[0], Lease) and not {p.prompt_id for p in other[0].prompts} & ids
    assert h.core.budget.verifying.held == 0 and len(h.core.budget.verifying) == 0
    assert h.core.budget.meter.samples > 0  # the re-score was metered


def _text(lease: Lease, i: int) -> list[int]:
    from protocol.messages import unpack_tokens

    return unpack_tokens(lease.prompts[i].token_ids)[1:-1]


def _request() -> Any:
    from protocol.messages import LeaseRequest

    return LeaseRequest(peer_id="peer", policy_version=1, max_prompts=3)


def test_budget_figures_are_finite_numbers(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, verification={"assumed_tokens_per_s": 100.0})
    trust = Trust(Store(cfg.db_path), cfg.intake)
    budget = VerificationBudget(
        cfg, trust=trust, clock=lambda: 0.0, lease_size=lambda tps: 1, checks_on=True
    )
    doc = budget.status()
    assert doc["verify_budget_tokens_per_s"] == pytest.approx(80.0)
    assert all(not isinstance(v, float) or math.isfinite(v) for v in doc.values())


def test_a_small_swarm_admits_every_newcomer_whatever_the_budget(tmp_path: Path) -> None:
    """Below ``admission_min_nodes`` registered nodes the budget refuses nobody (a small swarm's
    verifier is the coordinator itself); from there on it limits admission as before."""
    h = Harness(tmp_path, verifier=ReferenceVerifier({}, TOK.vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                verification={"assumed_tokens_per_s": 1.0, "admission_burst": 1,
                              "admission_min_nodes": 3})  # fmt: skip
    for _ in range(3):  # whatever the budget says, all three are admitted
        h.node()
    assert h.core.budget.admitted == 3 and h.core.budget.pending_demand > 0
    h.core.budget.planned_demand = 1e9  # the verifiers are saturated: no room at all
    with pytest.raises(Rejection) as refused:  # the 4th meets the budget
        h.node()
    assert refused.value.code is ReasonCode.SWARM_FULL
