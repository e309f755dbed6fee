"""Peer-assisted pipelined checkpoint broadcast (DESIGN.md §5).

* :class:`ChunkServer` answers ``MANIFEST_RPC``, ``EXCHANGE_RPC`` (one of the wanted chunks, the
  least-sent first, plus this peer's holder table; the asker's own holdings go into the
  :class:`~swarm.holders.HolderBook`), and the older ``CHUNK_RPC`` and ``CHUNK_ANY_RPC`` (any one
  of the wanted chunks, the least-sent first; ``busy`` if even that one was sent less than
  ``resend_after`` seconds ago, since its recipient is about to relay it) from the store;
  a chunk is servable the moment it is verified and stored, so a node relays chunk k while it still
  downloads k+1. Concurrent streams per caller are bounded; the upload rate is capped by the
  transport's token bucket.
* :class:`Downloader` fetches the signed manifest first (verified against the pinned coordinator
  key), then chunks from several peers at once (:mod:`swarm.fetcher` holds the scheduling).
* :class:`BroadcastNode` bundles server, holder announcer and downloader; the seed (coordinator or
  trainer) runs the same thing with every chunk present (:meth:`BroadcastNode.seed_version`).
  :attr:`BroadcastNode.dialable` (set from a reachability measurement) decides whether this peer
  announces itself as a holder: one that others cannot dial never is.
  Its :meth:`~BroadcastNode.download` goes through :class:`swarm.deltasync.VersionSync`: a delta
  version is fetched as its (small) delta when this peer holds the base.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.manifest import Part, part_indices, verify_manifest
from protocol.messages import (
    Chunk,
    ChunkRequest,
    Manifest,
    ManifestRequest,
    ManifestResponse,
    SignedEnvelope,
)
from swarm import keys
from swarm.chunks import ChunkStore
from swarm.deltasync import Files, VersionSync
from swarm.direct import DirectSettings, DirectTransport
from swarm.errors import DialFailed, ManifestUnavailable, NoDiskSpace, TransportError
from swarm.fetcher import DownloadConfig, ProgressFn, Transfer
from swarm.holders import HolderAnnouncer, HolderBook, HolderDirectory
from swarm.scoring import PeerScores
from swarm.transport import HandlerError, P2PTransport, Transport
from swarm.wire import ChunkAnyRequest, ExchangeReply, ExchangeRequest

logger = logging.getLogger(__name__)

MANIFEST_RPC = "/rollout-swarm/manifest/1"
CHUNK_RPC = "/rollout-swarm/chunk/1"
CHUNK_ANY_RPC = "/rollout-swarm/chunk-any/1"
EXCHANGE_RPC = "/rollout-swarm/exchange/1"
#: the same exchange, its answer paced by the asker's acknowledgements (swarm.bulkwindow)
EXCHANGE_WINDOWED_RPC = "/rollout-swarm/exchange/2"


class ChunkServer:
    """Serves manifests and verified chunks of the versions in ``store``."""

    def __init__(
        self,
        store: ChunkStore,
        transport: Transport,
        *,
        max_streams_per_peer: int = 4,
        resend_after: float = 0.0,
        book: HolderBook | None = None,
        dialable: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store = store
        self.book = book if book is not None else HolderBook()
        self.dialable = dialable
        self.resend_after = resend_after
        self.transport = transport
        self.max_streams_per_peer = max_streams_per_peer
        self.chunks_served = 0
        self._sent: Counter[tuple[int, int]] = Counter()  # (version, index) -> times sent
        self._last_sent: dict[tuple[int, int], float] = {}  # (version, index) -> monotonic time
        # per version: _levels[v][c] = the chunks sent exactly c + 1 times, and _sent_once[v]
        # every chunk sent at all, so that the least-sent wanted chunk is found with a few set
        # intersections in C, not a Python step per wanted chunk (a seed is asked for any of
        # thousands at once)
        self._levels: dict[int, list[set[int]]] = {}
        self._sent_once: dict[int, set[int]] = {}

    async def start(self) -> None:
        await self.transport.register(MANIFEST_RPC, self._on_manifest)
        for name, handler in (
            (CHUNK_RPC, self._on_chunk),
            (CHUNK_ANY_RPC, self._on_chunk_any),
            (EXCHANGE_RPC, self._on_exchange),
            (EXCHANGE_WINDOWED_RPC, self._on_exchange),
        ):
            await self.transport.register(
                name, handler, max_streams_per_peer=self.max_streams_per_peer,
                windowed=name == EXCHANGE_WINDOWED_RPC,
            )  # fmt: skip

    async def stop(self) -> None:
        for name in (MANIFEST_RPC, CHUNK_RPC, CHUNK_ANY_RPC, EXCHANGE_RPC, EXCHANGE_WINDOWED_RPC):
            await self.transport.unregister(name)

    async def _on_manifest(self, peer_id: str, request: bytes) -> bytes:
        req = decode(request, ManifestRequest)
        version = self.store.latest() if req.version is None else req.version
        entry = None if version is None else self.store.manifest(version)
        return encode(ManifestResponse(manifest=None if entry is None else entry[0]))

    def load_chunk(self, version: int, index: int) -> bytes | None:
        """Bytes to serve for chunk ``index`` of ``version`` (tests override this)."""
        return self.store.get_chunk(version, index)

    async def _on_chunk(self, peer_id: str, request: bytes) -> bytes:
        req = decode(request, ChunkRequest)
        return self._serve(req.version, req.index)

    async def _on_chunk_any(self, peer_id: str, request: bytes) -> bytes:
        req = decode(request, ChunkAnyRequest)
        return self._serve(req.version, self._choose(req.version, req.wanted))

    async def _on_exchange(self, peer_id: str, request: bytes) -> bytes:
        req = decode(request, ExchangeRequest)
        entry = self.store.manifest(req.version)
        n = 0 if entry is None else len(entry[1].chunks)
        if n:  # the asker's own report: first-hand, and it tells whether others may dial it
            have = keys.bits_from_bitmap(req.have, n)
            self.book.learn_bits(req.version, peer_id, have, dialable=req.dialable)
        index = self._choose(req.version, req.wanted)
        data = self._load(req.version, index)
        table = self.book.table(
            req.version, n, me=self.transport.peer_id, my_have=self.store.have(req.version),
            my_dialable=self.dialable(), exclude=peer_id,
        )  # fmt: skip
        return encode(ExchangeReply(version=req.version, index=index, data=data, holders=table))

    def _choose(self, version: int, wanted_bitmap: bytes) -> int:
        """The wanted chunk held here that was sent least often (random ties); ``busy`` when a
        seed-style request (several chunks) finds them all sent moments ago."""
        entry = self.store.manifest(version)
        n = 0 if entry is None else len(entry[1].chunks)
        asked = keys.indices_from_bitmap(wanted_bitmap, n)
        wanted = asked & self.store.have(version)
        if not wanted:
            raise HandlerError("not_held", f"none of the wanted chunks of v{version} is here")
        index = self._least_sent(version, wanted)
        last = self._last_sent.get((version, index))
        if len(asked) > 1 and last is not None and time.monotonic() - last < self.resend_after:
            # Every wanted chunk left moments ago; its recipient will relay it. Saves the uplink.
            raise HandlerError("busy", "all wanted chunks were just sent; fetch them from peers")
        return index

    def _least_sent(self, version: int, wanted: frozenset[int]) -> int:
        """The chunk of ``wanted`` sent least often (random among ties)."""
        pool = wanted - self._sent_once.get(version, set())
        for level in self._levels.get(version, []):
            if pool:
                break
            pool = wanted & level
        return random.choice(tuple(pool))

    def forget_except(self, versions: Iterable[int]) -> None:
        """Drop the send counters of versions no longer held (they would pile up forever)."""
        keep = set(versions)
        for v in [v for v in self._levels if v not in keep]:
            del self._levels[v]
            self._sent_once.pop(v, None)
        for key in [k for k in self._last_sent if k[0] not in keep]:
            self._sent.pop(key, None)
            del self._last_sent[key]

    def _serve(self, version: int, index: int) -> bytes:
        return encode(Chunk(version=version, index=index, data=self._load(version, index)))

    def _load(self, version: int, index: int) -> bytes:
        data = self.load_chunk(version, index)
        if data is None:
            raise HandlerError("not_held", f"chunk {index} of v{version} is not held here")
        # counted at pick time: concurrent asks spread out
        times = self._sent[(version, index)]
        self._sent[(version, index)] = times + 1
        levels = self._levels.setdefault(version, [])
        if times:
            levels[times - 1].discard(index)
        else:
            self._sent_once.setdefault(version, set()).add(index)
        if len(levels) <= times:
            levels.append(set())
        levels[times].add(index)
        self._last_sent[(version, index)] = time.monotonic()
        self.chunks_served += 1
        return data


class Downloader:
    """Fetches checkpoint versions into ``store``, verifying everything against ``pinned_key``."""

    def __init__(
        self,
        transport: Transport,
        store: ChunkStore,
        directory: HolderDirectory,
        pinned_key: bytes,
        *,
        announcer: HolderAnnouncer | None = None,
        scores: PeerScores | None = None,
        config: DownloadConfig | None = None,
        clock: Callable[[], float] = time.time,
        book: HolderBook | None = None,
        dialable: Callable[[], bool] = lambda: True,
    ) -> None:
        self.transport = transport
        self.store = store
        self.directory = directory
        self.pinned_key = pinned_key
        self.book = book if book is not None else HolderBook()
        self.dialable = dialable
        self.exchange: str | None = EXCHANGE_RPC  # None: the per-chunk RPCs only
        #: the exchange paced by the server's bulk window, asked first (None: unpaced only)
        self.windowed_exchange: str | None = EXCHANGE_WINDOWED_RPC
        self.announcer = announcer
        self.scores = scores or PeerScores()
        self.config = config or DownloadConfig()
        self.clock = clock
        self.last_transfer: Transfer | None = None

    async def fetch_manifest(
        self, version: int | None, sources: Sequence[str]
    ) -> tuple[SignedEnvelope, Manifest]:
        """The signed manifest of ``version`` (None = newest a source has), verified."""
        if version is not None and (entry := self.store.manifest(version)) is not None:
            try:  # resuming: the stored copy must still verify (and not have expired)
                return entry[0], verify_manifest(entry[0], self.pinned_key, self.clock())
            except ProtocolError as exc:
                logger.warning("stored manifest of v%d no longer verifies: %s", version, exc)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.manifest_deadline
        problems: dict[str, str] = {}
        pause = 0.5
        seeds = [p for p in dict.fromkeys(sources) if p != self.transport.peer_id]
        while True:
            transient = False  # a failure worth retrying (dial back-off, timeout, broken stream)
            asked: set[str] = set()
            for group in (seeds, None):  # the seeds first; the holders only if they fail
                peers = group if group is not None else await self._holders_of(version, asked)
                for peer in peers:
                    asked.add(peer)
                    outcome = await self._ask_manifest(peer, version, peer in sources)
                    if isinstance(outcome, tuple):
                        return outcome
                    problems[peer] = outcome
                    transient |= outcome.startswith("retry: ")
            if not transient or loop.time() + pause > deadline:
                break
            why = "; ".join(f"{p[:12]}: {m}" for p, m in problems.items())
            logger.info("no manifest of v%s yet (%s); retrying in %.1f s", version, why, pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)
        what = "the newest version" if version is None else f"v{version}"
        detail = "; ".join(f"{p[:12]}: {m.removeprefix('retry: ')}" for p, m in problems.items())
        raise ManifestUnavailable(
            f"no peer returned a manifest of {what} signed by the pinned coordinator key "
            f"({detail or 'no peers to ask'}); check the seed is up and the pinned key"
        )

    async def _holders_of(self, version: int | None, skip: set[str]) -> list[str]:
        """Holders of ``version`` known from the chunk exchange and the DHT, minus ``skip``."""
        if version is None:
            return []
        known = list(self.book.view(version))
        try:
            known += list(await self.directory.lookup(version))
        except Exception as exc:  # the DHT is only a hint here
            logger.debug("holder lookup for the manifest failed: %s", exc)
        me = self.transport.peer_id
        return [p for p in dict.fromkeys(known) if p not in skip and p != me]

    async def _ask_manifest(
        self, peer: str, version: int | None, is_seed: bool
    ) -> tuple[SignedEnvelope, Manifest] | str:
        """The verified manifest from ``peer``, or why not (``"retry: ..."`` when worth it)."""
        now = time.monotonic()
        if not is_seed and self.scores.shunned(peer):
            return "skipped, served bad data before"
        if not is_seed and self.scores.backed_off(peer, now):
            return "skipped, could not be dialled lately"
        try:
            raw = await self.transport.call(
                peer, MANIFEST_RPC, encode(ManifestRequest(version=version)),
                timeout=self.config.manifest_timeout,
                connect_timeout=self.config.connect_timeout,
            )  # fmt: skip
            env = decode(raw, ManifestResponse).manifest
            if env is None:
                return "does not hold it"
            manifest = verify_manifest(env, self.pinned_key, self.clock())
            if version is not None and manifest.version != version:
                got = manifest.version
                raise ProtocolError("manifest_invalid", f"asked v{version}, got v{got}")
            return env, manifest
        except ProtocolError as exc:
            self.scores.bad_chunk(peer)
            return str(exc)
        except TransportError as exc:
            if isinstance(exc, DialFailed) and not is_seed:
                self.scores.dial_failed(peer, now)
                return str(exc)  # another holder or the seed will do
            return f"retry: {exc}"

    async def download(
        self, version: int | None, seeds: Sequence[str], *, on_progress: ProgressFn | None = None
    ) -> dict[str, bytes]:
        """Fetch the full checkpoint of ``version`` (None = newest the seeds have) and return
        ``{file name: bytes}`` (never by delta: :class:`swarm.deltasync.VersionSync` does that).

        Resumes from verified chunks already on disk. Raises ``ManifestUnavailable``,
        ``ChunkUnavailable`` or ``NoDiskSpace`` (checked before any chunk is fetched).
        """
        env, manifest = await self.fetch_manifest(version, seeds)
        await self.fetch_part(env, manifest, seeds, "full", on_progress=on_progress)
        self.store.prune(protect={manifest.version})
        return self.store.load_files(manifest.version)

    async def fetch_part(
        self,
        env: SignedEnvelope,
        manifest: Manifest,
        seeds: Sequence[str],
        part: Part,
        *,
        on_progress: ProgressFn | None = None,
    ) -> None:
        """Download every missing chunk of one part of a verified ``manifest`` into the store."""
        self._check_disk(manifest, part)
        self.store.put_manifest(env, manifest)
        transfer = Transfer(
            manifest,
            transport=self.transport,
            store=self.store,
            directory=self.directory,
            seeds=list(seeds),
            scores=self.scores,
            config=self.config,
            announcer=self.announcer,
            on_progress=on_progress,
            chunk_rpc=CHUNK_RPC,
            chunk_any_rpc=CHUNK_ANY_RPC,
            exchange_rpc=self.exchange,
            windowed_rpc=self.windowed_exchange,
            book=self.book,
            dialable=self.dialable,
            wanted=part_indices(manifest, part),
        )
        self.last_transfer = transfer
        await transfer.run()

    def _check_disk(self, manifest: Manifest, part: Part = "full") -> None:
        """Refuse up front a version that cannot fit (rather than fill the disk chunk by chunk)."""
        held = self.store.have(manifest.version)
        # a delta is applied into a full checkpoint that is stored too: both parts count
        indices = part_indices(manifest, "full") if part == "full" else range(len(manifest.chunks))
        needed = sum(manifest.chunks[i].size for i in indices if i not in held)
        free = shutil.disk_usage(self.store.root).free
        if needed + self.config.reserve_bytes > free:
            raise NoDiskSpace(
                f"v{manifest.version} needs {needed / 1e6:.1f} MB more on disk, "
                f"{free / 1e6:.1f} MB free in {self.store.root} (keeping "
                f"{self.config.reserve_bytes / 1e6:.0f} MB free); free space or keep fewer versions"
            )


class BroadcastNode:
    """Chunk server + holder announcer + downloader for one peer (seed or receiver).

    ``relay=False`` downloads without serving or announcing anything (the star baseline).
    :attr:`dialable` (default True) says whether other peers can open connections to this one;
    set it from a reachability measurement (:mod:`swarm.reachability`). While False the peer
    announces nothing in the DHT and tells the peers it asks that it is download-only; it still
    serves the peers that reach it over connections it opened itself.
    ``direct`` (a :class:`~swarm.direct.DirectSettings`): chunk answers travel over direct TCP
    connections where both ends can (:mod:`swarm.direct`, served only while :attr:`dialable`),
    over ``transport`` otherwise; ``transport`` must then be a ``P2PTransport``.
    """

    def __init__(
        self,
        transport: Transport,
        store: ChunkStore,
        directory: HolderDirectory,
        pinned_key: bytes,
        *,
        scores: PeerScores | None = None,
        config: DownloadConfig | None = None,
        max_streams_per_peer: int = 4,
        holder_ttl: float = 60.0,
        announce_interval: float = 1.0,
        relay: bool = True,
        direct: DirectSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.relay = relay
        self._dialable = True
        self.book = HolderBook()
        self.direct: DirectTransport | None = None
        if direct is not None:
            if not isinstance(transport, P2PTransport):
                raise TypeError("direct chunk answers need a P2PTransport underneath")
            self.direct = DirectTransport(
                transport, host=direct.host, port=direct.port, serve=relay,
                serve_when=lambda: self.dialable,
            )  # fmt: skip
            transport = self.direct
        self.server = ChunkServer(
            store, transport, max_streams_per_peer=max_streams_per_peer, book=self.book,
            dialable=lambda: self.dialable,
        )  # fmt: skip
        self.announcer = HolderAnnouncer(
            directory, transport.peer_id, ttl=holder_ttl, min_interval=announce_interval
        )
        self.downloader = Downloader(
            transport,
            store,
            directory,
            pinned_key,
            announcer=self.announcer if relay else None,
            scores=scores,
            config=config,
            clock=clock,
            book=self.book,
            dialable=lambda: self.dialable,
        )
        #: plans each download: by delta against a held version, or in full (swarm.deltasync)
        self.sync = VersionSync(self.downloader, announcer=self.announcer if relay else None)

    @property
    def scores(self) -> PeerScores:
        return self.downloader.scores

    @property
    def dialable(self) -> bool:
        """Whether other peers can dial this one (and so may be told it holds chunks)."""
        return self._dialable and self.relay

    @dialable.setter
    def dialable(self, value: bool) -> None:
        if value != self._dialable:
            logger.info("this peer is %s", "dialable: announcing held chunks" if value
                        else "not dialable: download-only, holdings not announced")  # fmt: skip
        self._dialable = value
        self.announcer.pause(not value)

    async def start(self) -> None:
        """Serve what the store holds and announce it (nothing when ``relay`` is False)."""
        if self.direct is not None:
            await self.direct.start()
        if not self.relay:
            return
        await self.server.start()
        for version in self.store.versions():
            entry = self.store.manifest(version)
            assert entry is not None
            self.announcer.update(version, self.store.have(version), len(entry[1].chunks))
        await self.announcer.start()

    async def stop(self) -> None:
        if self.relay:
            await self.announcer.stop()
            await self.server.stop()
        if self.direct is not None:
            await self.direct.stop()

    async def seed_version(self, env: SignedEnvelope, chunks: Sequence[bytes]) -> Manifest:
        """Hold and announce a complete version (the seed side); ``env`` must verify."""
        manifest = verify_manifest(env, self.downloader.pinned_key, self.downloader.clock())
        self.store.seed(env, manifest, chunks)
        self.announcer.update(manifest.version, self.store.have(manifest.version), len(chunks))
        await self.announcer.flush()
        for dropped in self.store.prune(protect={manifest.version}):
            self.announcer.forget(dropped)
        self.server.forget_except(self.store.versions())
        return manifest

    async def download(
        self, version: int | None, seeds: Sequence[str], *, on_progress: ProgressFn | None = None
    ) -> Files:
        """The verified full checkpoint of ``version`` (None = newest the seeds have), by delta
        against a version held here when that is fewer bytes (:class:`VersionSync`); the node
        relays chunks while downloading. Raises like :meth:`Downloader.download`."""
        files = await self.sync.fetch(version, seeds, on_progress=on_progress)
        for v in self.announcer.versions():
            if v not in self.store.versions():
                self.announcer.forget(v)
        self.server.forget_except(self.store.versions())
        self.book.forget_except(self.store.versions())
        return files
