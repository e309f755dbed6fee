"""Peer IDs of either key type are accepted (docs/protocol.md §5.2, `CapabilityAdvert.peer_id`;
issue 36, item 13): a peer started the way this implementation starts its processes (an RSA
identity file: ``Qm…``) and one started as hivemind does by default (no identity file: an Ed25519
key, ``12D3KooW…``) both register with a real ``swarm coordinator launch`` process and lease."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from swarm_harness import TestNode, coordinator_toml, launch_coordinator

from protocol.identity import Identity, fingerprint_of
from protocol.messages import Heartbeat, HeartbeatAck
from swarm.dht import PeerConfig, SwarmPeer
from swarm.testing import start_loopback_peer
from swarm.transport import P2PTransport

pytestmark = [pytest.mark.slow]

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
RSA_ID = re.compile(r"^Qm[1-9A-HJ-NP-Za-km-z]{44}$")  # base58btc sha2-256 multihash: 46 chars
ED25519_ID = re.compile(r"^12D3KooW[1-9A-HJ-NP-Za-km-z]{44}$")  # identity multihash: 52 chars


def test_the_doc_gives_both_forms() -> None:
    text = " ".join(DOC.split())
    for example in re.findall(r"`(Qm\w+|12D3KooW\w+)`", text):
        assert RSA_ID.match(example) or ED25519_ID.match(example), example
    assert "`12D3KooW" in text and "(52 characters" in text and "(46 characters" in text
    assert "is accepted alike" in text


async def test_rsa_and_ed25519_peer_ids_both_register(tmp_path: Path) -> None:
    coord = await launch_coordinator(tmp_path, coordinator_toml(tmp_path, Identity.generate()))
    peers: list[SwarmPeer] = []
    try:
        assert RSA_ID.match(coord.peer_id), coord.peer_id  # the coordinator's own identity file
        default = await start_loopback_peer([coord.maddr])  # hivemind's default: Ed25519
        peers.append(default)
        rsa = SwarmPeer(
            PeerConfig(initial_peers=[coord.maddr], identity_path=str(tmp_path / "node.key"))
        )
        await rsa.start()
        peers.append(rsa)
        assert ED25519_ID.match(default.peer_id), default.peer_id
        assert RSA_ID.match(rsa.peer_id), rsa.peer_id
        for peer in peers:
            node = TestNode(P2PTransport(peer.p2p), coord.peer_id)
            ack = await node.client.register(node.advert())  # a Reject raises
            assert ack.node_fingerprint == fingerprint_of(node.identity.public_key)
            beat = Heartbeat(peer_id=peer.peer_id, seq=1, policy_version=None, active_leases=[],
                             tokens_per_s=None)  # fmt: skip
            assert isinstance(await node.client.heartbeat(beat), HeartbeatAck)
    finally:
        for peer in reversed(peers):
            await peer.stop()
        coord.proc.stop()
