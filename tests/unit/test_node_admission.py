"""A node the coordinator does not admit yet (``swarm_full`` with ``retry_after_s``: the
verification budget admits new identities at the rate its verifiers absorb, issue 35) waits as
told and registers again, instead of giving up; other refusals still propagate. The real
coordinator core and node RPC handlers on the in-memory transport; the node's sleep advances the
coordinator's fake clock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from coord_harness import FakeClock, Harness, advert

from coordinator.node_rpc import NodeHandlers
from coordinator.service import register_handlers
from coordinator.sim.verifier import ReferenceVerifier
from node.client import CoordinatorClient, Rejected
from node.presence import Registrar
from policy.model import CharTokenizer
from protocol import rpc
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import CapabilityAdvert
from swarm.memtransport import InMemoryNetwork


class _NoVersions:
    """The version waits a registration never reaches."""

    async def until_leasable(self, wait_s: float) -> None:
        return None

    async def wait_held(self, version: int, timeout: float) -> None:
        return None


async def _world(tmp_path: Path, **verification: Any) -> tuple[Harness, Registrar, list[float]]:
    clock = FakeClock(time.time())
    h = Harness(tmp_path, clock=clock, verifier=ReferenceVerifier({}, CharTokenizer().vocab_size),
                intake={"spot_check_fraction": 0.05, "new_node_check_rate": 1.0},
                verification={"assumed_tokens_per_s": 1000.0, "admission_burst": 1,
                              "admission_min_nodes": 0, **verification})  # fmt: skip
    h.node()  # takes the bucket's only token
    net = InMemoryNetwork()
    coord = net.endpoint("coord")
    nodes = NodeHandlers(h.core, versions=_NoVersions(), on_rollouts=lambda: None)
    await register_handlers(coord, {rpc.REGISTER: nodes.on_register})
    ident = Identity.generate()
    transport = net.endpoint("node-x")

    def make_advert() -> CapabilityAdvert:
        return msgspec.structs.replace(advert(ident, clock()), peer_id=transport.peer_id)

    slept: list[float] = []

    async def sleep(seconds: float) -> None:  # the node waits: coordinator time passes
        slept.append(seconds)
        clock.advance(seconds)

    client = CoordinatorClient(transport, coord.peer_id, ident, clock=clock)
    registrar = Registrar(client, make_advert, heartbeat_interval_s=None, clock=clock,
                          monotonic=clock, sleep=sleep)  # fmt: skip
    return h, registrar, slept


async def test_a_node_not_admitted_yet_waits_as_told_and_registers(tmp_path: Path) -> None:
    h, registrar, slept = await _world(tmp_path)
    await registrar.register_with_retries(5.0)
    assert len(slept) == 1 and slept[0] >= 1.0  # told to come back when a token is there
    assert h.core.budget.refused == 1 and h.core.budget.admitted == 2
    assert h.store.node_count() == 2


async def test_other_refusals_still_end_the_registration(tmp_path: Path) -> None:
    h, registrar, slept = await _world(tmp_path)
    h.core.reputation.ban_now(registrar._advert().node_key, "test", "banned by the test",
                              h.clock())  # fmt: skip
    with pytest.raises(Rejected) as refused:
        await registrar.register_with_retries(5.0)
    # (a banned identity never registered is answered unknown_node): no wait, no second try
    assert refused.value.code is not ReasonCode.SWARM_FULL and slept == []


async def test_a_heartbeat_reads_its_sender_once_and_still_refuses_strangers(
    tmp_path: Path,
) -> None:
    """The most frequent call admits its sender from the one read the heartbeat makes (not a
    second one in the envelope's opening); an unknown or banned sender is refused as before."""
    from coordinator.errors import Rejection
    from protocol.codec import decode, encode
    from protocol.envelope import seal
    from protocol.messages import Heartbeat, HeartbeatAck

    h = Harness(tmp_path)
    h.publish(1)
    handlers = NodeHandlers(h.core, versions=_NoVersions(), on_rollouts=lambda: None)
    known, stranger = h.node(), Identity.generate()
    seq = iter(range(1, 100))

    def beat(ident: Identity) -> bytes:
        hb = Heartbeat(peer_id="p", seq=next(seq), policy_version=None, active_leases=[],
                       tokens_per_s=None)  # fmt: skip
        return encode(seal(ident, hb, now=h.clock()))

    reads: list[str] = []
    h.store._conn.set_trace_callback(lambda sql: reads.append(sql) if "FROM nodes" in sql else None)
    ack = decode(await handlers.on_heartbeat("p", beat(known)))
    assert isinstance(ack, HeartbeatAck) and ack.current_policy_version == 1
    assert len(reads) == 1
    with pytest.raises(Rejection) as err:
        await handlers.on_heartbeat("p", beat(stranger))
    assert err.value.code is ReasonCode.UNKNOWN_NODE
    h.core.reputation.ban_now(known.public_key, "test", "banned by the test", h.clock())
    with pytest.raises(Rejection) as err:
        await handlers.on_heartbeat("p", beat(known))
    assert err.value.code is ReasonCode.BANNED
    assert handlers.peer_of(stranger.fingerprint) is None
