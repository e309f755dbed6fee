"""The backlog bound (``leases.max_backlog_steps``): once a learner has reported, a node is stood
by while the rollouts ahead of a new lease's in the learner's queue that it will still train
(accepted and waiting, then in flight) leave no room for the new lease's to be trained:
(S + 1 − lag) · B of them, ``lag`` the versions the learner is ahead of the newest published.
What the learner consumes, what goes stale and a new version free it."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_harness import Harness, submission

from coordinator.activation import WANTING_FRESH_S
from coordinator.lease_desk import BACKLOG_READ_S
from coordinator.leases import Backlog, backlog_bound, runs_of, trainable
from protocol.identity import Identity
from protocol.messages import Ack, Lease, LeaseRequest, Standby

G, S, B = 2, 2, 4  # harness: group size 2, staleness bound 2; the learner reports B = 4


def _ask(h: Harness, node: Identity) -> Lease | Standby:
    h.clock.advance(BACKLOG_READ_S)  # past the reuse of the last backlog read
    out = h.core.request_lease(
        node.public_key, LeaseRequest(peer_id="peer", policy_version=1, max_prompts=3)
    )
    assert isinstance(out, Lease | Standby), out
    return out


async def _deliver(h: Harness, node: Identity, lease: Lease) -> None:
    assert isinstance(await h.core.submit(node.public_key, submission(lease)), Ack)


def test_the_bound_is_s_plus_one_minus_the_lag_steps_of_b() -> None:
    assert backlog_bound(None, S, B) == (S + 1) * B
    assert backlog_bound(None, S, B, lag=1) == S * B  # the learner a version ahead
    assert backlog_bound(None, S, B, lag=S + 1) == 0  # a new lease's would be stale on arrival
    assert backlog_bound(1.5, S, B) == 6.0  # leases.max_backlog_steps caps it
    assert backlog_bound(10.0, S, B) == (S + 1) * B  # but never lets in what goes stale
    assert backlog_bound(None, S, 0) == S + 1  # B is at least 1
    assert not Backlog(11, 12.0).full and Backlog(12, 12.0).full
    assert "12 rollouts the learner will train are ahead" in Backlog(12, 12.0).reason()


def test_trainable_follows_the_learners_queue() -> None:
    # learner at version 10, S = 2, B = 4: the n-th trainable rollout is reached at 10 + n // 4
    assert trainable([(10, 20)], 10, 2, 4, 100) == 12  # 3 steps of version 10, then stale
    assert trainable([(8, 20)], 10, 2, 4, 100) == 4  # version 8: the first step only
    assert trainable([(8, 4), (12, 20)], 10, 2, 4, 100) == 4 + 16  # newer ones last longer
    assert trainable([(7, 8), (10, 8)], 10, 2, 4, 100) == 8  # the stale ones take no step
    assert trainable([(10, 5), (10, 5)], 10, 2, 4, 5) == 5  # counted up to the limit
    assert trainable([], 10, 2, 4, 5) == 0
    assert runs_of([1, 1, 2, 2, 2, 1]) == [(1, 2), (2, 3), (1, 1)]
    assert runs_of([]) == []


async def test_nodes_stand_by_while_the_queue_is_full_and_lease_again_as_it_drains(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    # no learner has reported: nothing bounds the leases (a coordinator without a trainer)
    leases = [h.lease(node) for _ in range(2)]
    for lease in leases:
        assert len(lease.prompts) * G == 6
        await _deliver(h, node, lease)
    assert isinstance(_ask(h, node), Lease)  # 12 accepted, 6 in flight: still no bound
    # the learner reports (B = 4, step 1 = the newest version): bound (S + 1) · B = 12; 12 of
    # the 18 (accepted first, then in flight) it will train are ahead
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby), out
    assert "12 rollouts the learner will train are ahead of a new lease's (bound 12)" in out.reason
    assert 1.0 <= out.retry_after_s <= h.cfg.heartbeat_interval_s
    # it trained the first 4 (step 2, cursor at seq 4) and v2 is not out yet: a lease would
    # name v1, a version behind the learner, and only S steps of it remain: still full
    h.core.feed.learner_report(2, 4, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby) and "(bound 8)" in out.reason, out
    h.publish(2)  # new leases name v2: room for (S + 1) · B again, 8 of v1 still ahead
    assert isinstance(_ask(h, node), Lease)


async def test_leases_in_flight_count_at_their_version(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    assert isinstance(_ask(h, node), Lease)  # 6 in flight
    assert isinstance(_ask(h, node), Lease)  # 12 in flight: full
    out = _ask(h, node)
    assert isinstance(out, Standby) and "12 rollouts" in out.reason, out
    h.publish(2)
    h.publish(3)
    h.publish(4)  # the learner's version 4 (the newest): v1's leases would land stale
    h.clock.advance(BACKLOG_READ_S)
    assert h.core.lease_desk.backlog(4) == Backlog(0, 12.0)
    assert isinstance(_ask(h, node), Lease)


@pytest.mark.parametrize("steps", [1.0, 100.0])
async def test_the_configured_number_of_steps_caps_the_bound(tmp_path: Path, steps: float) -> None:
    h = Harness(tmp_path, leases={"max_backlog_steps": steps})
    h.publish(1)
    node = h.node()
    await _deliver(h, node, h.lease(node))  # 6 waiting
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby) == (min(steps, S + 1) * B <= 6), out


async def test_a_learner_blocked_for_rollouts_is_fed_though_the_queue_looks_full(
    tmp_path: Path,
) -> None:
    """The SmolLM2 S = 0 run of 2026-12-05 stood still for good after 15 steps: the queue held
    more rollouts than the bound, the learner dropped most (stale at its S, or groups of equal
    reward) and waited for one more group, and the bound stood the only node by. A learner that
    says it is blocked (``rollouts_wanted``, with each fetch) is fed."""
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    for _ in range(2):
        await _deliver(h, node, h.lease(node))  # 12 accepted, seqs 1..12
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby) and "(bound 12)" in out.reason, out  # the deadlock's half
    # the learner fetched all 12, kept what it trains and is blocked for 4 more
    h.core.learner_waiting(12, 4, None)
    lease = _ask(h, node)
    assert isinstance(lease, Lease), lease
    # that lease's 6 rollouts are on their way: not yet the 4 it waits for and its next batch
    assert isinstance(_ask(h, node), Lease)
    # 12 on their way: the 8 it needs for this batch and the next need no other lease
    out = _ask(h, node)
    assert isinstance(out, Standby), out
    assert "blocked, and 12 rollouts it will train are on their way sooner" in out.reason
    assert "(it needs 8 for its batch and the next)" in out.reason
    # accepted but not fetched yet, they still count as on their way
    await _deliver(h, node, lease)
    assert isinstance(_ask(h, node), Standby)
    # a blocked learner fetches every few seconds; a report older than WANTING_FRESH_S is from
    # one that went away: the plain bound again
    h.clock.advance(WANTING_FRESH_S + 1)
    out = _ask(h, node)
    assert isinstance(out, Standby) and "ahead of a new lease's" in out.reason, out
    # a learner no longer blocked (wanting 0) is bounded as before
    h.core.learner_waiting(18, 0, None)
    assert isinstance(_ask(h, node), Standby)


async def test_the_learners_own_smaller_staleness_bound_is_what_counts(tmp_path: Path) -> None:
    """The coordinator accepts within its S (the demo runs it at max(1, S)); a learner at S = 0
    drops the rollouts of the version before its own, so they are not ahead of anything."""
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    for _ in range(2):
        await _deliver(h, node, h.lease(node))  # 12 accepted at v1
    h.publish(2)
    h.core.batch_rollouts = B
    h.core.feed.learner_report(2, 0, 1.0)  # the learner at v2
    h.clock.advance(BACKLOG_READ_S)
    # at the coordinator's S = 2, v1's rollouts are trained for 2 steps of B = 4: 8 of 12
    assert h.core.lease_desk.backlog(2) == Backlog(8, 12.0)
    h.core.learner_waiting(0, 0, 0)  # the learner trains at S = 0
    h.clock.advance(BACKLOG_READ_S)
    assert h.core.lease_desk.staleness() == 0
    assert h.core.lease_desk.backlog(2) == Backlog(0, 4.0)
    h.core.learner_waiting(0, 0, 5)  # a larger S than the coordinator's is not believed
    assert h.core.lease_desk.staleness() == S


def _measured(h: Harness, node: Identity, samples_per_s: float) -> None:
    """Give ``node`` a measured generation rate (as an accepted lease would)."""
    h.core.lease_desk.active.throughput.record(
        node.public_key, samples=6, version=1, generate_s=6 / samples_per_s, load_s=0.0,
        overhead_s=0.0, observed_s=6 / samples_per_s,
    )  # fmt: skip


def test_a_lease_lands_after_its_nodes_measured_generation_time(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    desk = h.core.lease_desk
    node = h.node()
    # unmeasured: every sample at max_new_tokens (4) at the advertised 100 tokens/s
    assert desk.generation_s(node.public_key, 3, 100.0) == pytest.approx(3 * G * 4 / 100.0)
    assert desk.generation_s(None, 3, 100.0) == pytest.approx(3 * G * 4 / 100.0)
    _measured(h, node, 0.5)  # measured: 0.5 samples/s, whatever it advertises
    assert desk.generation_s(node.public_key, 3, 100.0) == pytest.approx(3 * G / 0.5)


async def test_a_blocked_learner_is_not_kept_waiting_for_a_slow_nodes_lease(
    tmp_path: Path,
) -> None:
    """A slow node's lease in flight lands after a fast node's new one would: while the learner
    is blocked it does not stand the fast node by (counting every lease in flight did: the
    simulation's learner idled 33 % instead of 18 %)."""
    h = Harness(tmp_path)
    h.publish(1)
    slow, fast = h.node(), h.node()
    _measured(h, slow, 0.01)  # a lease of 3 prompts: 600 s
    _measured(h, fast, 10.0)  # 0.6 s
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    for _ in range(2):
        assert isinstance(_ask(h, slow), Lease)  # 12 in flight, landing in 600 s
    assert isinstance(_ask(h, slow), Standby)  # the queue is full for a lease landing last
    h.core.learner_waiting(0, 4, None)  # blocked for 4
    assert isinstance(_ask(h, slow), Standby)  # 12 land before a new slow lease would
    assert isinstance(_ask(h, fast), Lease)  # but after a fast one would
    h.clock.advance(600.0)  # ... until they are about to land before a new one would
    h.core.learner_waiting(0, 4, None)
    out = _ask(h, fast)
    assert isinstance(out, Standby) and out.reason.startswith("standby: the learner is blocked")
