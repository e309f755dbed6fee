"""How a node stays known to the swarm: its advert, registration, heartbeats, reachability.

Each piece owns its state and receives what it uses (:class:`node.worker.NodeWorker` wires them):

* :class:`AdvertBuilder` -- the capability advert, fresh on every call (probe results, backend,
  throughput, loaded version, the reachability last measured);
* :class:`Registrar`     -- registers with the coordinator (with retries at start-up, again after
  ``unknown_node``) and keeps the heartbeat interval (configured, else the coordinator's latest:
  its registration and every heartbeat answer name it);
* :class:`Prefetcher`    -- starts fetching a newly published version before a lease asks for it
  (and so relays it);
* :class:`AdvertLoop`    -- re-announces the signed advert in the DHT every ``advert_period_s``,
  at once after :meth:`AdvertLoop.mark_dirty` (the loaded version or the reachability changed);
* :class:`Presence`      -- ``async start()`` / ``stop()`` of the named tasks ``heartbeat``
  (liveness every interval; re-registers after ``unknown_node``; offers the coordinator's current
  version to the prefetcher), ``status`` (one log line at a steady interval) and, on a real
  network, ``advert`` and ``reachability`` (the coordinator dials back; a node others cannot dial
  stays download-only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from node.checkpoints import CheckpointError
from node.client import CoordinatorError, CoordinatorUnavailable, Rejected
from node.status import make_advert
from protocol.errors import ReasonCode
from protocol.identity import short_fingerprint
from protocol.messages import Heartbeat
from swarm.tasks import cancel_and_wait

if TYPE_CHECKING:
    from node.backends.base import InferenceBackend
    from node.checkpoints import CheckpointManager
    from node.client import CoordinatorClient
    from node.config import NodeConfig
    from node.failures import FailureTracker
    from node.probe import Capability
    from node.status import NodeStats
    from protocol.identity import Identity
    from protocol.messages import CapabilityAdvert, Lease
    from protocol.schema import Reachability
    from swarm.dht import SwarmPeer
    from swarm.reachability import ReachabilityMonitor

__all__ = [
    "AdvertBuilder",
    "AdvertLoop",
    "Prefetcher",
    "Presence",
    "Registrar",
    "node_state",
    "status_line",
]

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


def node_state(failures: FailureTracker, *, stopping: bool, active: bool) -> str:
    """``failed`` (gave up taking leases), ``stopping``, ``active`` or ``standby``."""
    if failures.gave_up:
        return "failed"
    if stopping:
        return "stopping"
    return "active" if active else "standby"


def status_line(
    stats: NodeStats,
    loaded_version: int | None,
    state: str,
    reachability: Reachability,
    problem: str | None,
) -> str:
    """The node's one-line status (logged by the ``status`` task and on stop)."""
    s = stats
    tps = f"{s.tokens_per_s:.0f}" if s.tokens_per_s is not None else "-"
    v = loaded_version
    return (
        f"status: {state} v={'-' if v is None else v} leases={s.leases_done} "
        f"tok/s={tps} accepted={s.leases_accepted} rejected={s.leases_rejected} "
        f"released={s.leases_released} reach={reachability}"
        + (f" problem: {problem}" if problem else "")
    )


