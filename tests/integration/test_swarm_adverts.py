"""Real hivemind peers on 127.0.0.1: signed capability adverts in the DHT."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from protocol.codec import encode
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Ack
from swarm import keys
from swarm.adverts import AdvertAnnouncer, list_adverts, seal_advert
from swarm.dht import SwarmPeer
from swarm.records import (
    PolicyVersionRecord,
    find_coordinator,
    find_coordinator_key,
    publish_coordinator_address,
    publish_policy_version,
    read_policy_version,
)
from swarm.testing import sample_advert, start_loopback_peer, wait_until

PERIOD = 1.0


@pytest.fixture
async def swarm3() -> AsyncIterator[list[SwarmPeer]]:
    first = await start_loopback_peer()
    boot = await first.visible_maddrs()
    rest = await asyncio.gather(start_loopback_peer(boot), start_loopback_peer(boot))
    peers = [first, *rest]
    yield peers
    await asyncio.gather(*(p.stop() for p in peers))


async def test_adverts_appear_and_vanish_after_stop(swarm3: list[SwarmPeer]) -> None:
    ids = [Identity.generate() for _ in swarm3]
    announcers = [
        AdvertAnnouncer(p, i, lambda: sample_advert(), period=PERIOD)
        for p, i in zip(swarm3, ids, strict=True)
    ]
    for a in announcers:
        await a.start()
    reader = swarm3[0]

    async def all_three() -> bool:
        return set(await list_adverts(reader)) == {i.fingerprint for i in ids}

    await wait_until(all_three, timeout=10, what="three adverts")
    adverts = await list_adverts(reader)
    for peer, ident in zip(swarm3, ids, strict=True):
        advert = adverts[ident.fingerprint]
        assert advert.node_key == ident.public_key
        assert advert.peer_id == peer.peer_id

    await announcers[2].stop()
    await swarm3[2].stop()
    gone_at = time.monotonic()

    async def third_gone() -> bool:
        return set(await list_adverts(reader)) == {ids[0].fingerprint, ids[1].fingerprint}

    await wait_until(third_gone, timeout=4 * PERIOD + 3, what="the stopped node's advert to expire")
    assert time.monotonic() - gone_at <= 4 * PERIOD + 3
    for a in announcers[:2]:
        await a.stop()


async def test_forged_adverts_are_ignored_and_cannot_overwrite(swarm3: list[SwarmPeer]) -> None:
    victim_peer, reader = swarm3[1], swarm3[0]
    victim = Identity.generate()
    announcer = AdvertAnnouncer(victim_peer, victim, lambda: sample_advert(42.0), period=30.0)
    await announcer.start()
    # The attacker runs a peer without validators, so its own storage accepts anything.
    attacker_peer = await start_loopback_peer(await reader.visible_maddrs(), validators=False)
    try:
        mallory = Identity.generate()
        now = time.time()
        later = now + 50.0
        forged = sample_advert(1e9)
        good_env = seal(
            mallory,
            msgspec.structs.replace(
                forged, node_key=mallory.public_key, peer_id=attacker_peer.peer_id, expires_at=later
            ),
            now=now,
        )
        bad_sig = msgspec.structs.replace(good_env, signature=bytes(64))
        wrong_key = msgspec.structs.replace(forged, node_key=victim.public_key, expires_at=later)
        records = {
            # mallory's validly signed advert written under the victim's subkey
            victim.fingerprint: encode(good_env),
            # bad signature under mallory's own subkey
            mallory.fingerprint: encode(bad_sig),
        }
        other = Identity.generate()
        schema_env = seal(other, Ack(ref="x"), now=now)  # not an advert at all
        keyless = Identity.generate()
        node_key_env = seal(keyless, wrong_key, now=now)  # node_key is not the signer
        records[other.fingerprint] = encode(schema_env)
        records[keyless.fingerprint] = encode(node_key_env)
        records[Identity.generate().fingerprint] = b"\x93garbage"
        for subkey, value in records.items():
            await attacker_peer.store(keys.ADVERTS, value, expiration_time=later, subkey=subkey)

        # An honest peer refuses a forged store outright.
        assert not await reader.store(
            keys.ADVERTS, encode(good_env), expiration_time=later, subkey=victim.fingerprint
        )
        for peer in (reader, victim_peer, attacker_peer):  # the read-side check holds everywhere
            adverts = await list_adverts(peer)
            assert set(adverts) == {victim.fingerprint}, peer.peer_id
            assert adverts[victim.fingerprint].tokens_per_s == 42.0
            assert adverts[victim.fingerprint].peer_id == victim_peer.peer_id
        # The victim can still refresh its own advert.
        assert await announcer.announce_once()
        assert seal_advert(victim, sample_advert(), peer_id="p", now=now, ttl=1.0)
    finally:
        await announcer.stop()
        await attacker_peer.stop()


async def test_policy_version_and_coordinator_records(swarm3: list[SwarmPeer]) -> None:
    coord_peer, node_peer = swarm3[0], swarm3[2]
    coord, mallory = Identity.generate(), Identity.generate()
    assert await publish_policy_version(coord_peer, coord, 7, [coord_peer.peer_id], ttl=60.0)
    assert await publish_coordinator_address(coord_peer, coord, ttl=60.0)
    record = await read_policy_version(node_peer, coord.public_key)
    assert record is not None and record.version == 7
    assert record.seed_peer_ids == [coord_peer.peer_id]
    address = await find_coordinator(node_peer, coord.public_key)
    assert address is not None and address.peer_id == coord_peer.peer_id
    assert address.maddrs == await coord_peer.visible_maddrs()
    found = await find_coordinator_key(node_peer, coord.fingerprint)
    assert found is not None and found[0] == coord.public_key
    assert await find_coordinator_key(node_peer, mallory.fingerprint) is None
    # Records signed by another key are invisible under the pinned fingerprint ...
    assert await read_policy_version(node_peer, mallory.public_key) is None
    # ... and mallory cannot write a newer version under the coordinator's subkey.
    forged = PolicyVersionRecord(version=99, seed_peer_ids=[], expires_at=time.time() + 50)
    value = encode(seal(mallory, forged, now=time.time()))
    assert not await node_peer.store(
        keys.POLICY_VERSION, value, expiration_time=forged.expires_at, subkey=coord.fingerprint
    )
    again = await read_policy_version(node_peer, coord.public_key)
    assert again is not None and again.version == 7
