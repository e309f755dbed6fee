"""Who holds which chunks of a version: per-peer bitmaps in the DHT (or in memory for tests),
and the :class:`HolderBook` that merges them with what peers tell each other in the chunk exchange.

Each holder stores ``bitmap`` (bit i = verified chunk i) under ``keys.holders_key(version)`` with
subkey = its libp2p peer id. The :class:`HolderAnnouncer` re-publishes a version's bitmap when it
changes (debounced: at most one DHT store per ``min_interval``) and refreshes it before it expires.
Only a peer that others can dial announces itself (``HolderAnnouncer.paused`` otherwise).

Holder records are not signed: a liar can only claim that some peer holds chunks, which costs a
downloader one failed request and scores that peer down; chunks themselves are always verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from swarm import keys
from swarm.dht import SwarmPeer
from swarm.errors import DhtError, DhtTimeout
from swarm.tasks import cancel_and_wait
from swarm.wire import MAX_TABLE_BYTES, MAX_TABLE_ENTRIES, HolderEntry

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
        self.paused = False
        """True while this peer cannot be dialled: nothing is published (records expire)."""
        self.published = 0  # DHT stores that succeeded
        self.failures = 0  # ... that failed (retried on the next round)
        self.timeouts = 0  # ... of which timed out (a DHT message stuck behind bulk data)

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) publishing; resuming publishes every bitmap at once."""
        if self.paused and not paused:
            self._dirty |= set(self._bitmaps)
            self._wake.set()
        self.paused = paused

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
        """Publish every pending bitmap now (nothing while :attr:`paused`)."""
        if self.paused:
            return
        dirty, self._dirty = self._dirty, set()
        for version in sorted(dirty):
            bitmap = self._bitmaps.get(version)
            if bitmap is None:
                continue
            try:
                await self.directory.publish(version, self.peer_id, bitmap, self.ttl)
                self.published += 1
            except DhtError as exc:
                logger.warning("publishing holders of v%d failed: %s", version, exc)
                self._dirty.add(version)
                self.failures += 1
                self.timeouts += isinstance(exc, DhtTimeout)

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


@dataclass(eq=False)
class Holding:
    """One peer's verified chunks of one version, as last heard (``bits``: bit i = chunk i)."""

    bits: int
    dialable: bool  # others may dial it; False: reachable only over a connection it opened
    at: float  # when heard (HolderBook clock)
    _have: frozenset[int] | None = field(default=None, repr=False)

    @property
    def have(self) -> frozenset[int]:
        """The chunk indices (built once per change of ``bits``)."""
        if self._have is None:
            self._have = keys.indices_from_bits(self.bits)
        return self._have


class HolderBook:
    """What this peer knows about who holds which chunks, per version.

    Three sources feed it: the DHT holder records (:meth:`learn_dht`; only dialable peers
    announce), the peers that ask us for chunks (their own report of what they hold, and whether
    they can be dialled), and the holder tables in the replies we receive (first-hand reports
    relayed by the answering holder). Holdings only grow within a version, so reports are merged
    by union; entries not heard of for ``max_age`` seconds are dropped. A peer that is not
    dialable stays in this peer's own view (it asked us, so a connection exists) but is never
    passed on in :meth:`table`.
    """

    def __init__(self, *, max_age: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self.max_age = max_age
        self.clock = clock
        self._book: dict[int, dict[str, Holding]] = {}
        self._mine: tuple[frozenset[int], int, bytes] = (frozenset(), -1, b"")  # own, packed

    def learn(self, version: int, peer: str, have: Iterable[int], *, dialable: bool) -> None:
        """``peer`` holds ``have`` of ``version`` (merged with what was known)."""
        self.learn_bits(version, peer, keys.bits_from_indices(have), dialable=dialable)

    def learn_bits(self, version: int, peer: str, bits: int, *, dialable: bool) -> None:
        """:meth:`learn` with the chunks as an int (bit i = chunk i)."""
        entries = self._book.setdefault(version, {})
        old = entries.get(peer)
        if old is not None and old.bits | bits == old.bits:  # nothing new: keep its index set
            old.dialable, old.at = dialable, self.clock()
            return
        merged = bits | (old.bits if old is not None else 0)
        entries[peer] = Holding(merged, dialable, self.clock())

    def learn_dht(self, version: int, n_chunks: int, found: dict[str, bytes]) -> None:
        """Holder records read from the DHT, ``{peer: bitmap}`` (their authors announced
        themselves: dialable)."""
        for peer, bitmap in found.items():
            self.learn_bits(version, peer, keys.bits_from_bitmap(bitmap, n_chunks), dialable=True)

    def learn_table(self, version: int, n_chunks: int, entries: Iterable[HolderEntry]) -> None:
        """A holder table received with a chunk."""
        for e in entries:
            self.learn_bits(version, e.peer_id, keys.bits_from_bitmap(e.have, n_chunks),
                            dialable=e.dialable)  # fmt: skip

    def view(self, version: int) -> dict[str, frozenset[int]]:
        """``{peer: chunks}`` of every fresh entry (dialable or connected to us)."""
        cutoff = self.clock() - self.max_age
        entries = self._book.get(version, {})
        for peer in [p for p, h in entries.items() if h.at < cutoff]:
            del entries[peer]
        return {p: h.have for p, h in entries.items()}

    def table(
        self,
        version: int,
        n_chunks: int,
        *,
        me: str,
        my_have: frozenset[int],
        my_dialable: bool,
        exclude: str = "",
    ) -> list[HolderEntry]:
        """The holder table to send with a chunk: this peer first, then the dialable holders
        heard of most recently, within :data:`~swarm.wire.MAX_TABLE_ENTRIES` entries and
        :data:`~swarm.wire.MAX_TABLE_BYTES` bitmap bytes."""
        width = (n_chunks + 7) // 8
        limit = max(1, min(MAX_TABLE_ENTRIES, MAX_TABLE_BYTES // max(width, 1)))
        # the store hands out the same set object until its holdings change: packed once
        if self._mine[0] is not my_have or self._mine[1] != n_chunks:
            self._mine = (my_have, n_chunks, keys.bitmap_from_indices(my_have, n_chunks))
        out = [HolderEntry(peer_id=me, have=self._mine[2], dialable=my_dialable)]
        self.view(version)  # drop stale entries
        entries = self._book.get(version, {})
        ranked = sorted(
            (p for p, h in entries.items() if h.dialable and p not in (me, exclude) and h.bits),
            key=lambda p: -entries[p].at,
        )
        mask = (1 << n_chunks) - 1
        for peer in ranked[: limit - 1]:
            bitmap = keys.bitmap_from_bits(entries[peer].bits & mask, n_chunks)
            out.append(HolderEntry(peer_id=peer, have=bitmap, dialable=True))
        return out

    def forget_except(self, versions: Iterable[int]) -> None:
        """Drop the versions not in ``versions``."""
        keep = set(versions)
        for v in [v for v in self._book if v not in keep]:
            del self._book[v]