class AdvertBuilder:
    """This node's capability advert with current throughput, loaded version and reachability.

    :attr:`peer_id` is "-" until the worker knows its transport; :attr:`reachability` is set by
    whoever measures it (the worker's dial-back callback)."""

    def __init__(
        self,
        config: NodeConfig,
        identity: Identity,
        backend: InferenceBackend,
        capability: Capability | None,
        stats: NodeStats,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._identity = identity
        self._backend = backend
        self._capability = capability
        self._stats = stats
        self._clock = clock
        self.peer_id = "-"
        self.reachability: Reachability = "unknown"

    def __call__(self) -> CapabilityAdvert:
        return make_advert(
            self._config,
            self._identity,
            self._backend,
            self._capability,
            peer_id=self.peer_id,
            tokens_per_s=self._stats.tokens_per_s,
            now=self._clock(),
            reachability=self.reachability,
        )


class Registrar:
    """Registration with the coordinator; owns the heartbeat interval it learns (unless
    ``heartbeat_interval_s`` is configured)."""

    def __init__(
        self,
        client: CoordinatorClient,
        advert: Callable[[], CapabilityAdvert],
        *,
        heartbeat_interval_s: float | None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._client = client
        self._advert = advert
        self._configured = heartbeat_interval_s
        self._clock = clock
        self._monotonic = monotonic
        self._sleep = sleep
        #: seconds between heartbeats: the configured value, else the coordinator's (register)
        self.heartbeat_interval_s = heartbeat_interval_s or 10.0

    def follow(self, interval_s: float | None) -> None:
        """The coordinator asks for heartbeats every ``interval_s`` (it grows with the swarm;
        None: keep the interval followed now); a configured interval wins."""
        if self._configured is None and interval_s is not None:
            self.heartbeat_interval_s = interval_s

    async def register(self, *, timeout: float | None = None) -> None:
        ack = await self._client.register(self._advert(), timeout=timeout)
        self.follow(ack.heartbeat_interval_s)
        skew = ack.server_time - self._clock()
        if abs(skew) > 30:
            log.warning("clock differs from the coordinator's by %+.0f s; enable NTP", skew)
        log.info(
            "registered as %s; coordinator at policy v%s",
            short_fingerprint(ack.node_fingerprint),
            ack.current_policy_version,
        )

    async def register_with_retries(self, budget_s: float) -> None:
        """Register, retrying transient failures (a dropped stream) until ``budget_s`` is spent;
        a refusal (``Rejected``) or the last failure propagates, except ``swarm_full`` with a
        ``retry_after_s`` (the coordinator admits new nodes at the rate its verifiers absorb,
        oldest first): the node waits as told and asks again, for as long as it takes."""
        deadline = self._monotonic() + budget_s
        delay = 0.2
        while True:
            left = deadline - self._monotonic()
            try:
                await self.register(timeout=max(left, 0.5))
                return
            except Rejected as exc:
                if exc.code is not ReasonCode.SWARM_FULL or exc.retry_after_s is None:
                    raise
                log.info("not admitted yet (%s); registering again in %.0f s", exc.detail,
                         exc.retry_after_s)  # fmt: skip
                await self._sleep(max(0.5, exc.retry_after_s))
                deadline = self._monotonic() + budget_s  # waiting to be admitted is no failure
            except CoordinatorUnavailable as exc:
                if self._monotonic() + delay >= deadline:
                    raise
                log.warning("registration failed (%s); retrying in %.1f s", exc, delay)
                await self._sleep(delay)
                delay = min(delay * 2, 2.0)

    async def reregister(self) -> None:
        """After ``unknown_node`` (the coordinator restarted): register again; failures logged."""
        log.warning("coordinator does not know this node (restarted?); registering again")
        try:
            await self.register()
        except CoordinatorError as exc:
            log.warning("re-registration failed: %s", exc)


class Prefetcher:
    """Fetches a newly published version in the background (one at a time), so a lease finds it
    loaded and the node relays it to others meanwhile."""

    def __init__(
        self, checkpoints: CheckpointManager, backend: InferenceBackend, stopping: asyncio.Event
    ) -> None:
        self._checkpoints = checkpoints
        self._backend = backend
        self._stopping = stopping
        self._task: asyncio.Task[None] | None = None

    def offer(self, version: int | None) -> None:
        """Start fetching ``version`` unless it is not newer than the loaded one, a fetch runs,
        or the node is stopping."""
        loaded = self._backend.loaded_version
        busy = self._task is not None and not self._task.done()
        if version is None or busy or self._stopping.is_set():
            return
        if loaded is not None and version <= loaded:
            return
        self._task = asyncio.create_task(self._run(version), name="node-prefetch")

    async def _run(self, version: int) -> None:
        try:
            await self._checkpoints.prefetch(version)
        except CheckpointError as exc:
            log.debug("prefetch of v%d failed (a lease will retry): %s", version, exc)

    async def stop(self, timeout: float) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], timeout=timeout)
            self._task = None


class AdvertLoop:
    """Re-announces the signed advert in the DHT (``swarm.adverts.AdvertAnnouncer``) every
    ``period`` seconds, and at once after :meth:`mark_dirty`."""

    def __init__(
        self,
        peer: SwarmPeer,
        identity: Identity,
        advert: Callable[[], CapabilityAdvert],
        *,
        period: float,
        clock: Callable[[], float],
    ) -> None:
        from swarm.adverts import AdvertAnnouncer

        self._announcer = AdvertAnnouncer(peer, identity, advert, period=period, clock=clock)
        self._period = period
        self._dirty = asyncio.Event()

    def mark_dirty(self) -> None:
        """The advert changed (loaded version, reachability): announce it now."""
        self._dirty.set()

    async def run(self) -> None:
        from swarm.errors import DhtError

        while True:
            try:
                if not await self._announcer.announce_once():
                    log.warning("advert was not accepted by any DHT peer; will retry")
            except DhtError as exc:
                log.warning("advert announcement failed: %s", exc)
            self._dirty.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self._period)


