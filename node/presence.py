"""How a node stays known to the swarm: its advert, registration, heartbeats, reachability.

:class:`SwarmPresence` is a mixin of :class:`node.worker.NodeWorker`, which sets the state
declared below in its ``__init__`` and runs the loops as named tasks: ``advert`` re-announces the
signed capability advert in the DHT (at once when the loaded version or the reachability
changes); ``heartbeat`` sends liveness every ``heartbeat_interval_s``, re-registers after
``unknown_node`` and starts fetching a newly published version before a lease asks for it;
``reachability`` has the coordinator dial back (a node others cannot dial stays download-only);
``status`` logs one line at a steady interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from node.backends.base import InferenceBackend
from node.checkpoints import CheckpointError, CheckpointManager
from node.client import CoordinatorClient, CoordinatorError, Rejected
from node.config import NodeConfig
from node.failures import FailureTracker
from node.status import NodeStats, make_advert
from protocol.errors import ReasonCode
from protocol.identity import Identity, short_fingerprint
from protocol.messages import CapabilityAdvert, Heartbeat, Lease

if TYPE_CHECKING:
    from node.probe import Capability
    from swarm.dht import SwarmPeer
    from swarm.reachability import ReachabilityMonitor
    from swarm.transport import Transport

log = logging.getLogger(__name__)


class SwarmPresence:
    """Advert, registration, heartbeats, reachability and the status line, as a mixin of
    :class:`~node.worker.NodeWorker` (which sets every attribute below in its ``__init__``)."""

    config: NodeConfig
    backend: InferenceBackend
    identity: Identity
    capability: Capability | None
    clock: Callable[[], float]
    stats: NodeStats
    peer: SwarmPeer | None
    _transport: Transport | None
    _advert_dirty: asyncio.Event
    _prefetch: asyncio.Task[None] | None
    _current: Lease | None
    _hb_seq: int
    active: bool
    heartbeat_interval_s: float
    coordinator_peer_id: str
    broadcast: Any
    reachability: ReachabilityMonitor | None
    checkpoints: CheckpointManager | None
    client: CoordinatorClient | None
    failures: FailureTracker

    if TYPE_CHECKING:  # defined by the worker (node.worker)

        @property
        def peer_id(self) -> str: ...

        @property
        def stopping(self) -> bool: ...

    def build_advert(self) -> CapabilityAdvert:
        """This node's capability advert with current throughput and loaded version."""
        return make_advert(
            self.config,
            self.identity,
            self.backend,
            self.capability,
            peer_id=self.peer_id,
            tokens_per_s=self.stats.tokens_per_s,
            now=self.clock(),
            reachability=self.reachability.state if self.reachability else "unknown",
        )

    async def _register_with_retries(self, budget_s: float) -> None:
        """Register, retrying transient failures (a dropped stream) until ``budget_s`` is spent;
        a refusal (``Rejected``) or the last failure propagates."""
        from node.client import CoordinatorUnavailable

        deadline = time.monotonic() + budget_s
        delay = 0.2
        while True:
            left = deadline - time.monotonic()
            try:
                await self._register(timeout=max(left, 0.5))
                return
            except CoordinatorUnavailable as exc:
                if time.monotonic() + delay >= deadline:
                    raise
                log.warning("registration failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _register(self, *, timeout: float | None = None) -> None:
        assert self.client is not None
        ack = await self.client.register(self.build_advert(), timeout=timeout)
        if self.config.heartbeat_interval_s is None:
            self.heartbeat_interval_s = ack.heartbeat_interval_s
        skew = ack.server_time - self.clock()
        if abs(skew) > 30:
            log.warning("clock differs from the coordinator's by %+.0f s; enable NTP", skew)
        log.info(
            "registered as %s; coordinator at policy v%s",
            short_fingerprint(ack.node_fingerprint),
            ack.current_policy_version,
        )

    async def _advert_loop(self) -> None:
        from swarm.adverts import AdvertAnnouncer
        from swarm.errors import DhtError

        assert self.peer is not None
        announcer = AdvertAnnouncer(
            self.peer,
            self.identity,
            self.build_advert,
            period=self.config.advert_period_s,
            clock=self.clock,
        )
        while True:
            try:
                if not await announcer.announce_once():
                    log.warning("advert was not accepted by any DHT peer; will retry")
            except DhtError as exc:
                log.warning("advert announcement failed: %s", exc)
            self._advert_dirty.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._advert_dirty.wait(), self.config.advert_period_s)

    async def _reachability_loop(self) -> None:
        """Measure (dial-back by the coordinator) whether other peers can dial this node; only
        then does it announce the chunks it holds (a NATed node stays download-only)."""
        from swarm.reachability import ReachabilityMonitor

        peer = self.peer
        assert peer is not None and self._transport is not None

        def changed(state: str) -> None:
            self.broadcast.dialable = state == "public"
            self._advert_dirty.set()

        self.reachability = ReachabilityMonitor(
            self._transport,
            peer.visible_maddrs,
            lambda: self.coordinator_peer_id,
            on_change=changed,
            interval=self.config.reachability_interval_s,
        )
        await self.reachability.run()

    # ------------------------------------------------------------------ heartbeat, status
    async def _heartbeat_loop(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            self._hb_seq += 1
            hb = Heartbeat(
                peer_id=self.peer_id,
                seq=self._hb_seq,
                policy_version=self.backend.loaded_version,
                active_leases=[self._current.lease_id] if self._current else [],
                tokens_per_s=self.stats.tokens_per_s,
            )
            try:
                ack = await self.client.heartbeat(hb)
                self.active = ack.active
                self._maybe_prefetch(ack.current_policy_version)
            except Rejected as exc:
                if exc.code is ReasonCode.UNKNOWN_NODE:
                    await self._reregister()
                elif exc.code is ReasonCode.BANNED:  # said once by the work loop; not every beat
                    log.debug("heartbeat refused: %s", exc)
                else:
                    log.warning("heartbeat refused: %s", exc)
            except CoordinatorError as exc:
                self.stats.coordinator_errors += 1
                log.debug("heartbeat failed: %s", exc)

    def _maybe_prefetch(self, version: int | None) -> None:
        """Start fetching a newly published version before a lease asks for it (and relay it)."""
        loaded = self.backend.loaded_version
        busy = self._prefetch is not None and not self._prefetch.done()
        if version is None or busy or self.stopping or self.checkpoints is None:
            return
        if loaded is not None and version <= loaded:
            return
        self._prefetch = asyncio.create_task(self._run_prefetch(version), name="node-prefetch")

    async def _run_prefetch(self, version: int) -> None:
        assert self.checkpoints is not None
        try:
            await self.checkpoints.prefetch(version)
        except CheckpointError as exc:
            log.debug("prefetch of v%d failed (a lease will retry): %s", version, exc)

    async def _reregister(self) -> None:
        log.warning("coordinator does not know this node (restarted?); registering again")
        try:
            await self._register()
        except CoordinatorError as exc:
            log.warning("re-registration failed: %s", exc)

    def _status_line(self) -> str:
        s = self.stats
        tps = f"{s.tokens_per_s:.0f}" if s.tokens_per_s is not None else "-"
        v = self.backend.loaded_version
        state = "stopping" if self.stopping else ("active" if self.active else "standby")
        if self.failures.gave_up:
            state = "failed"
        problem = self.failures.problem
        return (
            f"status: {state} v={'-' if v is None else v} leases={s.leases_done} "
            f"tok/s={tps} accepted={s.leases_accepted} rejected={s.leases_rejected} "
            f"released={s.leases_released} "
            f"reach={self.reachability.state if self.reachability else 'unknown'}"
            + (f" problem: {problem}" if problem else "")
        )

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            log.info("%s", self._status_line())

    def statistics(self) -> dict[str, Any]:
        """Snapshot of the counters plus the loaded version."""
        out = dict(vars(self.stats))
        out["policy_version"] = self.backend.loaded_version
        out["active"] = self.active
        out["problem"] = self.failures.problem
        out["failed"] = self.failures.gave_up
        return out
