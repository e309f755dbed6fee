"""The contributor node: join, advertise, pull leases, generate, submit, repeat.

:class:`NodeWorker` composes the node's collaborators in one place, :meth:`NodeWorker.start`,
in this order (each receives what it uses as constructor arguments):

* the swarm peer (hivemind DHT with :func:`swarm.adverts.swarm_validators`, libp2p) and its
  transport and holder directory (tests pass in-memory ones instead: then no DHT is joined);
* the checkpoint :class:`~swarm.broadcast.BroadcastNode` (it keeps serving chunks of the versions
  it holds) and the :class:`~node.checkpoints.CheckpointManager` over it;
* the :class:`~node.client.CoordinatorClient` and the :class:`~node.presence.Registrar`, which
  registers the node (with retries) before anything else runs;
* the :class:`~node.presence.Presence` (tasks ``heartbeat``, ``status``, and on a real network
  ``advert`` and ``reachability``), with its :class:`~node.presence.Prefetcher`;
* the :class:`~node.work.WorkLoop` (task ``work``): lease -> load version -> generate on the
  :class:`~node.generation.GenerationThread` -> sign and submit, with back-off.

Made in ``__init__`` (they need no network): the counters (:class:`~node.status.NodeStats`), the
failure tracker, the back-off, the advert builder and the generation thread.

Shutdown (:meth:`NodeWorker.request_stop`, then :meth:`NodeWorker.stop`): take no new lease;
a lease whose results are ready is submitted, one still being generated or waiting for its
checkpoint is released (the coordinator reassigns its prompts at once); then the presence tasks
end and the DHT is left. Generation runs on a dedicated thread so heartbeats and chunk serving
continue meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.failures import FailureTracker
from node.generation import GenerationThread
from node.presence import (
    AdvertBuilder,
    AdvertLoop,
    Prefetcher,
    Presence,
    Registrar,
    node_state,
    status_line,
)
from node.status import Backoff, NodeStats
from protocol.identity import Identity, short_fingerprint
from swarm.tasks import cancel_and_wait

if TYPE_CHECKING:
    from node.backends.base import InferenceBackend
    from node.checkpoints import CheckpointManager
    from node.client import CoordinatorClient
    from node.config import NodeConfig
    from node.probe import Capability
    from node.work import WorkLoop
    from policy.model import Tokenizer
    from protocol.messages import CapabilityAdvert, Lease
    from protocol.schema import Reachability
    from swarm.broadcast import BroadcastNode
    from swarm.dht import SwarmPeer
    from swarm.holders import HolderDirectory
    from swarm.reachability import ReachabilityMonitor
    from swarm.transport import Transport

__all__ = ["NodeWorker"]

log = logging.getLogger(__name__)
#: How long stop() waits for each background task to end after cancelling it.
CANCEL_TIMEOUT_S = 10.0


class NodeWorker:
    """One contributor node (see the module docstring).

    ``transport``/``directory`` replace the libp2p peer and the DHT (unit tests use
    :mod:`swarm.memtransport` and :class:`swarm.holders.MemoryHolderDirectory`); then no DHT is
    joined and no advert is announced.
    """

    def __init__(
        self,
        config: NodeConfig,
        backend: InferenceBackend,
        identity: Identity,
        *,
        capability: Capability | None = None,
        tokenizer: Tokenizer | None = None,
        transport: Transport | None = None,
        directory: HolderDirectory | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if config.coordinator_peer_id is None or config.coordinator_key is None:
            raise ValueError("NodeConfig.coordinator and coordinator_key are required to run")
        self.config = config
        self.backend = backend
        self.identity = identity
        self.capability = capability
        self.tokenizer = tokenizer
        self.clock = clock
        self.rng = rng or random.Random()
        self.coordinator_peer_id: str = config.coordinator_peer_id
        self._transport = transport
        self._directory = directory
        self._stopping = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._phase = "starting"
        # -- what needs no network
        self.stats = NodeStats()
        #: consecutive generation failures: their own back-off, and giving up (node.failures)
        self.failures = FailureTracker(
            config.max_identical_failures, config.backoff_initial_s, config.backoff_max_s, self.rng
        )
        self.backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, self.rng)
        self.advert = AdvertBuilder(config, identity, backend, capability, self.stats, clock)
        self.generation = GenerationThread(backend, greedy="greedy" in config.misbehave)
        # -- made by start()
        self.peer: SwarmPeer | None = None
        self.broadcast: BroadcastNode | None = None
        self.checkpoints: CheckpointManager | None = None
        self.client: CoordinatorClient | None = None
        self.registrar: Registrar | None = None
        self.prefetcher: Prefetcher | None = None
        self.presence: Presence | None = None
        self.work: WorkLoop | None = None

    # ------------------------------------------------------------------ composition
    async def start(self) -> None:
        """Join the swarm and register; raises StartupError / CoordinatorError on failure."""
        from node.checkpoints import CheckpointManager
        from node.client import CoordinatorClient
        from node.work import WorkLoop
        from swarm.broadcast import BroadcastNode
        from swarm.chunks import ChunkStore
        from swarm.direct import settings_for
        from swarm.fetcher import DownloadConfig
        from swarm.transport import P2PTransport

        cfg = self.config
        state = Path(cfg.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        if self._transport is None:
            await self._start_peer(state)
        assert self._transport is not None and self._directory is not None
        self.advert.peer_id = self._transport.peer_id
        on_libp2p = isinstance(self._transport, P2PTransport)
        broadcast = self.broadcast = BroadcastNode(
            self._transport,
            ChunkStore(state / "checkpoints", keep_versions=cfg.keep_versions),
            self._directory,
            bytes(32),  # replaced by the pinned key once resolved (node.checkpoints)
            config=DownloadConfig(
                deadline=cfg.download_timeout_s, reserve_bytes=cfg.min_free_disk_mb << 20
            ),
            direct=settings_for(cfg.host_maddrs, cfg.direct_port) if on_libp2p else None,
        )
        if self.peer is not None:  # a real network: holdings announced only once measured
            broadcast.dialable = False
        await broadcast.start()
        self.checkpoints = CheckpointManager(
            broadcast,
            self.backend,
            state_dir=state,
            coordinator_fingerprint=cfg.coordinator_key or "",
            seeds=lambda: [self.coordinator_peer_id],
            clock=self.clock,
            download_timeout_s=cfg.download_timeout_s,
            keep_adapters=cfg.keep_versions,  # S + 1 LoRA adapters, as versions on disk
        )
        self.client = CoordinatorClient(
            self._transport, self.coordinator_peer_id, self.identity, clock=self.clock
        )
        self.registrar = Registrar(
            self.client,
            self.advert,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            clock=self.clock,
        )
        await self.registrar.register_with_retries(cfg.register_timeout_s)
        log.info(
            "node %s (%s) joined: backend %s/%s, coordinator %s",
            short_fingerprint(self.identity.fingerprint),
            self.peer_id,
            self.backend.name,
            self.backend.dtype,
            self.coordinator_peer_id,
        )
        advert_loop, reachability = self._dht_presence(broadcast)
        self.prefetcher = Prefetcher(self.checkpoints, self.backend, self._stopping)
        work = self.work = WorkLoop(
            self.client,
            self.checkpoints,
            self.generation,
            self.registrar,
            config=cfg,
            backend=self.backend,
            stats=self.stats,
            failures=self.failures,
            backoff=self.backoff,
            stopping=self._stopping,
            peer_id=self.peer_id,
            on_version_loaded=advert_loop.mark_dirty if advert_loop else lambda: None,
            tokenizer=self.tokenizer,
            rng=self.rng,
            clock=self.clock,
        )
        self.presence = Presence(
            self.client,
            self.registrar,
            self.advert,
            self.prefetcher,
            backend=self.backend,
            stats=self.stats,
            failures=self.failures,
            lease_in_hand=lambda: work.lease,
            stopping=self._stopping,
            status_interval_s=cfg.status_interval_s,
            advert_loop=advert_loop,
            reachability=reachability,
        )
        self._tasks["work"] = asyncio.create_task(self.work.run(), name="node-work")
        await self.presence.start()

    async def _start_peer(self, state: Path) -> None:
        from swarm.adverts import swarm_validators
        from swarm.dht import PeerConfig, SwarmPeer
        from swarm.holders import DhtHolderDirectory
        from swarm.transport import P2PTransport

        cfg = self.config
        assert cfg.coordinator is not None
        peer = SwarmPeer(
            PeerConfig(
                initial_peers=[cfg.coordinator, *cfg.initial_peers],
                host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=list(cfg.announce_maddrs),
                identity_path=str(state / "libp2p.key"),
                client_mode=cfg.client_mode,
                use_relay=cfg.use_relay,
                use_auto_relay=cfg.use_auto_relay,
                startup_timeout=cfg.startup_timeout_s,
            ),
            record_validators=swarm_validators(),
            clock=self.clock,
        )
        await peer.start()
        self.peer = peer
        self._transport = P2PTransport(peer.p2p)
        self._directory = DhtHolderDirectory(peer)

    def _dht_presence(
        self, broadcast: BroadcastNode
    ) -> tuple[AdvertLoop | None, ReachabilityMonitor | None]:
        """On a real network: the DHT advert loop, and the dial-back that measures whether other
        peers can dial this node (only then does it announce the chunks it holds: a NATed node
        stays download-only; a change re-announces the advert)."""
        if self.peer is None:
            return None, None
        from swarm.reachability import ReachabilityMonitor

        assert self._transport is not None
        advert_loop = AdvertLoop(
            self.peer,
            self.identity,
            self.advert,
            period=self.config.advert_period_s,
            clock=self.clock,
        )

        def changed(state: Reachability) -> None:
            broadcast.dialable = state == "public"
            self.advert.reachability = state
            advert_loop.mark_dirty()

        reachability = ReachabilityMonitor(
            self._transport,
            self.peer.visible_maddrs,
            lambda: self.coordinator_peer_id,
            on_change=changed,
            interval=self.config.reachability_interval_s,
        )
        return advert_loop, reachability

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        """Stop taking work (graceful shutdown starts; see :meth:`stop`)."""
        if not self._stopping.is_set():
            log.info("stopping: no new leases; submitting or releasing what is in hand")
        self._phase = "stopping"
        if self.work is not None:
            self.work.request_stop()
        self._stopping.set()

    async def wait(self) -> None:
        """Until the work loop has ended (after :meth:`request_stop`); re-raises its failure."""
        task = self._tasks.get("work")
        if task is not None:
            await asyncio.shield(task)

    async def abandon_work(self) -> None:
        """Cancel the work loop without draining it: the lease in hand is left to its deadline
        (``swarm node run`` after its drain time); :meth:`stop` then no longer waits for it."""
        task = self._tasks.pop("work", None)
        if task is not None:
            await cancel_and_wait([task])

    async def stop(self) -> None:
        """Drain (submit or release the lease in hand), stop every task, leave the DHT."""
        self.request_stop()
        work = self._tasks.pop("work", None)
        if work is not None:
            with contextlib.suppress(Exception):
                await work
        if self.presence is not None:
            await self.presence.stop(CANCEL_TIMEOUT_S)
        if self.prefetcher is not None:
            await self.prefetcher.stop(CANCEL_TIMEOUT_S)
        if self.broadcast is not None:
            await self.broadcast.stop()
            self.broadcast = None
        if self.peer is not None:
            await self.peer.stop()
            self.peer = None
        self.generation.shutdown()
        log.info("node stopped: %s", self.status_line())

    # ------------------------------------------------------------------ what it reports
    @property
    def peer_id(self) -> str:
        if self._transport is None:
            return "-"
        return self._transport.peer_id

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def phase(self) -> str:
        """What the node is doing now, in a few words (the status page shows it)."""
        return self.work.phase if self.work is not None else self._phase

    @property
    def current_lease(self) -> Lease | None:
        """The lease being worked on, if any."""
        return self.work.lease if self.work is not None else None

    @property
    def generation_in_flight(self) -> bool:
        """True while a backend.generate call runs on the generation thread."""
        return self.generation.in_flight

    @property
    def active(self) -> bool:
        """The coordinator's last word on this node: active (True) or standby."""
        return self.presence.active if self.presence is not None else True

    def build_advert(self) -> CapabilityAdvert:
        """This node's capability advert with current throughput and loaded version."""
        return self.advert()

    def status_line(self) -> str:
        """The one-line status the ``status`` task logs."""
        if self.presence is not None:
            return self.presence.status_line()
        state = node_state(self.failures, stopping=self.stopping, active=True)
        return status_line(self.stats, self.backend.loaded_version, state, self.advert.reachability,
                           self.failures.problem)  # fmt: skip

    def statistics(self) -> dict[str, Any]:
        """Snapshot of the counters plus the loaded version."""
        out = dict(vars(self.stats))
        out["policy_version"] = self.backend.loaded_version
        out["active"] = self.active
        out["problem"] = self.failures.problem
        out["failed"] = self.failures.gave_up
        return out