class Presence:
    """The node's liveness towards the coordinator and the swarm (see the module docstring).

    Reads the loaded version from ``backend``, throughput from ``stats``, the lease in hand from
    ``lease_in_hand``, the reachability from ``advert``; owns :attr:`active` (the coordinator's
    last word: active or standby) and :attr:`heartbeats_sent`."""

    def __init__(
        self,
        client: CoordinatorClient,
        registrar: Registrar,
        advert: AdvertBuilder,
        prefetcher: Prefetcher,
        *,
        backend: InferenceBackend,
        stats: NodeStats,
        failures: FailureTracker,
        lease_in_hand: Callable[[], Lease | None],
        stopping: asyncio.Event,
        status_interval_s: float,
        advert_loop: AdvertLoop | None = None,
        reachability: ReachabilityMonitor | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._client = client
        self._registrar = registrar
        self._advert = advert
        self._prefetcher = prefetcher
        self._backend = backend
        self._stats = stats
        self._failures = failures
        self._lease_in_hand = lease_in_hand
        self._stopping = stopping
        self._status_interval_s = status_interval_s
        self._advert_loop = advert_loop
        self._reachability = reachability
        self._sleep = sleep
        self._tasks: list[asyncio.Task[None]] = []
        #: the coordinator's answer to the last heartbeat: active (True) or standby
        self.active = True
        #: heartbeats sent so far (the sequence number of the last one)
        self.heartbeats_sent = 0

    async def start(self) -> None:
        """Start the tasks ``node-heartbeat``, ``node-status`` (and ``node-advert``,
        ``node-reachability`` when an advert loop and a reachability monitor were given)."""
        self._spawn("heartbeat", self._heartbeat_loop())
        self._spawn("status", self._status_loop())
        if self._advert_loop is not None:
            self._spawn("advert", self._advert_loop.run())
        if self._reachability is not None:
            self._spawn("reachability", self._reachability.run())

    async def stop(self, timeout: float) -> None:
        """Cancel the tasks, each waited for at most ``timeout`` seconds."""
        while self._tasks:
            await cancel_and_wait([self._tasks.pop(0)], timeout=timeout)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(coro, name=f"node-{name}"))

    def state(self) -> str:
        """``failed`` (gave up taking leases), ``stopping``, ``active`` or ``standby``."""
        return node_state(self._failures, stopping=self._stopping.is_set(), active=self.active)

    def status_line(self) -> str:
        """The line the ``status`` task logs."""
        return status_line(
            self._stats,
            self._backend.loaded_version,
            self.state(),
            self._advert.reachability,
            self._failures.problem,
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._sleep(self._registrar.heartbeat_interval_s)
            await self.beat()

    async def beat(self) -> None:
        """Send one heartbeat and act on the answer (one step of the ``heartbeat`` task)."""
        self.heartbeats_sent += 1
        lease = self._lease_in_hand()
        hb = Heartbeat(
            peer_id=self._advert.peer_id,
            seq=self.heartbeats_sent,
            policy_version=self._backend.loaded_version,
            active_leases=[lease.lease_id] if lease else [],
            tokens_per_s=self._stats.tokens_per_s,
        )
        try:
            ack = await self._client.heartbeat(hb)
            self.active = ack.active
            self._registrar.follow(ack.heartbeat_interval_s)
            self._prefetcher.offer(ack.current_policy_version)
        except Rejected as exc:
            if exc.code is ReasonCode.UNKNOWN_NODE:
                await self._registrar.reregister()
            elif exc.code is ReasonCode.BANNED:  # said once by the work loop; not every beat
                log.debug("heartbeat refused: %s", exc)
            else:
                log.warning("heartbeat refused: %s", exc)
        except CoordinatorError as exc:
            self._stats.coordinator_errors += 1
            log.debug("heartbeat failed: %s", exc)

    async def _status_loop(self) -> None:
        while True:
            await self._sleep(self._status_interval_s)
            log.info("%s", self.status_line())
