"""From a version's publication to its first rollouts: the publish -> first lease lag, lease
requests that wait for a version on its way instead of a 1 s standby, and heartbeats that
announce a version the node can fetch."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgspec
import pytest
from coord_harness import FakeClock, Harness
from service_parts import Downloads, board, holder, nodes, published

from coordinator.errors import Rejection
from coordinator.throughput import LeaseLag
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ReasonCode
from protocol.messages import Heartbeat, Lease, LeaseRequest, Standby


def test_lease_lag_runs_from_the_publish_call_to_the_first_lease() -> None:
    lag = LeaseLag(alpha=0.5)
    lag.published(1, 10.0)
    assert lag.mean_s is None
    lag.leased(1, 10.3)
    assert lag.mean_s == pytest.approx(0.3)
    lag.leased(1, 12.0)  # a later lease on the same version measures nothing
    assert lag.mean_s == pytest.approx(0.3)
    lag.published(2, 13.0)
    lag.published(3, 13.2)
    lag.leased(3, 13.7)  # v2 was never leased: forgotten, not counted as late
    assert lag.mean_s == pytest.approx(0.5 * 0.3 + 0.5 * 0.5)
    lag.leased(2, 14.0)
    assert lag.mean_s == pytest.approx(0.4)


def test_lease_lag_forgets_versions_nobody_leases() -> None:
    lag = LeaseLag()
    for v in range(1, 3 * LeaseLag.KEEP):
        lag.published(v, float(v))
    assert len(lag._published) == LeaseLag.KEEP


def test_the_coordinator_measures_publish_to_first_lease(tmp_path: Path) -> None:
    """The first node asked 0.4 s after the publish call: the lag is 0.4 s, whatever the
    download took (/status shows it beside T_bcast)."""
    h = Harness(tmp_path)
    node = h.node()
    h.publish(1)
    h.clock.advance(0.4)
    h.lease(node)
    assert h.core.lease_lag.mean_s == pytest.approx(0.4)


async def test_a_lease_request_waits_for_a_version_on_its_way(tmp_path: Path) -> None:
    """κ = 1, S = 1: the two newest versions were published and neither is held yet. The node
    gets a lease on the first one to arrive, not a 1 s standby (which cost one demo node 7–24 s
    of a 60 s run)."""
    h = Harness(tmp_path, clock=FakeClock(time.time()), staleness_bound=1)
    held: set[int] = set()
    h.core.servable = held.__contains__
    node = h.node()
    h.publish(1)
    h.publish(2)
    versions = holder(h, tmp_path, Downloads(held, delay=0.2))
    desk = nodes(h, versions)
    versions.hold(*published(h, 2), "trainer")  # v2 on its way from the trainer
    req = LeaseRequest(peer_id="peer", policy_version=None, max_prompts=1)
    t0 = time.monotonic()
    out = decode(await desk.on_lease("peer", encode(seal(node, req, now=h.clock()))))
    assert isinstance(out, Lease) and out.policy_version == 2
    assert 0.15 <= time.monotonic() - t0 < 1.5
    # nothing on its way: the standby comes at once, as before
    h.publish(3)
    held.clear()
    out = decode(await desk.on_lease("peer", encode(seal(node, req, now=h.clock()))))
    assert isinstance(out, Standby) and "no policy version" in out.reason


def test_heartbeats_announce_the_version_a_node_can_fetch_now(tmp_path: Path) -> None:
    """A node prefetches the version its heartbeat ack names. Naming v2 before the coordinator
    (the node's seed) held it sent the node into a download that backed off for 2 s."""
    h = Harness(tmp_path)
    held = {1}
    h.core.servable = held.__contains__
    node = h.node()
    h.publish(1)
    h.publish(2)
    beat = Heartbeat(peer_id="peer", seq=1, policy_version=1, active_leases=[], tokens_per_s=None)
    assert h.core.heartbeat(node.public_key, beat).current_policy_version == 1
    held.add(2)
    beat = msgspec.structs.replace(beat, seq=2)
    assert h.core.heartbeat(node.public_key, beat).current_policy_version == 2


async def test_a_banned_node_is_refused_at_once_while_a_version_is_on_its_way(
    tmp_path: Path,
) -> None:
    """The wait is for nodes the coordinator would lease to: a banned one hears so first."""
    h = Harness(tmp_path, clock=FakeClock(time.time()))
    held: set[int] = set()
    h.core.servable = held.__contains__
    node = h.node()
    h.publish(1)
    h.core.store.put_ban(node.public_key, 1, h.clock() + 600.0, "test")
    versions = holder(h, tmp_path, Downloads(held, delay=5.0))
    versions.hold(*published(h, 1), "trainer")
    assert versions.fetching(1)
    req = LeaseRequest(peer_id="peer", policy_version=None, max_prompts=1)
    t0 = time.monotonic()
    with pytest.raises(Rejection) as e:
        await nodes(h, versions).on_lease("peer", encode(seal(node, req, now=h.clock())))
    assert e.value.code is ReasonCode.BANNED
    assert time.monotonic() - t0 < 1.0
    versions.stop()


async def test_a_publication_refreshes_the_dht_records_but_not_the_plan_figures() -> None:
    """The upkeep's tick (replanning, the /status snapshot) keeps its own clock: publications
    (several a second in the demos) refresh the DHT records at once but do not trigger a tick,
    which read the per-lease figures always right after a publication (a biased sample)."""
    from coordinator.upkeep import TICK_S, Upkeep

    ticks: list[float] = []
    records: list[float] = []

    async def publish_records() -> None:
        records.append(time.monotonic())

    upkeep = Upkeep(tick=lambda: ticks.append(time.monotonic()), publish_records=publish_records)
    upkeep.start()
    try:
        for _ in range(6):  # six publications within ~0.6 s
            await asyncio.sleep(0.1)
            upkeep.records_soon()
        await asyncio.sleep(0.1)
        assert len(records) >= 6  # the first pass, then one per publication
        while len(ticks) < 2:
            await asyncio.sleep(0.05)
    finally:
        await upkeep.stop()
    assert all(b - a >= 0.9 * TICK_S for a, b in itertools.pairwise(ticks)), ticks


def test_a_publication_shows_in_status_at_once_and_only_its_version(tmp_path: Path) -> None:
    """/status names a new version before the next tick (an operator, or a restarted trainer's
    check, reads it right after publishing), while its figures keep the tick's clock."""
    h = Harness(tmp_path, clock=FakeClock(time.time()))
    served: list[dict[str, object]] = []
    status = board(h, served.append)
    status.refresh()
    before = served[-1]
    assert before["policy_version"] is None
    status.show_published(3)
    after = served[-1]
    assert after["policy_version"] == 3
    moved = ("policy_version", "status_seq")
    assert {k: v for k, v in after.items() if k not in moved} == {
        k: v for k, v in before.items() if k not in moved
    }
    # the same uptime_s, another document: only the serial tells a reader which one it holds
    assert after["uptime_s"] == before["uptime_s"]
    assert after["status_seq"] == before["status_seq"] + 1
    assert before["policy_version"] is None  # the tick's document (in its history) untouched
    status.show_published(2)  # a late, older announcement does not move it back
    assert served[-1]["policy_version"] == 3
