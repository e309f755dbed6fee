"""Signed DHT records: checking them, and the swarm-local record types.

Every value under a signed key of :mod:`swarm.keys` is the encoded ``SignedEnvelope`` of one
message, stored under the subkey = fingerprint of the envelope's signer. :func:`check_signed_record`
is the whole check (used by readers and by :class:`SignedRecordValidator`, which hivemind runs on
every record an honest peer stores or fetches):

1. the value decodes as a ``SignedEnvelope`` and its signature verifies;
2. the subkey equals ``fingerprint_of(envelope.signer)`` - nobody can write another's subkey;
3. the payload decodes strictly as the key's record type (schema, unknown fields, limits);
4. type rules: an advert's ``node_key`` is the signer; the DHT expiration may not outlive the
   record's own signed ``expires_at`` (so an old record cannot be replayed with a longer life).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from msgspec import Meta

from protocol.codec import decode, encode
from protocol.envelope import seal, verify_envelope
from protocol.errors import DecodeError, ProtocolError, ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.messages import CapabilityAdvert, SignedEnvelope
from protocol.schema import U64, Finite, Id, MessageBase
from swarm import keys
from swarm.dht import SwarmPeer

logger = logging.getLogger(__name__)

EXPIRY_SLACK_S = 0.0
"""Allowed excess of a record's DHT expiration over its signed ``expires_at``. Zero: publishers
store with exactly the signed value (no clock is involved), and any excess would let anyone replay
a signer's *older* record with a longer life than its newer one; the DHT keeps the longest-lived
value per subkey, so the stale record would displace the fresh one and block its refreshes."""

Maddr = Annotated[str, Meta(min_length=1, max_length=512)]


class PolicyVersionRecord(MessageBase):
    """The newest policy version a coordinator has published (value under ``POLICY_VERSION``)."""

    version: U64  # newest published checkpoint version
    seed_peer_ids: Annotated[list[Id], Meta(max_length=64)]  # libp2p peers seeding it (base58)
    expires_at: Finite  # record not valid after this time, Unix seconds


class CoordinatorAddress(MessageBase):
    """How to reach a coordinator (value under ``COORDINATOR``)."""

    peer_id: Id  # libp2p peer ID (base58)
    maddrs: Annotated[list[Maddr], Meta(max_length=32)]  # multiaddrs, may be empty (use DHT)
    expires_at: Finite  # record not valid after this time, Unix seconds


RECORD_TYPES: dict[str, Any] = {
    keys.ADVERTS: CapabilityAdvert,
    keys.POLICY_VERSION: PolicyVersionRecord,
    keys.COORDINATOR: CoordinatorAddress,
}


def check_signed_record(
    key: str, subkey: object, value: object, *, expiration_time: float | None = None
) -> tuple[SignedEnvelope, Any]:
    """Return (envelope, payload) of a valid record under ``key``; raise ``ProtocolError``."""
    record_type = RECORD_TYPES[key]
    if not isinstance(subkey, str) or not isinstance(value, bytes):
        raise DecodeError(ReasonCode.SCHEMA, f"{key}: subkey must be str and value bytes")
    env = decode(value, SignedEnvelope)
    verify_envelope(env)
    signer_fp = fingerprint_of(env.signer)
    if subkey != signer_fp:
        raise ProtocolError(
            ReasonCode.BAD_SIGNATURE,
            f"{key}: subkey {subkey[:20]} is not the signer {signer_fp[:20]}",
        )
    payload = decode(env.payload, record_type)
    if isinstance(payload, CapabilityAdvert) and payload.node_key != env.signer:
        raise ProtocolError(ReasonCode.BAD_SIGNATURE, "advert node_key differs from its signer")
    if expiration_time is not None and expiration_time > payload.expires_at + EXPIRY_SLACK_S:
        raise ProtocolError(
            ReasonCode.SCHEMA, f"{key}: DHT expiration outlives the signed expires_at"
        )
    return env, payload


def _make_validator_class() -> type:
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc]
        """Refuses records under signed keys that fail :func:`check_signed_record`."""

        def __init__(self) -> None:
            self._key_ids = {DHTID.generate(source=k).to_bytes(): k for k in keys.SIGNED_KEYS}

        def validate(self, record: DHTRecord) -> bool:
            key = self._key_ids.get(record.key)
            if key is None:
                return True  # not ours
            try:
                subkey = DHTProtocol.serializer.loads(record.subkey)
                value = DHTProtocol.serializer.loads(record.value)
                check_signed_record(key, subkey, value, expiration_time=record.expiration_time)
            except Exception as exc:  # any failure means "refuse this record"
                logger.debug("refusing DHT record under %s: %s", key, exc)
                return False
            return True

    return SignedRecordValidator


def signed_record_validator() -> Any:
    """A hivemind ``RecordValidatorBase`` enforcing :func:`check_signed_record` on signed keys."""
    return _make_validator_class()()


# -- publishing and reading signed records ------------------------------------------------------
async def publish_signed(
    peer: SwarmPeer, identity: Identity, key: str, record: Any, *, now: float | None = None
) -> bool:
    """Seal ``record`` (its ``expires_at`` is the DHT expiry) and store it under our subkey."""
    now = peer.clock() if now is None else now
    value = encode(seal(identity, record, now=now))
    return await peer.store(
        key, value, expiration_time=record.expires_at, subkey=identity.fingerprint
    )


async def read_signed(
    peer: SwarmPeer, key: str, pinned_key: bytes, *, now: float | None = None
) -> Any | None:
    """The valid, unexpired record under ``key`` signed by ``pinned_key``, or None."""
    now = peer.clock() if now is None else now
    entry = (await peer.get_subkeys(key)).get(fingerprint_of(pinned_key))
    if entry is None:
        return None
    try:
        _env, record = check_signed_record(
            key, fingerprint_of(pinned_key), entry.value, expiration_time=entry.expiration_time
        )
    except ProtocolError as exc:
        logger.warning("ignoring %s record of the pinned key: %s", key, exc)
        return None
    return record if record.expires_at >= now else None


async def publish_policy_version(
    peer: SwarmPeer, identity: Identity, version: int, seed_peer_ids: list[str], ttl: float
) -> bool:
    """Coordinator: announce ``version`` as the newest policy, seeded by ``seed_peer_ids``."""
    record = PolicyVersionRecord(
        version=version, seed_peer_ids=seed_peer_ids, expires_at=peer.clock() + ttl
    )
    return await publish_signed(peer, identity, keys.POLICY_VERSION, record)


async def read_policy_version(peer: SwarmPeer, pinned_key: bytes) -> PolicyVersionRecord | None:
    """Node: the newest policy version announced by the pinned coordinator key, or None."""
    record = await read_signed(peer, keys.POLICY_VERSION, pinned_key)
    return record if isinstance(record, PolicyVersionRecord) else None


async def publish_coordinator_address(peer: SwarmPeer, identity: Identity, ttl: float) -> bool:
    """Coordinator: publish its peer ID and multiaddrs under its fingerprint."""
    record = CoordinatorAddress(
        peer_id=peer.peer_id, maddrs=await peer.visible_maddrs(), expires_at=peer.clock() + ttl
    )
    return await publish_signed(peer, identity, keys.COORDINATOR, record)


async def find_coordinator(peer: SwarmPeer, pinned_key: bytes) -> CoordinatorAddress | None:
    """Node: where the coordinator with the pinned key is reachable, or None."""
    record = await read_signed(peer, keys.COORDINATOR, pinned_key)
    return record if isinstance(record, CoordinatorAddress) else None


async def find_coordinator_key(
    peer: SwarmPeer, fingerprint: str
) -> tuple[bytes, CoordinatorAddress] | None:
    """Node/trainer pinned by *fingerprint*: the coordinator's raw key and address, or None.

    The subkey is the pinned fingerprint and :func:`check_signed_record` requires it to equal the
    fingerprint of the record's signer, so the returned key is the pinned one.
    """
    entry = (await peer.get_subkeys(keys.COORDINATOR)).get(fingerprint)
    if entry is None:
        return None
    try:
        env, record = check_signed_record(
            keys.COORDINATOR, fingerprint, entry.value, expiration_time=entry.expiration_time
        )
    except ProtocolError as exc:
        logger.warning("ignoring coordinator record of %s: %s", fingerprint[:20], exc)
        return None
    if not isinstance(record, CoordinatorAddress) or record.expires_at < peer.clock():
        return None
    return env.signer, record
