"""One download of one version: which chunk to fetch next, from whom, and what to do on failure.

Policy (DESIGN.md §5):

* **rarest first**: among missing chunks not in flight, fewest known holders first (random ties,
  so receivers spread over different chunks of the seed);
* **best peer**: among a chunk's holders with a free slot, the highest score divided by its load;
* **seed last**: a seed only gets the request slots that peers could not fill (chunks nobody
  else holds, or whose holders are all busy), and is asked for *any one* of those chunks
  (``ChunkAnyRequest``): it sends the one it has sent least often, so chunks nobody holds go out
  first, concurrent receivers pull different chunks, and an idle seed uplink still helps the tail;
* **verify before keep**: ``ChunkStore.put_chunk`` checks the hash; the chunk is then served to
  others at once and announced (debounced) in the holder directory;
* a peer that serves a bad chunk, stalls or breaks the stream is dropped for this transfer and
  scored down; the chunk goes back to the pool and is fetched elsewhere. A peer that served a bad
  chunk (or manifest) before is not asked at all (``PeerScores.shunned``). A seed is never dropped,
  only backed off; after ``max_seed_failures`` consecutive seed failures with nowhere else to go the
  transfer fails with ``ChunkUnavailable``;
* a peer that answers ``not_held`` for a chunk it announced is not asked for that chunk again in
  this transfer (re-reading the holder records must not restore a false claim).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Set
from dataclasses import dataclass
from typing import Any

from protocol.codec import decode, encode
from protocol.errors import DecodeError, ProtocolError, ReasonCode
from protocol.limits import CHUNK_FRAME_OVERHEAD
from protocol.messages import Chunk, ChunkRequest, Manifest
from swarm import keys
from swarm.chunks import ChunkStore
from swarm.errors import ChunkUnavailable, RemoteError, SwarmError, TransportError
from swarm.holders import HolderAnnouncer, HolderDirectory
from swarm.scoring import PeerScores
from swarm.tasks import cancel_and_wait
from swarm.transport import Transport
from swarm.wire import ChunkAnyRequest

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""``(verified bytes, total bytes)`` of the version being downloaded."""


@dataclass(frozen=True)
class DownloadConfig:
    """Knobs of the downloader (seconds unless stated)."""

    max_parallel: int = 8  # concurrent chunk requests of one transfer
    per_peer_parallel: int = 2  # concurrent requests to one non-seed peer
    seed_parallel: int = 2  # concurrent requests to one seed
    chunk_timeout: float = 120.0  # deadline of one chunk request
    stall_timeout: float = 10.0  # a request with no bytes for this long is a stall
    manifest_timeout: float = 10.0  # deadline of one manifest request
    holders_refresh: float = 0.5  # how often holder bitmaps are re-read
    busy_backoff: float = 0.2  # pause before asking a peer that answered "busy" again
    seed_backoff: float = 1.0  # pause before retrying a seed that failed
    max_seed_failures: int = 5  # consecutive seed failures before giving up
    deadline: float = 3600.0  # whole transfer
    hedge_after: float = 3.0  # end-game: a chunk in flight this long is also asked of another peer
    reserve_bytes: int = 0  # free disk space a download must leave (bytes)


