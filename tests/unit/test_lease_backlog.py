"""The backlog bound (``leases.max_backlog_steps``): once a learner has reported, a node is stood
by while the rollouts ahead of a new lease's in the learner's queue that it will still train
(accepted and waiting, then in flight) leave no room for the new lease's to be trained:
(S + 1 − lag) · B of them, ``lag`` the versions the learner is ahead of the newest published.
What the learner consumes, what goes stale and a new version free it."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_harness import Harness, submission

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
