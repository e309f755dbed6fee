"""The backlog bound (``leases.max_backlog_steps``, default S + 1): once a learner has reported,
nodes stand by while the accepted rollouts waiting for it that it will still train reach
``steps × B``; what the learner consumes, or what goes stale, frees it."""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_harness import Harness, submission

from coordinator.lease_desk import BACKLOG_READ_S
from coordinator.leases import Backlog, backlog_bound, trainable
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


def test_the_bound_is_s_plus_one_steps_of_b_unless_configured() -> None:
    assert backlog_bound(None, S, B) == (S + 1) * B
    assert backlog_bound(1.5, S, B) == 6.0
    assert backlog_bound(None, S, 0) == S + 1  # B is at least 1
    assert not Backlog(11, 12.0).full and Backlog(12, 12.0).full
    assert "12 accepted rollouts wait for the learner (bound 12)" in Backlog(12, 12.0).reason()


def test_trainable_counts_what_the_learner_reaches_within_s() -> None:
    # learner at version 10, S = 2, B = 4: the n-th trainable rollout is consumed at 10 + n // 4
    assert trainable([10] * 20, 10, 2, 4, 100) == 12  # 3 steps of version 10, then stale
    assert trainable([8] * 20, 10, 2, 4, 100) == 4  # version 8: the first step only
    assert trainable([8] * 4 + [12] * 20, 10, 2, 4, 100) == 4 + 16  # newer ones last longer
    assert trainable([7] * 8 + [10] * 8, 10, 2, 4, 100) == 8  # the stale ones take no step
    assert trainable([10] * 20, 10, 2, 4, 5) == 5  # counted up to the limit
    assert trainable([], 10, 2, 4, 5) == 0


async def test_nodes_stand_by_while_the_backlog_is_full_and_lease_again_as_it_drains(
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
    assert isinstance(_ask(h, node), Lease)  # 12 accepted, none consumed: still no bound
    # the learner reports (B = 4, at step 1): bound (S + 1) · B = 12, and 12 wait
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby) and "12 accepted rollouts wait" in out.reason, out
    assert 1.0 <= out.retry_after_s <= h.cfg.heartbeat_interval_s
    # the learner consumes the first 4 (cursor at seq 4): 8 wait, below the bound
    h.core.feed.learner_report(2, 4, 1.0)
    assert isinstance(_ask(h, node), Lease)


async def test_rollouts_that_go_stale_before_the_learner_reaches_them_do_not_hold_it(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    for lease in [h.lease(node) for _ in range(2)]:
        await _deliver(h, node, lease)
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    assert isinstance(_ask(h, node), Standby)  # 12 of version 1, the learner at 1: all trainable
    h.core.feed.learner_report(2, 0, 1.0)  # at version 2 only 2 steps of version 1 remain: 8
    assert isinstance(_ask(h, node), Lease)
    h.core.feed.learner_report(4, 0, 1.0)  # at 4, version 1 is beyond S: none
    assert h.core.lease_desk.backlog(1) == Backlog(8, 12.0)  # a read is reused for a while
    h.clock.advance(BACKLOG_READ_S)
    backlog = h.core.lease_desk.backlog(1)
    assert backlog is not None and backlog.waiting == 0


@pytest.mark.parametrize("steps", [1.0, 100.0])
async def test_the_configured_number_of_steps_sets_the_bound(tmp_path: Path, steps: float) -> None:
    h = Harness(tmp_path, leases={"max_backlog_steps": steps})
    h.publish(1)
    node = h.node()
    await _deliver(h, node, h.lease(node))  # 6 waiting
    h.core.batch_rollouts = B
    h.core.feed.learner_report(1, 0, 1.0)
    out = _ask(h, node)
    assert isinstance(out, Standby) == (steps * B <= 6), out
