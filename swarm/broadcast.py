"""Peer-assisted pipelined checkpoint broadcast (DESIGN.md §5).

* :class:`ChunkServer` answers ``MANIFEST_RPC``, ``CHUNK_RPC`` and ``CHUNK_ANY_RPC`` (any one of
  the wanted chunks, the least-sent first; ``busy`` if even that one was sent less than
  ``resend_after`` seconds ago, since its recipient is about to relay it) from the store;
  a chunk is servable the moment it is verified and stored, so a node relays chunk k while it still
  downloads k+1. Concurrent streams per caller are bounded; the upload rate is capped by the
  transport's token bucket.
* :class:`Downloader` fetches the signed manifest first (verified against the pinned coordinator
  key), then chunks from several peers at once (:mod:`swarm.fetcher` holds the scheduling).
* :class:`BroadcastNode` bundles server, holder announcer and downloader; the seed (coordinator or
  trainer) runs the same thing with every chunk present (:meth:`BroadcastNode.seed_version`).
  Its :meth:`~BroadcastNode.download` goes through :class:`swarm.deltasync.VersionSync`: a delta
  version is fetched as its (small) delta when this peer holds the base.
"""

from __future__ import annotations

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
from swarm.errors import ManifestUnavailable, NoDiskSpace, TransportError
from swarm.fetcher import DownloadConfig, ProgressFn, Transfer
from swarm.holders import HolderAnnouncer, HolderDirectory
from swarm.scoring import PeerScores
from swarm.transport import HandlerError, Transport
from swarm.wire import ChunkAnyRequest

logger = logging.getLogger(__name__)

MANIFEST_RPC = "/rollout-swarm/manifest/1"
CHUNK_RPC = "/rollout-swarm/chunk/1"
CHUNK_ANY_RPC = "/rollout-swarm/chunk-any/1"


class ChunkServer:
    """Serves manifests and verified chunks of the versions in ``store``."""

    def __init__(
        self,
        store: ChunkStore,
        transport: Transport,
        *,
        max_streams_per_peer: int = 4,
        resend_after: float = 0.0,
    ) -> None:
        self.store = store
        self.resend_after = resend_after
        self.transport = transport
        self.max_streams_per_peer = max_streams_per_peer
        self.chunks_served = 0
        self._sent: Counter[tuple[int, int]] = Counter()  # (version, index) -> times sent
        self._last_sent: dict[tuple[int, int], float] = {}  # (version, index) -> monotonic time

    async def start(self) -> None:
        await self.transport.register(MANIFEST_RPC, self._on_manifest)
        for name, handler in ((CHUNK_RPC, self._on_chunk), (CHUNK_ANY_RPC, self._on_chunk_any)):
            await self.transport.register(
                name, handler, max_streams_per_peer=self.max_streams_per_peer
            )

    async def stop(self) -> None:
        for name in (MANIFEST_RPC, CHUNK_RPC, CHUNK_ANY_RPC):
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
        entry = self.store.manifest(req.version)
        n = 0 if entry is None else len(entry[1].chunks)
        wanted = keys.indices_from_bitmap(req.wanted, n) & self.store.have(req.version)
        if not wanted:
            raise HandlerError("not_held", f"none of the wanted chunks of v{req.version} is here")
        index = min(wanted, key=lambda i: (self._sent[(req.version, i)], random.random()))
        last = self._last_sent.get((req.version, index))
        if last is not None and time.monotonic() - last < self.resend_after:
            # Every wanted chunk left moments ago; its recipient will relay it. Saves the uplink.
            raise HandlerError("busy", "all wanted chunks were just sent; fetch them from peers")
        return self._serve(req.version, index)

    def forget_except(self, versions: Iterable[int]) -> None:
        """Drop the send counters of versions no longer held (they would pile up forever)."""
        keep = set(versions)
        for key in [k for k in self._last_sent if k[0] not in keep]:
            self._sent.pop(key, None)
            del self._last_sent[key]

    def _serve(self, version: int, index: int) -> bytes:
        data = self.load_chunk(version, index)
        if data is None:
            raise HandlerError("not_held", f"chunk {index} of v{version} is not held here")
        self._sent[(version, index)] += 1  # counted at pick time: concurrent asks spread out
        self._last_sent[(version, index)] = time.monotonic()
        self.chunks_served += 1
        return encode(Chunk(version=version, index=index, data=data))


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
    ) -> None:
        self.transport = transport
        self.store = store
        self.directory = directory
        self.pinned_key = pinned_key
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
        candidates = list(dict.fromkeys(sources))
        if version is not None:
            try:
                candidates += [p for p in await self.directory.lookup(version) if p not in sources]
            except Exception as exc:  # the DHT is only a hint here
                logger.debug("holder lookup for the manifest failed: %s", exc)
        problems: list[str] = []
        request = encode(ManifestRequest(version=version))
        for peer in candidates:
            if peer == self.transport.peer_id:
                continue
            if peer not in sources and self.scores.shunned(peer):
                problems.append(f"{peer[:12]}: skipped, served bad data before")
                continue
            try:
                raw = await self.transport.call(
                    peer, MANIFEST_RPC, request, timeout=self.config.manifest_timeout
                )
                env = decode(raw, ManifestResponse).manifest
                if env is None:
                    problems.append(f"{peer[:12]}: does not hold it")
                    continue
                manifest = verify_manifest(env, self.pinned_key, self.clock())
                if version is not None and manifest.version != version:
                    raise ProtocolError(
                        "manifest_invalid", f"asked v{version}, got v{manifest.version}"
                    )
                return env, manifest
            except (TransportError, ProtocolError) as exc:
                if isinstance(exc, ProtocolError):
                    self.scores.bad_chunk(peer)
                problems.append(f"{peer[:12]}: {exc}")
        what = "the newest version" if version is None else f"v{version}"
        raise ManifestUnavailable(
            f"no peer returned a manifest of {what} signed by the pinned coordinator key "
            f"({'; '.join(problems) or 'no peers to ask'}); check the seed is up and the pinned key"
        )

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
        announce_interval: float = 0.2,
        relay: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.relay = relay
        self.server = ChunkServer(store, transport, max_streams_per_peer=max_streams_per_peer)
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
        )
        #: plans each download: by delta against a held version, or in full (swarm.deltasync)
        self.sync = VersionSync(self.downloader, announcer=self.announcer if relay else None)

    @property
    def scores(self) -> PeerScores:
        return self.downloader.scores

    async def start(self) -> None:
        """Serve what the store holds and announce it (nothing when ``relay`` is False)."""
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
        return files
