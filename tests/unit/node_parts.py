"""The pieces of a node that ``NodeWorker.start()`` wires, built alone on the in-memory transport
against test_node_worker's coordinator core with the fake backend (shared by
test_node_presence and test_node_work)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_node_worker import MemCoordinator, node_config

from node.backends.fake import FakeBackend
from node.checkpoints import CheckpointManager
from node.client import CoordinatorClient
from node.presence import AdvertBuilder, Registrar
from node.status import NodeStats
from protocol.identity import Identity
from swarm.broadcast import BroadcastNode
from swarm.chunks import ChunkStore
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork


class NodeParts:
    """Identity, backend, counters, the coordinator client, the advert and the registrar of one
    node (``node-1``); :meth:`checkpoints` starts its broadcast node and returns the verified
    checkpoint manager over it. ``config`` goes to ``node_config``; ``registrar_interval_s``
    overrides the heartbeat interval the registrar starts with (default: the config's)."""

    def __init__(
        self,
        tmp: Path,
        coord: MemCoordinator,
        net: InMemoryNetwork,
        *,
        registrar_interval_s: float | None = None,
        **config: Any,
    ) -> None:
        self.tmp = tmp
        self.coord = coord
        self.config = node_config(coord, tmp / "node", **config)
        self.identity = Identity.generate()
        self.backend = FakeBackend()
        self.stats = NodeStats()
        self.stopping = asyncio.Event()
        self.transport = net.endpoint("node-1")
        self.client = CoordinatorClient(self.transport, "coord", self.identity)
        self.advert = AdvertBuilder(
            self.config, self.identity, self.backend, None, self.stats, lambda: 1000.0
        )
        self.advert.peer_id = self.transport.peer_id
        self.registrar = Registrar(
            self.client,
            self.advert,
            heartbeat_interval_s=registrar_interval_s or self.config.heartbeat_interval_s,
        )
        self.broadcast: BroadcastNode | None = None

    async def checkpoints(self, dirs: MemoryHolderDirectory) -> CheckpointManager:
        self.broadcast = BroadcastNode(
            self.transport, ChunkStore(self.tmp / "chunks", keep_versions=3), dirs, bytes(32)
        )
        await self.broadcast.start()
        return CheckpointManager(
            self.broadcast,
            self.backend,
            state_dir=self.tmp / "node",
            coordinator_fingerprint=self.config.coordinator_key or "",
            seeds=lambda: ["coord"],
        )

    async def stop_broadcast(self) -> None:
        if self.broadcast is not None:
            await self.broadcast.stop()
