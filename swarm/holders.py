"""Who holds which chunks of a version: per-peer bitmaps in the DHT (or in memory for tests).

Each holder stores ``bitmap`` (bit i = verified chunk i) under ``keys.holders_key(version)`` with
subkey = its libp2p peer id. The :class:`HolderAnnouncer` re-publishes a version's bitmap when it
changes (debounced: at most one DHT store per ``min_interval``) and refreshes it before it expires.

Holder records are not signed: a liar can only claim that some peer holds chunks, which costs a
downloader one failed request and scores that peer down; chunks themselves are always verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from swarm import keys
from swarm.dht import SwarmPeer
from swarm.errors import DhtError
from swarm.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class HolderDirectory(Protocol):
    """Publishes and looks up chunk bitmaps per version."""

    async def publish(self, version: int, peer_id: str, bitmap: bytes, ttl: float) -> None: ...

    async def lookup(self, version: int) -> dict[str, bytes]: ...


class DhtHolderDirectory:
    """:class:`HolderDirectory` backed by the swarm DHT."""

    def __init__(self, peer: SwarmPeer, *, timeout: float = 3.0) -> None:
        self.peer = peer
        self.timeout = timeout

    async def publish(self, version: int, peer_id: str, bitmap: bytes, ttl: float) -> None:
        await self.peer.store(
            keys.holders_key(version),
            bitmap,
            expiration_time=self.peer.clock() + ttl,
            subkey=peer_id,
            timeout=self.timeout,
        )

    async def lookup(self, version: int) -> dict[str, bytes]:
        entries = await self.peer.get_subkeys(keys.holders_key(version), timeout=self.timeout)
        return {k: e.value for k, e in entries.items() if isinstance(e.value, bytes)}


class MemoryHolderDirectory:
    """:class:`HolderDirectory` shared in memory between test peers (no expiry)."""

    def __init__(self) -> None:
        self.bitmaps: dict[int, dict[str, bytes]] = {}

    async def publish(self, version: int, peer_id: str, bitmap: bytes, ttl: float) -> None:
        self.bitmaps.setdefault(version, {})[peer_id] = bitmap

    async def lookup(self, version: int) -> dict[str, bytes]:
        return dict(self.bitmaps.get(version, {}))


class HolderAnnouncer:
    """Keeps this peer's bitmaps for the versions it holds published.

    Call :meth:`update` whenever the set of verified chunks changes; the announcer publishes the
    latest bitmap at most once per ``min_interval`` and re-publishes every ``ttl / 3``.
    """

    def __init__(
        self,
        directory: HolderDirectory,
        peer_id: str,
        *,
        min_interval: float = 0.2,
        ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.peer_id = peer_id
        self.min_interval = min_interval
        self.ttl = ttl
        self.clock = clock
        self._bitmaps: dict[int, bytes] = {}
        self._dirty: set[int] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def update(self, version: int, indices: frozenset[int], n_chunks: int) -> None:
        """Schedule publishing ``indices`` as this peer's holdings of ``version``."""
        self._bitmaps[version] = keys.bitmap_from_indices(indices, n_chunks)
        self._dirty.add(version)
        self._wake.set()

    def versions(self) -> list[int]:
        """Versions whose bitmaps are being kept published."""
        return sorted(self._bitmaps)

    def forget(self, version: int) -> None:
        """Stop refreshing ``version`` (its record then expires after ``ttl``)."""
        self._bitmaps.pop(version, None)
        self._dirty.discard(version)

    async def flush(self) -> None:
        """Publish every pending bitmap now."""
        dirty, self._dirty = self._dirty, set()
        for version in sorted(dirty):
            bitmap = self._bitmaps.get(version)
            if bitmap is None:
                continue
            try:
                await self.directory.publish(version, self.peer_id, bitmap, self.ttl)
            except DhtError as exc:
                logger.warning("publishing holders of v%d failed: %s", version, exc)
                self._dirty.add(version)

    async def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=f"holder-announcer-{self.peer_id}")

    async def _loop(self) -> None:
        refresh = self.ttl / 3
        next_refresh = self.clock() + refresh
        while not self._stopping:
            # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation that
            # races with the event, which would keep this loop alive after stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_refresh - self.clock())):
                    await self._wake.wait()
            self._wake.clear()
            if self.clock() >= next_refresh:
                self._dirty |= set(self._bitmaps)
                next_refresh = self.clock() + refresh
            await self.flush()
            await asyncio.sleep(self.min_interval)

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
