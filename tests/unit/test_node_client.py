"""node.client: requests are sealed by the node key; responses decoded, typed, errors translated."""

from __future__ import annotations

import asyncio
import time

import pytest

from node.client import (
    BadResponse,
    CoordinatorClient,
    CoordinatorUnavailable,
    Rejected,
)
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import ReplayGuard, open_envelope
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    Ack,
    HeartbeatAck,
    LeaseRequest,
    Register,
    RegisterAck,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    SignedEnvelope,
    Standby,
    Timings,
)
from swarm.memtransport import InMemoryNetwork
from swarm.testing import sample_advert
from swarm.transport import HandlerError

NODE = Identity.generate()


def make_client(net: InMemoryNetwork, **kw: float) -> CoordinatorClient:
    return CoordinatorClient(
        net.endpoint("node"), "coord", NODE, timeouts={k: 1.0 for k in rpc.DEFAULT_TIMEOUTS} | kw
    )


async def test_register_is_signed_by_the_node_and_typed() -> None:
    net = InMemoryNetwork()
    coord = net.endpoint("coord")
    guard = ReplayGuard()
    seen: list[Register] = []

    async def on_register(peer: str, data: bytes) -> bytes:
        env = decode(data, SignedEnvelope)
        msg = open_envelope(
            env, Register, now=time.time(), replay=guard, expected_signer=NODE.public_key
        )
        seen.append(msg)
        return encode(
            RegisterAck(
                node_fingerprint=NODE.fingerprint,
                heartbeat_interval_s=5.0,
                current_policy_version=3,
                server_time=time.time(),
            )
        )

    await coord.register(rpc.REGISTER, on_register)
    ack = await make_client(net).register(sample_advert())
    assert isinstance(ack, RegisterAck) and ack.current_policy_version == 3
    assert len(seen) == 1 and seen[0].advert.backend == "fake"


async def test_reject_becomes_rejected_with_code() -> None:
    net = InMemoryNetwork()
    coord = net.endpoint("coord")

    async def refuse(peer: str, data: bytes) -> bytes:
        return encode(Reject(ref="-", code=ReasonCode.BANNED, detail="go away", retry_after_s=9.0))

    await coord.register(rpc.LEASE, refuse)
    with pytest.raises(Rejected) as err:
        await make_client(net).lease(LeaseRequest(peer_id="node", policy_version=1, max_prompts=1))
    assert err.value.code is ReasonCode.BANNED and err.value.retry_after_s == 9.0
    assert str(err.value) == "banned: go away"


async def test_error_frame_with_a_reason_code_is_a_rejection() -> None:
    net = InMemoryNetwork()
    coord = net.endpoint("coord")

    async def fail(peer: str, data: bytes) -> bytes:
        raise HandlerError("unknown_node", "register first")

    await coord.register(rpc.HEARTBEAT, fail)
    with pytest.raises(Rejected) as err:
        from protocol.messages import Heartbeat

        hb = Heartbeat(
            peer_id="node", seq=1, policy_version=None, active_leases=[], tokens_per_s=None
        )
        await make_client(net).heartbeat(hb)
    assert err.value.code is ReasonCode.UNKNOWN_NODE


async def test_network_failures_are_unavailable() -> None:
    net = InMemoryNetwork()
    client = make_client(net)
    with pytest.raises(CoordinatorUnavailable, match="no such peer"):
        await client.release("lease-1", 1, "test")
    coord = net.endpoint("coord")

    async def slow(peer: str, data: bytes) -> bytes:
        await asyncio.sleep(5)
        return b""

    async def broken(peer: str, data: bytes) -> bytes:
        raise RuntimeError("boom")

    await coord.register(rpc.RELEASE, slow)
    await coord.register(rpc.LEASE, broken)
    with pytest.raises(CoordinatorUnavailable, match="timed out"):
        await make_client(net, **{rpc.RELEASE: 0.05}).release("lease-1", 1, "test")
    with pytest.raises(CoordinatorUnavailable, match="internal"):
        await client.lease(LeaseRequest(peer_id="node", policy_version=None, max_prompts=1))


async def test_unexpected_or_garbage_responses_are_bad_responses() -> None:
    net = InMemoryNetwork()
    coord = net.endpoint("coord")

    async def wrong_type(peer: str, data: bytes) -> bytes:
        return encode(Ack(ref="x"))

    async def garbage(peer: str, data: bytes) -> bytes:
        return b"\xc1\xc1"

    await coord.register(rpc.LEASE, wrong_type)
    await coord.register(rpc.HEARTBEAT, garbage)
    client = make_client(net)
    with pytest.raises(BadResponse, match="expected Lease or Standby, got Ack"):
        await client.lease(LeaseRequest(peer_id="node", policy_version=None, max_prompts=1))
    from protocol.messages import Heartbeat

    with pytest.raises(BadResponse, match="undecodable"):
        await client.heartbeat(
            Heartbeat(peer_id="n", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)
        )


async def test_lease_standby_and_submit_verdicts() -> None:
    net = InMemoryNetwork()
    coord = net.endpoint("coord")

    async def standby(peer: str, data: bytes) -> bytes:
        return encode(Standby(retry_after_s=2.0, reason="no version"))

    async def judge(peer: str, data: bytes) -> bytes:
        env = decode(data, SignedEnvelope)
        sub = decode(env.payload, RolloutSubmission)
        return encode(Reject(ref=sub.lease_id, code=ReasonCode.DUPLICATE, detail="done"))

    async def hb(peer: str, data: bytes) -> bytes:
        return encode(HeartbeatAck(server_time=0.0, current_policy_version=None, active=False))

    async def release(peer: str, data: bytes) -> bytes:
        env = decode(data, SignedEnvelope)
        return encode(Ack(ref=decode(env.payload, ReleaseLease).lease_id))

    for name, h in ((rpc.LEASE, standby), (rpc.SUBMIT, judge), (rpc.RELEASE, release)):
        await coord.register(name, h)
    await coord.register(rpc.HEARTBEAT, hb)
    client = make_client(net)
    got = await client.lease(LeaseRequest(peer_id="node", policy_version=None, max_prompts=1))
    assert isinstance(got, Standby) and got.retry_after_s == 2.0
    from protocol.messages import GroupResult, Sample

    sub = RolloutSubmission(
        lease_id="L1",
        epoch=1,
        policy_version=1,
        backend="fake",
        dtype="float32",
        groups=[
            GroupResult(
                prompt_id="p",
                samples=[Sample(token_ids=b"", logprobs=b"", finish_reason="length", seed=1)],
            )
        ],
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )
    verdict = await client.submit(sub)
    assert isinstance(verdict, Reject) and verdict.code is ReasonCode.DUPLICATE
    assert (await client.release("L7", 3, "bye")).ref == "L7"
