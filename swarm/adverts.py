"""Signed capability adverts in the DHT: announce our own, list everyone's verified ones.

A node seals its ``CapabilityAdvert`` with its Ed25519 key and stores it under
``keys.ADVERTS`` with subkey = its fingerprint. The announcer refreshes it every ``period``
seconds with ``expires_at = now + 2 * period``, so a node that vanishes drops out of
:func:`list_adverts` within two periods. Readers keep only records that pass
:func:`swarm.records.check_signed_record` and have not expired; honest peers additionally refuse
bad records at store time (:func:`swarm.records.signed_record_validator`, installed by
:func:`swarm_validators`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from protocol.codec import encode
from protocol.envelope import seal
from protocol.errors import ProtocolError
from protocol.identity import Identity
from protocol.messages import CapabilityAdvert
from swarm import keys
from swarm.dht import SwarmPeer
from swarm.errors import DhtError
from swarm.records import check_signed_record, signed_record_validator
from swarm.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 30.0


def swarm_validators() -> list[Any]:
    """Record validators every rollout-swarm peer installs (pass to ``SwarmPeer``)."""
    return [signed_record_validator()]


def seal_advert(
    identity: Identity, advert: CapabilityAdvert, *, peer_id: str, now: float, ttl: float
) -> bytes:
    """The DHT value for ``advert``: node_key, peer_id and expires_at filled in, sealed, encoded."""
    advert = msgspec.structs.replace(
        advert, node_key=identity.public_key, peer_id=peer_id, expires_at=now + ttl
    )
    return encode(seal(identity, advert, now=now))


async def list_adverts(
    peer: SwarmPeer, *, now: float | None = None, timeout: float | None = None
) -> dict[str, CapabilityAdvert]:
    """Verified, unexpired adverts found in the DHT: ``{node fingerprint: advert}``.

    Records that fail verification are skipped (logged at DEBUG), never raised.
    """
    now = peer.clock() if now is None else now
    out: dict[str, CapabilityAdvert] = {}
    for subkey, entry in (await peer.get_subkeys(keys.ADVERTS, timeout=timeout)).items():
        try:
            _env, advert = check_signed_record(
                keys.ADVERTS, subkey, entry.value, expiration_time=entry.expiration_time
            )
        except ProtocolError as exc:
            logger.debug("ignoring advert record %s: %s", subkey[:24], exc)
            continue
        if advert.expires_at < now:
            continue
        out[subkey] = advert
    return out


class AdvertAnnouncer:
    """Re-announces this node's advert every ``period`` seconds until stopped.

    ``build`` returns the current advert (fresh throughput figures, loaded version); the announcer
    fills in ``node_key``, ``peer_id`` and ``expires_at`` itself.
    """

    def __init__(
        self,
        peer: SwarmPeer,
        identity: Identity,
        build: Callable[[], CapabilityAdvert],
        *,
        period: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if period <= 0:
            raise ValueError(f"period must be > 0 s, got {period}")
        self.peer = peer
        self.identity = identity
        self.build = build
        self.period = period
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.announcements = 0

    async def announce_once(self) -> bool:
        """Store the advert now; True when at least one DHT peer accepted it."""
        now = self.clock()
        value = seal_advert(
            self.identity, self.build(), peer_id=self.peer.peer_id, now=now, ttl=2 * self.period
        )
        ok = await self.peer.store(
            keys.ADVERTS,
            value,
            expiration_time=now + 2 * self.period,
            subkey=self.identity.fingerprint,
            timeout=min(self.period, self.peer.config.dht_timeout),
        )
        self.announcements += int(ok)
        return ok

    async def start(self) -> None:
        """Announce once (errors propagate), then keep re-announcing in a background task."""
        if not await self.announce_once():
            logger.warning("advert was not accepted by any DHT peer; will retry")
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=f"advert-announcer-{self.peer.peer_id}")

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.period)
            try:
                if not await self.announce_once():
                    logger.warning("advert refresh not accepted by any DHT peer")
            except DhtError as exc:
                logger.warning("advert refresh failed: %s", exc)

    async def stop(self) -> None:
        """Stop re-announcing; the advert then expires within ``2 * period``."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
