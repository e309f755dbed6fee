"""Real hivemind peers on 127.0.0.1: a hostile peer writes over signed DHT records.

Three honest peers run the standard record validators; the attacker runs a peer *without*
validators, so its own storage keeps whatever it writes (and it answers lookups with it). Honest
readers must see the genuine record, unchanged, whatever the attacker writes, and its signer must
still be able to refresh it. Already covered in test_swarm_adverts.py and not repeated: adverts
with a bad signature, of the wrong type, with a node_key that is not the signer, or garbage; a
forged policy version offered to an honest peer with a *lower* expiration.

The last test runs a real coordinator and a real ``swarm node run`` process while the attacker
announces a fake "current policy version" and holds that version (signed by its own key): the
node never asks anyone for it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from swarm_harness import (
    Proc,
    Trainer,
    coordinator_toml,
    launch_coordinator,
    start_node,
    until,
)

from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import (
    AcceptedRollout,
    CapabilityAdvert,
    ManifestRequest,
    ManifestResponse,
    SignedEnvelope,
)
from swarm import keys
from swarm.adverts import AdvertAnnouncer, list_adverts
from swarm.broadcast import CHUNK_ANY_RPC, CHUNK_RPC, MANIFEST_RPC
from swarm.dht import SwarmPeer
from swarm.holders import DhtHolderDirectory
from swarm.records import (
    CoordinatorAddress,
    PolicyVersionRecord,
    find_coordinator,
    find_coordinator_key,
    read_policy_version,
)
from swarm.testing import sample_advert, start_loopback_peer
from swarm.transport import HandlerError, P2PTransport

FAKE = 99  # the "current policy version" the attacker announces


@pytest.fixture
async def swarm() -> AsyncIterator[tuple[list[SwarmPeer], SwarmPeer]]:
    """Three honest peers and an attacker peer without record validators."""
    first = await start_loopback_peer()
    boot = await first.visible_maddrs()
    rest = await asyncio.gather(start_loopback_peer(boot), start_loopback_peer(boot))
    attacker = await start_loopback_peer(boot, validators=False)
    yield [first, *rest], attacker
    await asyncio.gather(*(p.stop() for p in [first, *rest, attacker]))


async def plant(
    attacker: SwarmPeer, honest: list[SwarmPeer], key: str, subkey: str, value: bytes, exp: float
) -> None:
    """Store a record from the attacker (its own storage keeps it: lookups find it there, so
    the attack is live), then have every honest peer offer it to the swarm: all refuse it.

    (hivemind's store result is the answer of the *last* replica to reply, so the attacker's own
    answer is not asserted; its copy already has that expiration, so it refuses the re-offers.)"""
    await attacker.store(key, value, expiration_time=exp, subkey=subkey)
    held = (await attacker.get_subkeys(key)).get(subkey)
    assert held is not None and held.value == value and held.expiration_time == exp
    for peer in honest:
        assert not await peer.store(key, value, expiration_time=exp, subkey=subkey), peer.peer_id


def resigned_payload(env_bytes: bytes, payload_type: Any, **changes: Any) -> bytes:
    """A genuine envelope with its payload changed and the original signature copied over."""
    env = decode(env_bytes, SignedEnvelope)
    payload = msgspec.structs.replace(decode(env.payload, payload_type), **changes)
    return encode(msgspec.structs.replace(env, payload=encode(payload)))


async def test_an_advert_cannot_be_overwritten_outlived_or_rolled_back(
    swarm: tuple[list[SwarmPeer], SwarmPeer],
) -> None:
    honest, attacker = swarm
    victim_peer = honest[1]
    victim, mallory = Identity.generate(), Identity.generate()
    t0 = time.time()
    clock = [t0]
    tps = [42.0]
    announcer = AdvertAnnouncer(
        victim_peer, victim, lambda: sample_advert(tps[0]), period=30.0, clock=lambda: clock[0]
    )
    assert await announcer.announce_once()  # A: expires t0 + 60
    old = (await honest[0].get_subkeys(keys.ADVERTS))[victim.fingerprint]
    clock[0], tps[0] = t0 + 1.0, 43.0
    assert await announcer.announce_once()  # B, one second later: expires t0 + 61
    current = (await honest[0].get_subkeys(keys.ADVERTS))[victim.fingerprint]
    assert current.expiration_time == t0 + 61.0 and old.expiration_time == t0 + 60.0

    async def genuine_everywhere(tokens_per_s: float, expires_at: float) -> None:
        for peer in honest:
            advert = (await list_adverts(peer)).get(victim.fingerprint)
            assert advert is not None, peer.peer_id
            assert advert.tokens_per_s == tokens_per_s and advert.expires_at == expires_at
            assert advert.node_key == victim.public_key and advert.peer_id == victim_peer.peer_id

    forged = msgspec.structs.replace(
        sample_advert(1e9), node_key=mallory.public_key, peer_id=attacker.peer_id
    )
    later = t0 + 3600.0
    better = resigned_payload(current.value, CapabilityAdvert, tokens_per_s=1e9, expires_at=later)
    # Expirations only grow: the attacker's own storage, like any, keeps the longest-lived copy.
    attacks = {
        # the genuine *older* record replayed with an expiration a few seconds past its signed
        # one: it would displace the newer record (the higher expiration wins) and pin it there
        "rollback": (old.value, t0 + 64.0),
        # mallory's validly signed advert under the victim's subkey, outliving the genuine one
        "own key": (encode(seal(mallory, forged, now=t0)), later),
        # the victim's signature copied onto a changed payload (better figures, longer life)
        "copied signature": (better, later + 1),
        # the genuine current record replayed with a DHT expiration beyond its signed one
        "longer life": (current.value, later + 2),
    }
    for name, (value, exp) in attacks.items():
        try:
            await plant(attacker, honest, keys.ADVERTS, victim.fingerprint, value, exp)
            await genuine_everywhere(43.0, t0 + 61.0)
        except AssertionError as exc:
            raise AssertionError(f"attack {name!r} changed the advert: {exc}") from exc

    # The victim still refreshes its own advert (the attacker's longer-lived copies pin nothing).
    # (Not announce_once()'s result: hivemind reports the *last* replica's answer, and that may be
    # the attacker's, which refuses anything shorter-lived than its planted copy. What counts is
    # what honest readers see.)
    clock[0], tps[0] = t0 + 2.0, 44.0
    await announcer.announce_once()
    await genuine_everywhere(44.0, t0 + 62.0)


async def test_fake_policy_version_and_coordinator_records_are_ignored(
    swarm: tuple[list[SwarmPeer], SwarmPeer],
) -> None:
    honest, attacker = swarm
    coord_peer = honest[0]
    coord, mallory = Identity.generate(), Identity.generate()
    t0 = time.time()

    async def publish(record: Any, key: str, now: float) -> bytes:
        value = encode(seal(coord, record, now=now))
        assert await coord_peer.store(
            key, value, expiration_time=record.expires_at, subkey=coord.fingerprint
        )
        return value

    seeds = [coord_peer.peer_id]
    v5 = PolicyVersionRecord(version=5, seed_peer_ids=seeds, expires_at=t0 + 60)
    v6 = PolicyVersionRecord(version=6, seed_peer_ids=seeds, expires_at=t0 + 61)
    old = await publish(v5, keys.POLICY_VERSION, t0)
    current = await publish(v6, keys.POLICY_VERSION, t0 + 1)  # one second later
    address = CoordinatorAddress(
        peer_id=coord_peer.peer_id, maddrs=await coord_peer.visible_maddrs(), expires_at=t0 + 60
    )
    await publish(address, keys.COORDINATOR, t0)

    async def genuine_everywhere() -> None:
        for peer in honest:
            record = await read_policy_version(peer, coord.public_key)
            assert record is not None and record.version == 6 and record.seed_peer_ids == seeds
            found = await find_coordinator(peer, coord.public_key)
            assert found is not None and found.peer_id == coord_peer.peer_id
            by_fp = await find_coordinator_key(peer, coord.fingerprint)
            assert by_fp is not None and by_fp[0] == coord.public_key
            assert by_fp[1].peer_id == coord_peer.peer_id

    await genuine_everywhere()
    later = t0 + 3600.0
    fake = PolicyVersionRecord(version=FAKE, seed_peer_ids=[attacker.peer_id], expires_at=later)
    # mallory's own, validly signed record under her own subkey is stored (it is hers) ...
    assert await honest[1].store(
        keys.POLICY_VERSION, encode(seal(mallory, fake, now=t0)), expiration_time=later,
        subkey=mallory.fingerprint,
    )  # fmt: skip
    stolen = msgspec.structs.replace(address, peer_id=attacker.peer_id, expires_at=later)
    version, where = keys.POLICY_VERSION, keys.COORDINATOR
    attacks = {  # expirations grow per key, see above
        # the older genuine record, a few seconds past its signed expiry, would displace v6
        "older version replayed": (version, old, t0 + 64.0),
        "version signed by another key": (version, encode(seal(mallory, fake, now=t0)), later),
        "unsigned version": (version, encode(fake), later + 1),
        "version, copied signature": (
            version,
            resigned_payload(current, PolicyVersionRecord, version=FAKE, expires_at=later),
            later + 2,
        ),
        "address signed by another key": (where, encode(seal(mallory, stolen, now=t0)), later),
        "unsigned address": (where, encode(stolen), later + 1),
    }
    for name, (key, value, exp) in attacks.items():
        try:
            await plant(attacker, honest, key, coord.fingerprint, value, exp)
            await genuine_everywhere()  # ... and readers pinned to the coordinator ignore all
        except AssertionError as exc:
            raise AssertionError(f"attack {name!r} was taken up: {exc}") from exc


# -- a node process facing a fake current version --------------------------------------------
class FakeVersionHolder:
    """The attacker's peer serving a checkpoint ``FAKE`` signed by its own key; counts asks."""

    def __init__(self, peer: SwarmPeer, signer: Identity) -> None:
        self.peer = peer
        self.transport = P2PTransport(peer.p2p)
        now = time.time()
        manifest, self.chunks = build_manifest(
            {"model.safetensors": b"\0" * 4096}, version=FAKE, parent_version=None,
            model_config_hash="00", tokenizer_hash="00", created_at=now, expires_at=now + 3600,
            chunk_size=1024,
        )  # fmt: skip
        self.manifest = sign_manifest(manifest, signer, now)
        self.asked: Counter[str] = Counter()

    async def start(self) -> None:
        async def on_manifest(peer_id: str, request: bytes) -> bytes:
            self.asked[f"manifest v{decode(request, ManifestRequest).version}"] += 1
            return encode(ManifestResponse(manifest=self.manifest))

        async def on_chunk(peer_id: str, request: bytes) -> bytes:
            self.asked["chunk"] += 1
            raise HandlerError("not_held", "nothing here")

        await self.transport.register(MANIFEST_RPC, on_manifest)
        await self.transport.register(CHUNK_RPC, on_chunk)
        await self.transport.register(CHUNK_ANY_RPC, on_chunk)
        n = len(self.chunks)
        await DhtHolderDirectory(self.peer).publish(
            FAKE, self.peer.peer_id, keys.bitmap_from_indices(frozenset(range(n)), n), 600.0
        )

    async def stop(self) -> None:
        for name in (MANIFEST_RPC, CHUNK_RPC, CHUNK_ANY_RPC):
            await self.transport.unregister(name)