class Transfer:
    """Downloads the missing chunks of ``manifest`` into ``store``; see the module docstring."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        transport: Transport,
        store: ChunkStore,
        directory: HolderDirectory,
        seeds: list[str],
        scores: PeerScores,
        config: DownloadConfig,
        chunk_rpc: str,
        chunk_any_rpc: str,
        announcer: HolderAnnouncer | None = None,
        on_progress: ProgressFn | None = None,
        wanted: Iterable[int] | None = None,
    ) -> None:
        self.m = manifest
        self.transport, self.store, self.directory = transport, store, directory
        self.seeds = set(seeds)
        self.scores, self.cfg = scores, config
        self.chunk_rpc, self.chunk_any_rpc = chunk_rpc, chunk_any_rpc
        self.announcer, self.on_progress = announcer, on_progress
        self.n = len(manifest.chunks)
        #: the chunks this transfer is for (one part of the version; default every chunk)
        self.wanted = set(range(self.n)) if wanted is None else set(wanted)
        self.missing = self.wanted - store.have(manifest.version)
        self.total_bytes = sum(manifest.chunks[i].size for i in self.wanted)
        self.holders: dict[str, frozenset[int]] = {}
        #: chunks a peer announced but answered "not_held" for: its claim is ignored from then on
        self.denied: dict[str, set[int]] = {}
        self.dropped: set[str] = set()
        self.backoff: dict[str, float] = {}
        self.load: Counter[str] = Counter()
        self.inflight: dict[asyncio.Task[int], tuple[int, str]] = {}
        self.started: dict[asyncio.Task[int], float] = {}
        self.hedged: set[int] = set()  # chunk indices already asked of a second peer
        self.seed_failures = 0
        self.done_bytes = self.total_bytes - sum(manifest.chunks[i].size for i in self.missing)
        self.sources: Counter[str] = Counter()  # chunks received per peer (for stats)
        self.bad: dict[str, str] = {}  # peers that served a bad chunk here -> reason code
        self.shunned: set[str] = set()  # holders skipped: they served bad data before
        self._closing = False

    # -- main loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        start = time.monotonic()
        self._announce()
        self._progress()
        if self.missing:
            await self._refresh()  # know the holders before asking anyone (spares the seed)
        refresher = asyncio.create_task(self._refresh_loop(), name="holders-refresh")
        try:
            while self.missing:
                if time.monotonic() - start > self.cfg.deadline:
                    raise ChunkUnavailable(self._missing_msg("deadline passed"))
                self._schedule()
                if not self.inflight:
                    await asyncio.sleep(self.cfg.holders_refresh)  # wait for fresh holder info
                    continue
                done, _ = await asyncio.wait(
                    self.inflight, timeout=self.cfg.holders_refresh, return_when="FIRST_COMPLETED"
                )
                for task in done:
                    self._settle(task)
        finally:
            self._closing = True
            # also collects requests that failed after the transfer had already failed
            await cancel_and_wait([refresher, *self.inflight])
            if self.announcer is not None:
                self._announce()
                await self.announcer.flush()

    async def _refresh(self) -> None:
        me = self.transport.peer_id
        with contextlib.suppress(SwarmError):
            found = await self.directory.lookup(self.m.version)
            self.holders = {
                p: keys.indices_from_bitmap(b, self.n) - self.denied.get(p, set())
                for p, b in found.items()
                if p != me
            }
            self.shunned |= {p for p in self.holders if self._shunned(p)}

    def _shunned(self, peer: str) -> bool:
        return peer not in self.seeds and self.scores.shunned(peer)

    async def _refresh_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.holders_refresh)
            await self._refresh()

    # -- choosing ------------------------------------------------------------------------------
    def _available(self, peer: str, now: float) -> bool:
        limit = self.cfg.seed_parallel if peer in self.seeds else self.cfg.per_peer_parallel
        return self.load[peer] < limit and self.backoff.get(peer, 0.0) <= now

    def _pick(self, peers: list[str]) -> str:
        return max(
            peers, key=lambda p: (self.scores.score(p) / (1 + self.load[p]), random.random())
        )

    def _schedule(self) -> None:
        now = time.monotonic()
        busy = {i for i, _ in self.inflight.values()}
        skip = self.dropped | self.seeds | self.shunned
        others = {p: s for p, s in self.holders.items() if p not in skip}
        rarity: Counter[int] = Counter()
        for s in others.values():
            rarity.update(s)
        todo = [i for i in self.missing if i not in busy]
        random.shuffle(todo)
        todo.sort(key=lambda i: rarity[i])
        leftover: set[int] = set()
        for index in todo:  # rarest first, from the best non-seed holder with a free slot
            if len(self.inflight) >= self.cfg.max_parallel:
                return
            ready = [p for p, s in others.items() if index in s and self._available(p, now)]
            if ready:
                peer = self._pick(ready)
                self._launch(self._fetch(index, peer), index, peer)
            else:
                leftover.add(index)
        # The seed is the last resort: it only gets the slots peers could not fill, and is asked
        # for *any* chunk of the leftover; it sends the one it has sent least often, so chunks
        # nobody holds go out first and concurrent receivers get different chunks.
        me = self.transport.peer_id
        for seed in sorted(self.seeds - {me}, key=lambda p: -self.scores.score(p)):
            while (
                leftover
                and len(self.inflight) < self.cfg.max_parallel
                and self._available(seed, now)
            ):
                self._launch(self._fetch_any(seed, frozenset(leftover)), -1, seed)
        if not todo:
            self._hedge(now, others)

    def _hedge(self, now: float, others: dict[str, frozenset[int]]) -> None:
        """End-game: every missing chunk is in flight; a request that has been running for
        ``hedge_after`` seconds (a slow or silently stuck peer) is duplicated to another holder,
        or to a seed. The first copy to verify wins; the loser is cancelled when the transfer
        ends. At most one duplicate per chunk, so the extra traffic is bounded by the tail."""
        me = self.transport.peer_id
        for task, (index, peer) in list(self.inflight.items()):
            if index < 0 or index in self.hedged or index not in self.missing:
                continue
            if now - self.started.get(task, now) < self.cfg.hedge_after:
                continue
            if len(self.inflight) >= self.cfg.max_parallel:
                return
            alts = [p for p, s in others.items()
                    if index in s and p != peer and self._available(p, now)]  # fmt: skip
            seeds = [p for p in self.seeds - {me, peer} if self._available(p, now)]
            if alts:
                alt = self._pick(alts)
                self._launch(self._fetch(index, alt), index, alt)
            elif seeds:
                seed = self._pick(seeds)
                self._launch(self._fetch_any(seed, frozenset({index})), -1, seed)
            else:
                continue
            self.hedged.add(index)
            logger.info("chunk %d from %s is slow; also asking another peer", index, peer[:12])

    def _launch(self, coro: Coroutine[Any, Any, int], index: int, peer: str) -> None:
        self.load[peer] += 1
        task = asyncio.create_task(coro, name=f"chunk-{index}-{peer[-8:]}")
        self.inflight[task] = (index, peer)
        self.started[task] = time.monotonic()

    async def _fetch(self, index: int, peer: str) -> int:
        """Chunk ``index`` from ``peer``; returns the index."""
        request = ChunkRequest(version=self.m.version, index=index)
        return await self._get(peer, self.chunk_rpc, encode(request), {index})

    async def _fetch_any(self, peer: str, wanted: frozenset[int]) -> int:
        """Any one chunk of ``wanted`` from a seed; returns the index it chose."""
        request = ChunkAnyRequest(
            version=self.m.version, wanted=keys.bitmap_from_indices(wanted, self.n)
        )
        return await self._get(peer, self.chunk_any_rpc, encode(request), wanted)

    async def _get(self, peer: str, rpc: str, request: bytes, allowed: Set[int]) -> int:
        t0 = time.monotonic()
        raw = await self.transport.call(
            peer,
            rpc,
            request,
            timeout=self.cfg.chunk_timeout,
            stall_timeout=self.cfg.stall_timeout,
            max_response_bytes=self.m.chunk_size + CHUNK_FRAME_OVERHEAD,
        )
        msg = decode(raw, Chunk)
        if msg.version != self.m.version or msg.index not in allowed:
            raise DecodeError(ReasonCode.SCHEMA, f"got chunk {msg.index} of v{msg.version}")
        self.store.put_chunk(self.m.version, msg.index, msg.data)  # verifies the hash
        self.scores.success(peer, len(msg.data), time.monotonic() - t0)
        self.done_bytes += len(msg.data) if msg.index in self.missing else 0
        self.missing.discard(msg.index)
        self.sources[peer] += 1
        return msg.index

    # -- outcomes ------------------------------------------------------------------------------
    def _settle(self, task: asyncio.Task[int]) -> None:
        index, peer = self.inflight.pop(task)
        self.started.pop(task, None)
        self.load[peer] -= 1
        is_seed = peer in self.seeds
        exc = task.exception()
        if exc is None:
            self.seed_failures = 0 if is_seed else self.seed_failures
            self._announce()
            self._progress()
            return
        if isinstance(exc, RemoteError) and exc.code == "busy":
            self.backoff[peer] = time.monotonic() + self.cfg.busy_backoff
            return
        if isinstance(exc, RemoteError) and exc.code == "not_held" and index >= 0:
            # Remembered for the whole transfer: a re-read holder record (or a liar) would
            # otherwise restore the claim and the peer would be asked again and again.
            self.denied.setdefault(peer, set()).add(index)
            self.holders[peer] = self.holders.get(peer, frozenset()) - {index}
            return
        if isinstance(exc, ProtocolError):
            self.scores.bad_chunk(peer)
            self.bad[peer] = str(exc.code)
            logger.warning("bad chunk %d from %s: %s", index, peer, exc)
        elif isinstance(exc, TransportError):
            self.scores.failure(peer)
            # a seed that does not hold the version yet is routine (it is about to seed it)
            quiet = isinstance(exc, RemoteError) and exc.code == "not_held"
            logger.log(logging.DEBUG if quiet else logging.INFO,
                       "chunk %d from %s failed: %s", index, peer, exc)  # fmt: skip
        else:
            raise exc
        if not is_seed:
            self.dropped.add(peer)
            return
        self.backoff[peer] = time.monotonic() + self.cfg.seed_backoff
        self.seed_failures += 1
        if self.seed_failures >= self.cfg.max_seed_failures:
            raise ChunkUnavailable(self._missing_msg(f"seed failed {self.seed_failures} times"))

    def _announce(self) -> None:
        if self.announcer is not None:
            self.announcer.update(self.m.version, self.store.have(self.m.version), self.n)

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, self.total_bytes)

    def _missing_msg(self, why: str) -> str:
        missing = sorted(self.missing)
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        if self.bad:
            bad = ", ".join(f"{p[:16]}: {code}" for p, code in sorted(self.bad.items())[:4])
            why += f"; dropped {len(self.bad)} peer(s) that served bad chunks ({bad})"
        if self.shunned - set(self.bad):
            why += f"; skipped {len(self.shunned - set(self.bad))} holder(s) that served bad data"
        return (
            f"v{self.m.version}: {len(missing)} chunk(s) unavailable ({shown}): {why}; "
            "check that the seed is reachable"
        )
