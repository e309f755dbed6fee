"""One download of one version: which chunk to fetch next, from whom, and what to do on failure.

Policy (DESIGN.md §5):

* **who holds what** comes from the :class:`~swarm.holders.HolderBook`: DHT holder records, plus
  what peers report in the chunk exchange itself (every request carries the asker's verified
  chunks, every reply the answering holder's table), so holder information does not depend on DHT
  messages that queue behind bulk data on a busy link;
* **rarest first**: among missing chunks not in flight, fewest known holders first (random ties,
  so receivers spread over different chunks of the seed);
* **best peer**: among a chunk's holders with a free slot, the highest score divided by its load;
* **seed last**: a seed only gets the request slots that peers could not fill (chunks nobody
  else holds, or whose holders are all busy), and is asked for *any one* of those chunks: it sends
  the one it has sent least often, so chunks nobody holds go out first, concurrent receivers pull
  different chunks, and an idle seed uplink still helps the tail;
* **verify before keep**: ``ChunkStore.put_chunk`` checks the hash; the chunk is then served to
  others at once and announced (debounced) in the holder directory;
* a request is given up when it **progresses too slowly** (fewer than ``min_rate`` bytes/s over
  any ``stall_timeout`` window, not only when no byte comes at all) or its stream cannot be
  opened within ``connect_timeout`` (a holder behind NAT, or gone);
* a peer that serves a bad chunk, stalls or breaks the stream is dropped for this transfer and
  scored down; one that cannot be dialled is backed off (``PeerScores.dial_failed``: 30 s,
  doubling); the chunk goes back to the pool and is fetched elsewhere. A peer that served a bad
  chunk (or manifest) before is not asked at all (``PeerScores.shunned``). A seed is never
  dropped, only backed off (growing pauses: libp2p's own dial back-off lasts seconds); the
  transfer fails with ``ChunkUnavailable`` only after ``max_seed_failures`` consecutive seed
  failures spanning at least ``seed_grace`` seconds with nowhere else to go;
* a peer that answers ``not_held`` for a chunk it announced is not asked for that chunk again in
  this transfer (re-reading the holder records must not restore a false claim).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Set
from dataclasses import dataclass
from typing import Any

from protocol.codec import decode, encode
from protocol.errors import DecodeError, ProtocolError, ReasonCode
from protocol.limits import CHUNK_FRAME_OVERHEAD, Limits
from protocol.messages import Chunk, ChunkRequest, Manifest
from swarm import keys
from swarm.chunks import ChunkStore
from swarm.errors import ChunkUnavailable, DialFailed, RemoteError, SwarmError, TransportError
from swarm.holders import HolderAnnouncer, HolderBook, HolderDirectory
from swarm.scoring import PeerScores
from swarm.tasks import cancel_and_wait
from swarm.transport import Transport
from swarm.wire import TABLE_OVERHEAD, ChunkAnyRequest, ExchangeReply, ExchangeRequest

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
    stall_timeout: float = 10.0  # window of the progress check (and longest silence)
    min_rate: float = 32 * 1024  # bytes/s a request must keep up over every stall_timeout window
    connect_timeout: float = 5.0  # opening a stream, dialling the peer if need be
    manifest_timeout: float = 10.0  # deadline of one manifest request
    manifest_deadline: float = 60.0  # retry manifest requests (dial back-off, joins) this long
    holders_refresh: float = 1.0  # re-read the DHT's holder records this often while it finds
    holders_refresh_max: float = 8.0  # holders not met yet; else the pause doubles up to this
    first_lookup: float = 0.3  # wait at most this long for a first DHT holder lookup
    busy_backoff: float = 0.2  # pause before asking a peer that answered "busy" again
    stall_backoff: float = 5.0  # pause before asking a peer whose request stalled again
    seed_backoff: float = 1.0  # first pause before retrying a failed seed (doubles, max 8x)
    max_seed_failures: int = 5  # consecutive seed failures before giving up ...
    seed_grace: float = 30.0  # ... if they also span at least this long
    deadline: float = 3600.0  # whole transfer
    hedge_after: float = 3.0  # end-game: a chunk in flight this long is also asked of another peer
    reserve_bytes: int = 0  # free disk space a download must leave (bytes)


@dataclass
class Flight:
    """One chunk request in flight."""

    index: int  # the chunk asked for; -1 when a seed may choose among several
    peer: str
    started: float
    received: int = 0  # bytes of the response read so far
    mark_t: float = 0.0  # start of the current progress window
    mark_bytes: int = 0  # ``received`` at that time
    stalled: bool = False  # cancelled for progressing too slowly


class Transfer:
    """Downloads the missing chunks of ``manifest`` into ``store``; see the module docstring.

    ``exchange_rpc`` (default: the old per-chunk RPCs only) is the combined chunk + holder-table
    RPC; peers that do not serve it are asked with ``chunk_rpc`` / ``chunk_any_rpc``.
    ``windowed_rpc``, when given, is the same exchange answered through the server's bulk window
    (acknowledged as it arrives, :mod:`swarm.bulkwindow`), asked first; peers that do not serve
    it are asked with ``exchange_rpc``.
    ``dialable()`` says whether this peer accepts connections (reported to the peers it asks).
    """

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
        exchange_rpc: str | None = None,
        windowed_rpc: str | None = None,
        book: HolderBook | None = None,
        dialable: Callable[[], bool] = lambda: True,
        wanted: Iterable[int] | None = None,
    ) -> None:
        self.m = manifest
        self.transport, self.store, self.directory = transport, store, directory
        self.seeds = set(seeds)
        self.scores, self.cfg = scores, config
        self.chunk_rpc, self.chunk_any_rpc = chunk_rpc, chunk_any_rpc
        self.exchange_rpc = exchange_rpc
        self.windowed_rpc = windowed_rpc if exchange_rpc is not None else None
        self.book = book if book is not None else HolderBook()
        self.dialable = dialable
        self.announcer, self.on_progress = announcer, on_progress
        self.n = len(manifest.chunks)
        #: an ExchangeReply is a chunk plus a bounded holder table
        self.reply_limits = Limits(
            control_frame=manifest.chunk_size + CHUNK_FRAME_OVERHEAD + TABLE_OVERHEAD
        )
        #: the chunks this transfer is for (one part of the version; default every chunk)
        self.wanted = set(range(self.n)) if wanted is None else set(wanted)
        self.missing = self.wanted - store.have(manifest.version)
        self.total_bytes = sum(manifest.chunks[i].size for i in self.wanted)
        self.holders: dict[str, frozenset[int]] = {}
        #: chunks a peer announced but answered "not_held" for: its claim is ignored from then on
        self.denied: dict[str, set[int]] = {}
        self.dropped: set[str] = set()
        self.backoff: dict[str, float] = {}
        self.legacy: set[str] = set()  # peers that do not serve exchange_rpc
        self.unwindowed: set[str] = set()  # peers that do not serve windowed_rpc
        self.load: Counter[str] = Counter()
        self.inflight: dict[asyncio.Task[int], Flight] = {}
        self.hedged: set[int] = set()  # chunk indices already asked of a second peer
        self.seed_failures = 0
        self.seed_failing_since: float | None = None
        self.done_bytes = self.total_bytes - sum(manifest.chunks[i].size for i in self.missing)
        self.sources: Counter[str] = Counter()  # chunks received per peer (for stats)
        self.bad: dict[str, str] = {}  # peers that served a bad chunk here -> reason code
        self.shunned: set[str] = set()  # holders skipped: they served bad data before
        self.stalls = 0  # requests given up for progressing too slowly
        #: (Unix time, chunk index, source peer) per verified chunk (for benchmarks)
        self.timeline: list[tuple[float, int, str]] = []
        #: Unix times of the start-up steps (for benchmarks): ``start`` (run began: the manifest
        #: is verified), ``lookup`` (first DHT holder lookup answered), ``request`` (first chunk
        #: request sent), ``byte`` (first bytes of an answer read)
        self.marks: dict[str, float] = {}
        self._closing = False
        self._looked_up = asyncio.Event()
        self.lookups = 0  # DHT holder lookups answered
        #: ties in rarity are broken by this random order of the chunks (one per transfer, so
        #: that receivers take different chunks from the seed and then trade them)
        self._tiebreak = random.sample(range(self.n), self.n)
        self._have_bitmap: tuple[frozenset[int], bytes] = (frozenset(), b"")

    # -- main loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        start = time.monotonic()
        self.marks["start"] = time.time()
        self._announce()
        self._progress()
        refresher = asyncio.create_task(self._refresh_loop(), name="holders-refresh")
        try:
            if self.missing and self.cfg.first_lookup > 0:  # know the holders before asking
                waiter = asyncio.create_task(self._looked_up.wait())
                await asyncio.wait([waiter, refresher], timeout=self.cfg.first_lookup,
                                   return_when="FIRST_COMPLETED")  # fmt: skip
                waiter.cancel()
            while self.missing:
                now = time.monotonic()
                if now - start > self.cfg.deadline:
                    raise ChunkUnavailable(self._missing_msg("deadline passed"))
                self._check_progress(now)
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

    async def _refresh(self) -> bool:
        """Read the version's holder records from the DHT into the book; whether they named a
        holder the book did not know."""
        try:
            found = await self.directory.lookup(self.m.version)
        except SwarmError as exc:
            logger.debug("holder lookup for v%d failed: %s", self.m.version, exc)
            self.marks.setdefault("lookup", time.time())
            return False
        finally:
            self._looked_up.set()
        self.marks.setdefault("lookup", time.time())
        self.lookups += 1
        known = self.book.view(self.m.version)
        me = self.transport.peer_id
        self.book.learn_dht(self.m.version, self.n, found)
        return any(p not in known and p != me for p in found)

    def _update_holders(self) -> None:
        me = self.transport.peer_id
        self.holders = {
            p: have - self.denied.get(p, set())
            for p, have in self.book.view(self.m.version).items()
            if p != me
        }
        self.shunned |= {p for p in self.holders if self._shunned(p)}

    def _shunned(self, peer: str) -> bool:
        return peer not in self.seeds and self.scores.shunned(peer)

    async def _refresh_loop(self) -> None:
        """Re-read the DHT every ``holders_refresh`` while it names holders not met yet; after
        a lookup that names none the pause doubles, up to ``holders_refresh_max``. Once the
        holders are met, the exchange's own tables carry what they hold, and a lookup costs CPU
        on every DHT node it visits: with 16 receivers re-reading every second, the DHT
        processes used as much CPU as the chunk transfers themselves (docs/swarm.md)."""
        pause = self.cfg.holders_refresh
        ceiling = max(self.cfg.holders_refresh, self.cfg.holders_refresh_max)
        while not self._closing:
            pause = self.cfg.holders_refresh if await self._refresh() else min(2 * pause, ceiling)
            await asyncio.sleep(pause)

    # -- choosing ------------------------------------------------------------------------------
    def _available(self, peer: str, now: float) -> bool:
        limit = self.cfg.seed_parallel if peer in self.seeds else self.cfg.per_peer_parallel
        if peer not in self.seeds and self.scores.backed_off(peer, now):
            return False
        return self.load[peer] < limit and self.backoff.get(peer, 0.0) <= now

    def _pick(self, peers: list[str]) -> str:
        return max(
            peers, key=lambda p: (self.scores.score(p) / (1 + self.load[p]), random.random())
        )

    def _schedule(self) -> None:
        """Fill the free request slots: missing chunks rarest first (random among equals, a
        per-transfer order), each from the best non-seed holder with a free slot; the chunks no
        such holder has go to the seeds. Set operations in C do the per-chunk work: with
        thousands of chunks this runs after every completed chunk."""
        now = time.monotonic()
        self._update_holders()
        if len(self.inflight) >= self.cfg.max_parallel:
            return
        busy = {f.index for f in self.inflight.values()}
        skip = self.dropped | self.seeds | self.shunned
        others = {p: s for p, s in self.holders.items() if p not in skip}
        todo = self.missing - busy
        # peers with a free slot, and what of the todo each holds
        ready = {p: s & todo for p, s in others.items() if self._available(p, now)}
        ready = {p: s for p, s in ready.items() if s}
        leftover = set(todo)
        if ready:
            held = set().union(*ready.values())
            rarity: Counter[int] = Counter()
            for s in others.values():
                rarity.update(s & held)
            order = sorted(held, key=self._tiebreak.__getitem__)
            order.sort(key=rarity.__getitem__)  # stable: ties keep the random order
            for index in order:  # rarest first
                if len(self.inflight) >= self.cfg.max_parallel:
                    return
                holders = [p for p, s in ready.items() if index in s]
                if not holders:
                    continue
                peer = self._pick(holders)
                self._launch(self._request(peer, frozenset({index})), index, peer)
                leftover.discard(index)
                if not self._available(peer, now):
                    del ready[peer]
                    if not ready:  # no holder has a free slot: the rest are the seeds'
                        break
        # The seed is the last resort: it only gets the slots peers could not fill, and is asked
        # for *any* chunk of the leftover; it sends the one it has sent least often, so chunks
        # nobody holds go out first and concurrent receivers get different chunks. Each "any"
        # request open will take one chunk of the leftover: no more are opened than chunks are
        # left, else the seed sends the last ones twice. One open for ``hedge_after`` seconds
        # counts no more (the end-game's duplicate of a slow request, as for the others).
        me = self.transport.peer_id
        anys = sum(1 for f in self.inflight.values()
                   if f.index < 0 and now - f.started < self.cfg.hedge_after)  # fmt: skip
        for seed in sorted(self.seeds - {me}, key=lambda p: -self.scores.score(p)):
            while (
                len(leftover) > anys
                and len(self.inflight) < self.cfg.max_parallel
                and self._available(seed, now)
            ):
                self._launch(self._request(seed, frozenset(leftover)), -1, seed)
                anys += 1
        if not todo:
            self._hedge(now, others)

    def _hedge(self, now: float, others: dict[str, frozenset[int]]) -> None:
        """End-game: every missing chunk is in flight; a request that has been running for
        ``hedge_after`` seconds (a slow or silently stuck peer) is duplicated to another holder,
        or to a seed. The first copy to verify wins; the loser is cancelled when the transfer
        ends. At most one duplicate per chunk, so the extra traffic is bounded by the tail."""
        me = self.transport.peer_id
        for f in list(self.inflight.values()):
            index, peer = f.index, f.peer
            if index < 0 or index in self.hedged or index not in self.missing:
                continue
            if now - f.started < self.cfg.hedge_after:
                continue
            if len(self.inflight) >= self.cfg.max_parallel:
                return
            alts = [p for p, s in others.items()
                    if index in s and p != peer and self._available(p, now)]  # fmt: skip
            seeds = [p for p in self.seeds - {me, peer} if self._available(p, now)]
            if alts:
                alt = self._pick(alts)
                self._launch(self._request(alt, frozenset({index})), index, alt)
            elif seeds:
                seed = self._pick(seeds)
                self._launch(self._request(seed, frozenset({index})), -1, seed)
            else:
                continue
            self.hedged.add(index)
            logger.info("chunk %d from %s is slow; also asking another peer", index, peer[:12])

    def _launch(self, coro: Callable[[Flight], Coroutine[Any, Any, int]], index: int,
                peer: str) -> None:  # fmt: skip
        self.load[peer] += 1
        self.marks.setdefault("request", time.time())
        now = time.monotonic()
        flight = Flight(index, peer, now, mark_t=now)
        task = asyncio.create_task(coro(flight), name=f"chunk-{index}-{peer[-8:]}")
        self.inflight[task] = flight

    def _check_progress(self, now: float) -> None:
        """Give up requests that received fewer than ``min_rate`` bytes/s over a whole
        ``stall_timeout`` window: a trickle must not hold a chunk (and its slot) for minutes."""
        window = self.cfg.stall_timeout
        for task, f in self.inflight.items():
            if f.stalled or now - f.mark_t < window:
                continue
            if f.received - f.mark_bytes < self.cfg.min_rate * (now - f.mark_t):
                f.stalled = True
                task.cancel()
                logger.info(
                    "chunk %d from %s: %d B in %.0f s, under %.0f KiB/s; giving up on it",
                    f.index, f.peer[:12], f.received - f.mark_bytes, now - f.mark_t,
                    self.cfg.min_rate / 1024,
                )  # fmt: skip
            else:
                f.mark_t, f.mark_bytes = now, f.received

    # -- requests ------------------------------------------------------------------------------
    def _request(
        self, peer: str, wanted: frozenset[int]
    ) -> Callable[[Flight], Coroutine[Any, Any, int]]:
        """A request for one chunk of ``wanted`` from ``peer`` (returns the index received)."""

        async def go(flight: Flight) -> int:
            if self.exchange_rpc is None or peer in self.legacy:
                return await self._legacy(peer, wanted, flight)
            have = self.store.have(self.m.version)  # the same object until it changes
            if self._have_bitmap[0] is not have:
                self._have_bitmap = (have, keys.bitmap_from_indices(have, self.n))
            request = ExchangeRequest(
                version=self.m.version,
                wanted=keys.bitmap_from_indices(wanted, self.n),
                have=self._have_bitmap[1],
                dialable=self.dialable(),
            )
            limit = self.reply_limits.control_frame
            raw = None
            if self.windowed_rpc is not None and peer not in self.unwindowed:
                try:
                    raw = await self._call(peer, self.windowed_rpc, encode(request), flight, limit,
                                           windowed=True)  # fmt: skip
                except RemoteError as exc:
                    if exc.code != "unknown_method":
                        raise
                    self.unwindowed.add(peer)  # an older peer: unpaced answers
            if raw is None:
                try:
                    raw = await self._call(peer, self.exchange_rpc, encode(request), flight, limit)
                except RemoteError as exc:
                    if exc.code != "unknown_method":
                        raise
                    self.legacy.add(peer)  # an older peer: ask it the old way
                    return await self._legacy(peer, wanted, flight)
            msg = decode(raw, ExchangeReply, self.reply_limits)
            self.book.learn_table(self.m.version, self.n, msg.holders)
            return self._keep(peer, msg.version, msg.index, msg.data, wanted, flight)

        return go

    async def _legacy(self, peer: str, wanted: frozenset[int], flight: Flight) -> int:
        if len(wanted) == 1:
            (index,) = wanted
            name = self.chunk_rpc
            request = encode(ChunkRequest(version=self.m.version, index=index))
        else:
            bitmap = keys.bitmap_from_indices(wanted, self.n)
            name = self.chunk_any_rpc
            request = encode(ChunkAnyRequest(version=self.m.version, wanted=bitmap))
        raw = await self._call(peer, name, request, flight,
                               self.m.chunk_size + CHUNK_FRAME_OVERHEAD)  # fmt: skip
        msg = decode(raw, Chunk)
        return self._keep(peer, msg.version, msg.index, msg.data, wanted, flight)

    async def _call(
        self,
        peer: str,
        name: str,
        request: bytes,
        flight: Flight,
        max_bytes: int,
        *,
        windowed: bool = False,
    ) -> bytes:
        def progress(got: int, total: int) -> None:
            flight.received = got
            if got:
                self.marks.setdefault("byte", time.time())

        return await self.transport.call(
            peer,
            name,
            request,
            timeout=self.cfg.chunk_timeout,
            stall_timeout=self.cfg.stall_timeout,
            connect_timeout=self.cfg.connect_timeout,
            max_response_bytes=max_bytes,
            on_progress=progress,
            windowed=windowed,
        )

    def _keep(
        self, peer: str, version: int, index: int, data: bytes, allowed: Set[int], flight: Flight
    ) -> int:
        if version != self.m.version or index not in allowed:
            raise DecodeError(ReasonCode.SCHEMA, f"got chunk {index} of v{version}")
        self.store.put_chunk(self.m.version, index, data)  # verifies the hash
        self.scores.success(peer, len(data), time.monotonic() - flight.started)
        self.done_bytes += len(data) if index in self.missing else 0
        self.missing.discard(index)
        self.sources[peer] += 1
        self.timeline.append((time.time(), index, peer))
        return index

    # -- outcomes ------------------------------------------------------------------------------
    def _settle(self, task: asyncio.Task[int]) -> None:
        f = self.inflight.pop(task)
        index, peer = f.index, f.peer
        self.load[peer] -= 1
        is_seed = peer in self.seeds
        now = time.monotonic()
        if task.cancelled():
            if not f.stalled:  # pragma: no cover - only the transfer itself cancels requests
                return
            self.stalls += 1
            self.scores.stalled(peer)
            if is_seed:
                self._seed_failed(peer, now)
            else:  # slow, not wrong (a busy uplink, a loaded host): ask again a bit later
                self.backoff[peer] = now + self.cfg.stall_backoff
            return
        exc = task.exception()
        if exc is None:
            if is_seed:
                self.seed_failures, self.seed_failing_since = 0, None
            self._announce()
            self._progress()
            return
        if isinstance(exc, RemoteError) and exc.code == "busy":
            self.backoff[peer] = now + self.cfg.busy_backoff
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
        elif isinstance(exc, DialFailed) and not is_seed:
            until = self.scores.dial_failed(peer, now)
            logger.info("cannot connect to holder %s; not asking it for %.0f s: %s",
                        peer[:12], until - now, exc)  # fmt: skip
            return
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
        self._seed_failed(peer, now)

    def _seed_failed(self, peer: str, now: float) -> None:
        """Back off from a failed seed (growing pauses); give up after ``max_seed_failures``
        consecutive failures spanning ``seed_grace`` seconds, when no peer can help."""
        self.seed_failures += 1
        if self.seed_failing_since is None:
            self.seed_failing_since = now
        pause = self.cfg.seed_backoff * 2 ** min(self.seed_failures - 1, 3)
        self.backoff[peer] = now + pause
        if (
            self.seed_failures >= self.cfg.max_seed_failures
            and now - self.seed_failing_since >= self.cfg.seed_grace
        ):
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
