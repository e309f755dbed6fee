"""The heartbeat interval grows with the swarm (issue 35): at most ``heartbeat_rate_max``
heartbeats per second are asked of it, and the liveness horizon covers every interval a node may
still follow (coordinator/liveness.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from coord_harness import Harness

from coordinator.liveness import HeartbeatSchedule
from protocol.codec import decode, encode
from protocol.errors import DecodeError, ReasonCode
from protocol.messages import Heartbeat, HeartbeatAck, LeaseRequest, Standby

HB = Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)


def test_the_interval_is_the_base_until_the_rate_cap_then_grows_in_quarter_octaves() -> None:
    s = HeartbeatSchedule(10.0, 3, rate_max=250.0)
    assert s.target_s(0) == s.target_s(2_500) == 10.0  # 250/s at 10 s: the base holds
    assert s.target_s(2_501) == pytest.approx(10.0 * 2**0.25)  # the next step, not 10.004
    assert s.target_s(5_000) == pytest.approx(20.0)
    assert s.target_s(10_000) == pytest.approx(40.0)
    for alive in (2_501, 3_000, 7_777, 10_000, 123_456):  # never more than 250 heartbeats/s
        assert alive / s.target_s(alive) <= 250.0 * (1 + 1e-9)
        assert alive / s.target_s(alive) > 250.0 / 2**0.25 * (1 - 1e-9)  # and not far fewer
    assert HeartbeatSchedule(10.0, 3, rate_max=None).target_s(10**6) == 10.0
    assert HeartbeatSchedule(10.0, 3, rate_max=0.001).target_s(10**6) == 86_400.0  # the wire's


def test_a_shrinking_swarm_does_not_declare_the_long_interval_nodes_gone_early() -> None:
    s = HeartbeatSchedule(10.0, 3, rate_max=250.0)
    assert s.observe(10_000, now=0.0) == pytest.approx(40.0)
    assert s.horizon_s(0.0) == pytest.approx(120.0)
    # the swarm shrinks at t = 100: new answers say 10 s, but a node told 40 s at t = 100 may
    # stay silent until t = 220
    assert s.observe(1_000, now=100.0) == 10.0
    assert s.horizon_s(150.0) == pytest.approx(120.0)
    assert s.horizon_s(220.0) == pytest.approx(120.0)
    assert s.horizon_s(220.5) == 30.0  # past it, the base horizon
    s.observe(1_000, now=221.0)
    assert s._past == []  # the expired interval is forgotten


def test_the_coordinator_hands_out_the_grown_interval_and_keeps_its_nodes_alive(
    tmp_path: Path,
) -> None:
    """39 then 40 nodes at 1 heartbeat/s at most: after the upkeep tick counts them,
    registration, heartbeat and standby answers all ask for 40 s (a quarter-octave step of 10 s
    covering both counts), and a node silent for 100 s (under 3 × 40 s) is still alive."""
    h = Harness(tmp_path, heartbeat_interval_s=10.0, heartbeat_rate_max=1.0)
    nodes = [h.node() for _ in range(39)]
    ack = h.core.heartbeat(nodes[0].public_key, HB)
    assert ack.heartbeat_interval_s == 10.0  # not counted yet
    h.core.tick()
    assert h.core.liveness.interval_s == pytest.approx(40.0)
    assert h.core.heartbeat(nodes[0].public_key, HB).heartbeat_interval_s == pytest.approx(40.0)
    late = h.node()
    assert h.core.liveness.interval_s == pytest.approx(40.0)
    h.publish(1)
    request = LeaseRequest(peer_id="peer", policy_version=1, max_prompts=1)
    answers = [h.core.request_lease(late.public_key, request) for _ in range(20)]
    held = [a for a in answers if isinstance(a, Standby)]  # past the per-node lease cap
    assert held and held[0].retry_after_s == pytest.approx(40.0)
    h.clock.advance(100.0)
    h.core.tick()
    assert h.core.status()["nodes_alive"] == 40  # silent for 100 s < 120 s: alive
    h.clock.advance(25.0)  # 125 s silent: gone
    assert h.core.status()["nodes_alive"] == 0
    h.core.tick()
    assert h.core.liveness.interval_s == 10.0  # nobody left: the base again
    assert h.core.liveness.horizon(h.clock()) == pytest.approx(h.clock() - 120.0)  # told 40 s


def test_the_ack_field_is_optional_and_bounded_on_the_wire() -> None:
    old = {"type": "HeartbeatAck", "protocol_version": 1, "server_time": 1.0,
           "current_policy_version": None, "active": True}  # fmt: skip
    import msgspec

    got = decode(msgspec.msgpack.encode(old), HeartbeatAck)
    assert got.heartbeat_interval_s is None  # a coordinator that does not say: keep yours
    new = HeartbeatAck(server_time=1.0, current_policy_version=3, active=True,
                       heartbeat_interval_s=40.0)  # fmt: skip
    assert decode(encode(new), HeartbeatAck).heartbeat_interval_s == 40.0
    for bad in (0.0, -1.0, 86_401.0):
        with pytest.raises(DecodeError) as e:
            decode(msgspec.msgpack.encode({**old, "heartbeat_interval_s": bad}), HeartbeatAck)
        assert e.value.code is ReasonCode.OUT_OF_RANGE
    with pytest.raises(DecodeError) as e:
        decode(msgspec.msgpack.encode({**old, "heartbeat_interval_s": math.inf}), HeartbeatAck)
    assert e.value.code is ReasonCode.NOT_FINITE


def test_a_restarted_coordinator_keeps_the_nodes_told_a_long_interval(tmp_path: Path) -> None:
    """The schedule is soft state. After a restart the nodes told 40 s before it stay alive for
    3 × 40 s, not 3 × 10 s; and after an outage longer than that, while the nodes reconnect, the
    coordinator keeps naming 40 s although its count finds only those heard since (naming 10 s
    to a reconnecting swarm would ask it for four times the cap)."""
    h = Harness(tmp_path, heartbeat_interval_s=10.0, heartbeat_rate_max=1.0)
    nodes = [h.node() for _ in range(40)]
    h.core.tick()
    assert h.core.heartbeat(nodes[0].public_key, HB).heartbeat_interval_s == pytest.approx(40.0)
    h.core.close()
    h.clock.advance(80.0)  # a short outage
    h.reopen()
    h.clock.advance(20.0)  # silent for 100 s, told 40 s: alive
    assert h.core.status()["nodes_alive"] == 40
    h.core.close()
    h.clock.advance(200.0)  # a long one: nobody heard for 300 s
    h.reopen()
    assert h.core.status()["nodes_alive"] == 0
    assert h.core.liveness.interval_s == pytest.approx(40.0)
    assert h.core.heartbeat(nodes[1].public_key, HB).heartbeat_interval_s == pytest.approx(40.0)
    h.core.tick()  # one node counted: still 40 s until every node had its chance
    assert h.core.liveness.interval_s == pytest.approx(40.0)
    h.clock.advance(121.0)  # 3 × 40 s later only that one came back: the base
    h.core.heartbeat(nodes[1].public_key, HB)
    h.core.tick()
    assert h.core.liveness.interval_s == 10.0