@pytest.mark.slow
async def test_a_node_never_fetches_a_fake_current_version(
    tmp_path: Path, procs: list[Proc]
) -> None:
    trainer_id, mallory = Identity.generate(), Identity.generate()
    coord = await launch_coordinator(tmp_path, coordinator_toml(tmp_path, trainer_id))
    procs.append(coord.proc)
    trainer = Trainer(coord, trainer_id, tmp_path)
    await trainer.start()
    attacker = await start_loopback_peer([coord.maddr], validators=False)
    holder = FakeVersionHolder(attacker, mallory)
    try:
        await trainer.publish(1)
        await holder.start()
        later = time.time() + 3600
        fake = PolicyVersionRecord(version=FAKE, seed_peer_ids=[attacker.peer_id], expires_at=later)
        forged = encode(seal(mallory, fake, now=time.time()))
        for subkey, value, exp in [  # under the coordinator's subkey: forged, then unsigned
            (coord.fingerprint, forged, later),
            (coord.fingerprint, encode(fake), later + 1),
            (mallory.fingerprint, forged, later),  # and validly signed under mallory's own
        ]:
            await attacker.store(keys.POLICY_VERSION, value, expiration_time=exp, subkey=subkey)
        held = await attacker.get_subkeys(keys.POLICY_VERSION)  # the fakes are live in the DHT
        assert held[coord.fingerprint].value == encode(fake)
        assert held[mallory.fingerprint].value == forged
        assert trainer.peer is not None
        record = await read_policy_version(trainer.peer, coord.public_key)
        assert record is not None and record.version == 1  # what honest readers see

        node = start_node(tmp_path, coord, "node", 'log_level = "DEBUG"\n')
        procs.append(node)
        seen: list[AcceptedRollout] = []

        async def accepted() -> bool:
            seen.extend(await trainer.fetch(seen[-1].seq if seen else 0))
            return len({r.lease_id for r in seen}) >= 2

        await until(accepted, "two accepted leases from the node", 90, node)
        assert {r.policy_version for r in seen} == {1}
        await until(lambda: "status: active v=1" in node.text(), "a status line at v1", 15, node)
        assert holder.asked == Counter(), holder.asked  # neither manifest nor chunk of v99
        assert not (tmp_path / "node" / "checkpoints" / f"v{FAKE:012d}").exists()
        assert not re.search(rf"\bv{FAKE}\b", node.text())
        node_fp = Identity.load(tmp_path / "node" / "node.key").fingerprint

        async def advertised_v1() -> bool:
            advert = (await list_adverts(trainer.peer)).get(node_fp)  # type: ignore[arg-type]
            return advert is not None and advert.policy_version == 1

        await until(advertised_v1, "the node's advert at v1", 20, node)
    finally:
        await holder.stop()
        await attacker.stop()
        await trainer.stop()
