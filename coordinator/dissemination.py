"""How far each recent policy version has spread: which registered nodes hold it in full.

:class:`HolderCensus` reads the chunk-holder bitmaps of the last ``S + 1`` versions from the DHT
(:mod:`swarm.holders`: every peer that others can dial announces, per version, a bitmap of the
chunks it has verified; a node measured ``private`` (behind NAT) announces nothing, so it is not
counted: it cannot serve other nodes)
every ``period`` seconds and keeps, for the dashboard and ``/status``:

* :attr:`HolderCensus.counts`   -- version -> registered nodes holding its full checkpoint;
* :attr:`HolderCensus.by_peer`  -- libp2p peer id -> versions it holds in full.

Holder records are unsigned (a peer may claim chunks it lacks; downloads verify every chunk and
score such a peer down), so these are the swarm's claims, counted only for peers that registered
as nodes: the figure an operator wants is "how many contributors can serve v", not "how many
records say so". One DHT lookup per version and round, each with the directory's timeout; a
failed lookup keeps that version's last count (the page shows when it was taken).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable

from coordinator.node_view import advert_of
from coordinator.store import Store
from protocol.manifest import part_indices
from swarm import keys
from swarm.chunks import ChunkStore
from swarm.holders import HolderDirectory
from swarm.tasks import cancel_and_wait

__all__ = ["HolderCensus", "coordinator_census"]

log = logging.getLogger(__name__)

#: Seconds between two rounds of lookups.
CENSUS_PERIOD_S = 2.0


class HolderCensus:
    """Counts the registered nodes that hold each recent version (see the module docstring).

    ``versions`` gives ``(version, number of chunks, chunks of its full checkpoint)`` of the
    versions to count (those whose manifest the coordinator has): a peer holds a version when it
    holds every chunk of the full checkpoint (a delta version's delta chunks are not needed),
    ``node_peers`` the peer ids of the registered nodes."""

    def __init__(
        self,
        directory: HolderDirectory,
        versions: Callable[[], Iterable[tuple[int, int, Collection[int]]]],
        node_peers: Callable[[], set[str]],
        *,
        period: float = CENSUS_PERIOD_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.versions = versions
        self.node_peers = node_peers
        self.period = period
        self.clock = clock
        self.counts: dict[int, int] = {}
        self.by_peer: dict[str, list[int]] = {}
        self.taken_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """One round: look up every version's holders (concurrently) and recount."""
        wanted = sorted(self.versions())
        peers = self.node_peers()
        results = await asyncio.gather(
            *(self.directory.lookup(v) for v, _, _ in wanted), return_exceptions=True
        )
        counts: dict[int, int] = {}
        held: dict[str, set[int]] = {}
        for (version, n_chunks, full), got in zip(wanted, results, strict=True):
            if isinstance(got, BaseException):
                log.debug("holder lookup of v%d failed: %s", version, got)
                if version in self.counts:
                    counts[version] = self.counts[version]
                    for peer, versions in self.by_peer.items():
                        if version in versions:
                            held.setdefault(peer, set()).add(version)
                continue
            complete = [
                peer
                for peer, bitmap in got.items()
                if peer in peers and keys.indices_from_bitmap(bitmap, n_chunks).issuperset(full)
            ]
            counts[version] = len(complete)
            for peer in complete:
                held.setdefault(peer, set()).add(version)
        self.counts = counts
        self.by_peer = {peer: sorted(vs) for peer, vs in held.items()}
        self.taken_at = self.clock()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the census is observability: it must never take anything down
                log.exception("holder census failed; retrying")
            await asyncio.sleep(self.period)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="holder-census")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None


def coordinator_census(
    store: Store, chunks: ChunkStore, directory: HolderDirectory, keep: int
) -> HolderCensus:
    """The census of a coordinator: the last ``keep`` published versions whose manifest it
    holds, and the peer ids its registered nodes gave in their adverts."""

    def versions() -> list[tuple[int, int, Collection[int]]]:
        out: list[tuple[int, int, Collection[int]]] = []
        for version in store.versions()[-keep:]:
            held = chunks.manifest(version)
            if held is not None:
                m = held[1]
                out.append((version, len(m.chunks), part_indices(m, "full")))
        return out

    def node_peers() -> set[str]:
        adverts = (advert_of(node.advert) for node in store.nodes())
        return {a.peer_id for a in adverts if a is not None}

    return HolderCensus(directory, versions, node_peers)
