"""The coordinator under attack (core harness and handlers called directly, no sockets).

Each test is one way a registered or unregistered peer could hurt the coordinator: get an honest
node banned without its key, grow a table without bound, hoard prompts, make one request cost
time proportional to the swarm size, or make it buffer and verify bytes nobody needs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import service_parts
from coord_harness import TOK, Harness, advert, submission

from coordinator.errors import Rejection
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import (
    Ack,
    FetchRollouts,
    Heartbeat,
    Lease,
    LeaseRequest,
    PublishVersion,
    Reject,
    SignedEnvelope,
    Standby,
    StatusRequest,
    StatusResponse,
)
from swarm.errors import RemoteError
from swarm.memtransport import InMemoryNetwork


def heartbeat() -> Heartbeat:
    return Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)


# --- strikes can only come from the key's owner ------------------------------------------------
def test_forged_envelopes_cannot_strike_or_ban_a_registered_node(tmp_path: Path) -> None:
    h = Harness(tmp_path, reputation={"strikes_to_ban": 2})
    victim = h.node()
    oversize = b"\x81" * (DEFAULT_LIMITS.control_frame + 1)
    for _ in range(4):  # no signature at all: anyone who knows the public key can send these
        forged = SignedEnvelope(
            signer=victim.public_key,
            nonce=os.urandom(16),
            ts=h.clock(),
            payload=oversize,
            signature=bytes(64),
        )
        with pytest.raises(ProtocolError) as e:
            h.core.open(forged, Heartbeat)
        assert e.value.code is ReasonCode.FRAME_TOO_LARGE
    assert h.core.reputation.strikes(victim.public_key) == {}
    assert h.core.reputation.banned(victim.public_key, h.clock()) is None
    h.core.heartbeat(victim.public_key, heartbeat())  # still admitted


async def test_a_banned_node_cannot_grow_the_strike_table(tmp_path: Path) -> None:
    """Submissions that each earn a strike (out-of-vocabulary tokens): after the ban the node is
    refused at the door, so its strike rows stop at ``strikes_to_ban``."""
    h = Harness(tmp_path, reputation={"strikes_to_ban": 2})
    h.publish(1)
    bad = h.node()
    leases = [h.lease(bad) for _ in range(3)]
    for _ in range(20):
        for lease in leases:
            oov = [[[TOK.vocab_size + 1] for _ in range(lease.group_size)]] * len(lease.prompts)
            await h.core.submit(bad.public_key, submission(lease, completions=oov, finish="length"))
    assert h.core.reputation.banned(bad.public_key, h.clock()) is not None
    assert sum(h.core.reputation.strikes(bad.public_key).values()) == 2


# --- bounded tables ----------------------------------------------------------------------------
def test_node_table_is_bounded_and_forgets_the_longest_gone_first(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_nodes=3)
    h.publish(1)
    holder, _gone, banned = h.node(), h.node(), h.node()
    h.lease(holder)  # an active lease: never forgotten
    h.core.store.put_ban(banned.public_key, 1, h.clock() + 1e6, "test")  # a ban in force: kept
    h.clock.advance(1000)  # all three are now gone (no heartbeat)
    newcomer = h.node()  # room made by forgetting `gone`, the only evictable one
    keys = {n.node_key for n in h.core.store.nodes()}
    assert keys == {holder.public_key, banned.public_key, newcomer.public_key}
    with pytest.raises(Rejection) as e:  # full, nobody evictable: refused, nothing lost
        h.node()
    assert e.value.code is ReasonCode.SWARM_FULL and e.value.retry_after_s is not None
    assert {n.node_key for n in h.core.store.nodes()} == keys
    h.core.heartbeat(newcomer.public_key, heartbeat())  # the ones kept still work


def test_repeated_registration_does_not_replan_the_whole_swarm_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path)
    node = h.node()
    replans = 0
    replan = h.core.replan

    def counting() -> Any:
        nonlocal replans
        replans += 1
        return replan()

    monkeypatch.setattr(h.core, "replan", counting)
    ad = advert(node, h.clock())
    for _ in range(50):  # each one used to scan every node and re-run the planner
        h.core.register(node.public_key, ad)
    assert replans == 0
    h.core.register(node.public_key, advert(node, h.clock(), price=1.0))  # a plan input changed
    assert replans == 1


def test_a_node_cannot_hoard_leases(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    req = LeaseRequest(peer_id="p", policy_version=1, max_prompts=3)
    answers = [h.core.request_lease(node.public_key, req) for _ in range(20)]
    leases = [a for a in answers if isinstance(a, Lease)]
    limit = h.cfg.leases.max_active_per_node
    assert 1 <= len(leases) == limit < 20
    refusal = answers[limit]
    assert isinstance(refusal, Standby) and "active leases" in refusal.reason
    assert h.core.store.get_meta("prompt_cursor") == str(limit * 3)  # no prompts hoarded
    # finishing one makes room again
    assert isinstance(h.core.release(node.public_key, leases[0].lease_id, leases[0].epoch), list)
    assert isinstance(h.core.request_lease(node.public_key, req), Lease)


async def test_distinct_resends_cannot_grow_the_verdict_table(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    lease = h.lease(node)
    honest = submission(lease)
    assert isinstance(await h.core.submit(node.public_key, honest), Ack)
    codes = []
    for i in range(40):  # same results, different bytes: each would get its own stored verdict
        timings = msgspec.structs.replace(honest.timings, started_at=float(i + 2))
        verdict = await h.core.submit(
            node.public_key, msgspec.structs.replace(honest, timings=timings)
        )
        assert isinstance(verdict, Reject)
        codes.append(verdict.code)
    rows = h.core.store._all("SELECT COUNT(*) FROM verdicts WHERE lease_id = ?", (lease.lease_id,))
    assert rows[0][0] <= 8
    assert codes[0] is ReasonCode.DUPLICATE
    # an identical re-send of the accepted bytes still gets its stored verdict
    assert isinstance(await h.core.submit(node.public_key, honest), Ack)


# --- the network handlers ----------------------------------------------------------------------
def test_status_cost_does_not_grow_with_the_square_of_the_swarm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    for _ in range(30):
        node = h.node()
    for _ in range(3):
        lease = h.lease(node)
        h.core.release(node.public_key, lease.lease_id, lease.epoch)
    calls = 0
    nodes = h.core.store.nodes

    def whole_history(state: str | None = None) -> Any:
        raise AssertionError("status must not load every lease ever issued")

    def counting() -> Any:
        nonlocal calls
        calls += 1
        return nodes()

    monkeypatch.setattr(h.core.store, "nodes", counting)
    monkeypatch.setattr(h.core.store, "leases", whole_history)
    status = service_parts.board(h).document()
    assert len(status["node_states"]) == 30 and set(status["node_states"].values()) == {"active"}
    assert status["leases"] == {"released": 3}
    assert calls <= 4  # was one full scan per registered node


class NeverReached:
    """A version sink that fails the test if a publication reaches it."""

    def hold(self, env: SignedEnvelope, manifest: Any, seeder: str) -> None:
        raise AssertionError("a refused publication reached the version holder")


async def test_trainer_rpcs_refuse_other_signers_before_verifying(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    trainer, stranger = Identity.generate(), Identity.generate()
    learner = service_parts.learner(h, NeverReached(), trainer=trainer)
    fetch = FetchRollouts(after_seq=0, max_rollouts=1, min_policy_version=None, wait_s=0.0)
    publish = PublishVersion(manifest=b"\x80", source="x")
    for handler, msg in ((learner.on_fetch, fetch), (learner.on_publish, publish)):
        with pytest.raises(Rejection) as e:
            await handler("peer", encode(seal(stranger, msg, now=time.time())))
        assert e.value.code is ReasonCode.UNKNOWN_NODE
    assert len(h.core.replay) == 0  # strangers' nonces take no room in the replay window


async def test_request_size_limits_follow_the_message_type(tmp_path: Path) -> None:
    from coordinator.service import register_handlers, rpc_table

    h = Harness(tmp_path)
    versions = service_parts.holder(h, tmp_path, service_parts.Downloads(set()))
    handlers = rpc_table(
        service_parts.nodes(h, versions),
        service_parts.learner(h, versions),
        service_parts.board(h),
    )
    net = InMemoryNetwork()
    server, caller = net.endpoint("coord"), net.endpoint("x")
    await register_handlers(server, handlers)
    big = b"\x80" * (2 * DEFAULT_LIMITS.control_frame)
    for method in (rpc.STATUS, rpc.HEARTBEAT, rpc.REGISTER, rpc.LEASE, rpc.FETCH, rpc.RELEASE):
        with pytest.raises(RemoteError) as e:  # refused before a byte reaches the handler
            await caller.call("coord", method, big)
        assert e.value.code == "frame_too_large", method
    raw = await caller.call("coord", rpc.SUBMIT, big)  # bulk methods still take big requests
    assert isinstance(decode(raw), Reject)
    status = await caller.call("coord", rpc.STATUS, encode(StatusRequest()))
    assert isinstance(decode(status), StatusResponse)
