"""The contributor node's work loop: join, advertise, pull leases, generate, submit, repeat.

:class:`NodeWorker` owns, in start order: the swarm peer (hivemind DHT with
:func:`swarm.adverts.swarm_validators`, libp2p), the checkpoint
:class:`~swarm.broadcast.BroadcastNode` (it keeps serving chunks of the versions it holds), the
:class:`~node.checkpoints.CheckpointManager`, the registration with the coordinator, and four
named tasks:

* ``work``      pull a lease (one over local limits, :func:`~node.rollouts.lease_problem`, is
                released unrun) -> make ``lease.policy_version`` the loaded weights -> generate
                each prompt ``group_size`` times (prompt ``i`` seeded with
                :func:`~policy.sampling.prompt_seed` ``(lease.sampling.seed, i)``; sample ``j`` with
                :func:`~policy.sampling.sample_seed` ``(prompt seed, j)``, recorded in
                ``Sample.seed``) -> sign and submit -> repeat. ``Standby`` waits ``retry_after_s``;
                coordinator or network errors back off exponentially with jitter and the loop
                resumes by itself when the coordinator answers again;
* ``heartbeat`` liveness every ``heartbeat_interval_s`` (re-registers after ``unknown_node``);
* ``advert``    re-announces the signed capability advert in the DHT (at once when the loaded
                version changes);
* ``status``    one log line at a steady interval: version, leases done, tokens/s, verdicts.

The last three (and registration, reachability) are :class:`~node.presence.SwarmPresence`.

Shutdown (:meth:`NodeWorker.request_stop`, then :meth:`NodeWorker.stop`): take no new lease;
a lease whose results are ready is submitted, one still being generated or waiting for its
checkpoint is released (the coordinator reassigns its prompts at once); then the DHT is left.
Generation runs on a dedicated thread so heartbeats and chunk serving continue meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from node.backends.base import GenerationRequest, InferenceBackend, SampleOut
from node.checkpoints import CheckpointError, CheckpointManager
from node.client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable, Rejected
from node.config import NodeConfig
from node.failures import FailureTracker
from node.presence import SwarmPresence
from node.rollouts import build_submission, lease_problem, lease_requests, to_sampling_config
from node.status import Backoff, NodeStats
from protocol.errors import ReasonCode
from protocol.identity import Identity, short_fingerprint
from protocol.messages import (
    Ack,
    Lease,
    LeaseRequest,
    RolloutSubmission,
    Standby,
    Timings,
)
from swarm.tasks import cancel_and_wait

if TYPE_CHECKING:
    from node.probe import Capability
    from policy.model import Tokenizer
    from swarm.dht import SwarmPeer
    from swarm.holders import HolderDirectory
    from swarm.reachability import ReachabilityMonitor
    from swarm.transport import Transport

__all__ = ["NodeWorker"]

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How long stop() waits for each background task to end after cancelling it.
CANCEL_TIMEOUT_S = 10.0


class NodeWorker(SwarmPresence):
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
        self.stats = NodeStats()
        self.peer: SwarmPeer | None = None
        self._transport = transport
        self._directory = directory
        self._stopping = asyncio.Event()
        self._advert_dirty = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._gen_future: asyncio.Future[Any] | None = None
        self._prefetch: asyncio.Task[None] | None = None
        self._current: Lease | None = None
        #: what the node is doing now, in a few words (the status page shows it)
        self.phase = "starting"
        #: capacity figures (Timings.load_s / overhead_s): when the last generation ended
        #: (monotonic) and the deliberate waits since then
        self._gen_ended: float | None = None
        self._waited_s = 0.0
        self._hb_seq = 0
        self.active = True
        self.heartbeat_interval_s = config.heartbeat_interval_s or 10.0
        self.coordinator_peer_id: str = config.coordinator_peer_id
        self.broadcast: Any = None
        self.reachability: ReachabilityMonitor | None = None
        self.checkpoints: CheckpointManager | None = None
        self.client: CoordinatorClient | None = None
        self.backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, self.rng)
        #: consecutive generation failures: their own back-off, and giving up (node.failures)
        self.failures = FailureTracker(
            config.max_identical_failures, config.backoff_initial_s, config.backoff_max_s, self.rng
        )

    # ------------------------------------------------------------------ lifecycle
    @property
    def peer_id(self) -> str:
        if self._transport is None:
            return "-"
        return self._transport.peer_id

    @property
    def current_lease(self) -> Lease | None:
        """The lease being worked on, if any."""
        return self._current

    @property
    def generation_in_flight(self) -> bool:
        """True while a backend.generate call runs on the generation thread."""
        return self._gen_future is not None and not self._gen_future.done()

    async def start(self) -> None:
        """Join the swarm and register; raises StartupError / CoordinatorError on failure."""
        from swarm.broadcast import BroadcastNode
        from swarm.chunks import ChunkStore
        from swarm.fetcher import DownloadConfig

        cfg = self.config
        state = Path(cfg.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        if self._transport is None:
            await self._start_peer(state)
        assert self._transport is not None and self._directory is not None
        self.broadcast = BroadcastNode(
            self._transport,
            ChunkStore(state / "checkpoints", keep_versions=cfg.keep_versions),
            self._directory,
            bytes(32),  # replaced by the pinned key once resolved (node.checkpoints)
            config=DownloadConfig(
                deadline=cfg.download_timeout_s, reserve_bytes=cfg.min_free_disk_mb << 20
            ),
        )
        if self.peer is not None:  # a real network: holdings announced only once measured
            self.broadcast.dialable = False
        await self.broadcast.start()
        self.checkpoints = CheckpointManager(
            self.broadcast,
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
        await self._register_with_retries(cfg.register_timeout_s)
        log.info(
            "node %s (%s) joined: backend %s/%s, coordinator %s",
            short_fingerprint(self.identity.fingerprint),
            self.peer_id,
            self.backend.name,
            self.backend.dtype,
            self.coordinator_peer_id,
        )
        self._spawn("work", self._work_loop())
        self._spawn("heartbeat", self._heartbeat_loop())
        self._spawn("status", self._status_loop())
        if self.peer is not None:
            self._spawn("advert", self._advert_loop())
            self._spawn("reachability", self._reachability_loop())

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

    def _spawn(self, name: str, coro: Awaitable[None]) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=f"node-{name}")  # type: ignore[arg-type]

    def request_stop(self) -> None:
        """Stop taking work (graceful shutdown starts; see :meth:`stop`)."""
        if not self._stopping.is_set():
            log.info("stopping: no new leases; submitting or releasing what is in hand")
        self.phase = "stopping"
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def wait(self) -> None:
        """Until the work loop has ended (after :meth:`request_stop`); re-raises its failure."""
        task = self._tasks.get("work")
        if task is not None:
            await asyncio.shield(task)

    async def stop(self) -> None:
        """Drain (submit or release the lease in hand), stop every task, leave the DHT."""
        self.request_stop()
        work = self._tasks.pop("work", None)
        if work is not None:
            with contextlib.suppress(Exception):
                await work
        if self._prefetch is not None:
            self._tasks["prefetch"] = self._prefetch
        for name in list(self._tasks):
            await cancel_and_wait([self._tasks.pop(name)], timeout=CANCEL_TIMEOUT_S)
        if self.broadcast is not None:
            await self.broadcast.stop()
            self.broadcast = None
        if self.peer is not None:
            await self.peer.stop()
            self.peer = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("node stopped: %s", self._status_line())

    # ------------------------------------------------------------------ the work loop
    async def _sleep(self, seconds: float) -> None:
        """Sleep, but return at once when stopping (a deliberate wait: not plumbing overhead)."""
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), max(0.0, seconds))
        self._waited_s += time.monotonic() - t0

    async def _unless_stopped(self, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Run ``aw`` unless a stop arrives first (then ``aw`` is cancelled: (False, None))."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return True, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False, None

    async def _work_loop(self) -> None:
        assert self.client is not None
        while not self.stopping:
            if self.failures.gave_up:  # stays up (heartbeats, adverts, chunks) until stopped
                self.phase = "stopped taking leases"
                await self._stopping.wait()
                break
            self.phase = "asking for work"
            req = LeaseRequest(
                peer_id=self.peer_id,
                policy_version=self.backend.loaded_version,
                max_prompts=self.config.max_prompts,
            )
            try:
                got = await self.client.lease(req)
            except Rejected as exc:
                await self._on_rejected(exc)
                continue
            except CoordinatorError as exc:
                self.stats.coordinator_errors += 1
                delay = self.backoff.next_delay()
                self.phase = f"coordinator unreachable, retrying in {delay:.0f} s"
                log.warning("lease request failed (%s); retrying in %.1f s", exc, delay)
                await self._sleep(delay)
                continue
            if self.backoff.failures:
                log.info("coordinator reachable again")
            self.backoff.reset()
            if isinstance(got, Standby):
                self.phase = f"standby: {got.reason}"
                log.info("standby (%s); asking again in %.1f s", got.reason, got.retry_after_s)
                await self._sleep(got.retry_after_s)
                continue
            self._current = got
            try:
                await self._run_lease(got)
            except Exception as exc:  # a bug or a fatal local problem: give the work back first
                await self._release(got, f"node failure: {type(exc).__name__}")
                raise
            finally:
                self._current = None

    async def _on_rejected(self, exc: Rejected) -> None:
        if exc.code is ReasonCode.UNKNOWN_NODE:
            await self._reregister()
            await self._sleep(self.backoff.next_delay())
            return
        if exc.code is ReasonCode.BANNED:
            delay = exc.retry_after_s or self.config.backoff_max_s
            self.phase = f"banned: {exc.detail}"
            log.error("this node is banned: %s; asking again in %.0f s", exc.detail, delay)
            await self._sleep(delay)
            return
        delay = self.backoff.next_delay()
        self.phase = f"lease refused ({exc.code.value}), retrying in {delay:.0f} s"
        log.error("lease request refused: %s; retrying in %.1f s", exc, delay)
        await self._sleep(delay)

    async def _run_lease(self, lease: Lease) -> None:
        assert self.checkpoints is not None
        log.debug(
            "lease %s: %d prompts x %d at v%d, deadline in %.0f s",
            lease.lease_id,
            len(lease.prompts),
            lease.group_size,
            lease.policy_version,
            lease.deadline - self.clock(),
        )
        problem = lease_problem(lease, self.config.max_prompts)
        if problem is not None:  # a broken coordinator must not make this node run out of memory
            log.error("lease %s refused: %s; giving it back", lease.lease_id, problem)
            await self._release(lease, f"lease exceeds local limits: {problem}")
            await self._sleep(self.backoff.next_delay())
            return
        try:
            sampling = to_sampling_config(lease)
        except ValueError as exc:
            await self._release(lease, f"unsupported sampling parameters: {exc}")
            return
        self.phase = f"loading policy v{lease.policy_version}"
        load_t0 = time.monotonic()
        try:
            ok, _ = await self._unless_stopped(self.checkpoints.ensure(lease.policy_version))
        except CheckpointError as exc:
            log.error("cannot load policy v%d: %s", lease.policy_version, exc)
            await self._release(lease, f"cannot load v{lease.policy_version}: {exc}")
            await self._sleep(self.backoff.next_delay())
            return
        if not ok:
            await self._release(lease, "node shutting down")
            return
        self._advert_dirty.set()
        loop = asyncio.get_running_loop()
        requests = lease_requests(lease)
        started = self.clock()
        t0 = time.perf_counter()
        load_s, overhead_s = self._lease_plumbing(load_t0)
        log.debug("generating lease %s", lease.lease_id)
        self.phase = f"generating {len(lease.prompts)} prompts × {lease.group_size}"
        generate: Callable[..., list[list[SampleOut]]] = self.backend.generate
        if "greedy" in self.config.misbehave:  # testing only: swarm demo --byzantine
            from node.byzantine import greedy_generate

            generate = functools.partial(greedy_generate, self.backend)
        self._gen_future = loop.run_in_executor(self._executor, generate, requests, sampling)
        try:
            ok, outs = await self._unless_stopped(asyncio.shield(self._gen_future))
        except Exception as exc:  # a backend failure must not kill the node: give the work back
            reason = f"generation failed: {type(exc).__name__}: {exc}"
            delay = self.failures.record(reason)
            if self.failures.gave_up:
                log.error("%s; no more leases until this node is restarted", self.failures.problem)
                await self._release(lease, self.failures.problem or reason)
                return
            log.exception("generation failed for lease %s", lease.lease_id)
            await self._release(lease, self.failures.problem or reason)
            await self._sleep(delay)
            return
        if not ok or outs is None:
            await self._release(lease, "node shutting down")
            return
        gen_s = time.perf_counter() - t0
        self.failures.reset()
        self._gen_ended, self._waited_s = time.monotonic(), 0.0
        sub = self._submission(
            lease, requests, outs, started, gen_s, load_s=load_s, overhead_s=overhead_s
        )
        await self._submit(lease, sub)

    def _lease_plumbing(self, load_t0: float) -> tuple[float, float]:
        """(load_s, overhead_s) of the lease whose generation starts now (Timings): the wait for
        its version since ``load_t0``, and the rest of the time since the previous generation
        ended, deliberate waits (standby, back-off) excluded."""
        now = time.monotonic()
        load_s = max(0.0, now - load_t0)
        if self._gen_ended is None:
            return load_s, 0.0
        return load_s, max(0.0, now - self._gen_ended - load_s - self._waited_s)

    def _submission(
        self,
        lease: Lease,
        requests: list[GenerationRequest],
        outs: list[list[SampleOut]],
        started: float,
        gen_s: float,
        *,
        load_s: float = 0.0,
        overhead_s: float = 0.0,
    ) -> RolloutSubmission:
        for req, samples in zip(requests, outs, strict=True):
            if len(samples) != lease.group_size:
                raise RuntimeError(f"backend returned {len(samples)} samples, asked {req.n}")
        self._record_throughput(sum(len(s.token_ids) for group in outs for s in group), gen_s)
        sub = build_submission(
            lease,
            requests,
            outs,
            set(self.backend.eos_token_ids),
            backend=self.backend.name,
            dtype=self.backend.dtype,
            timings=Timings(
                started_at=started,
                finished_at=self.clock(),
                generate_s=gen_s,
                load_s=load_s,
                overhead_s=overhead_s,
            ),
        )
        if self.config.misbehave:
            from node.byzantine import misbehave

            sub = misbehave(
                self.config.misbehave,
                sub,
                lease,
                vocab_size=self.backend.vocab_size,
                tokenizer=self.tokenizer,
                rng=self.rng,
            )
        return sub

    def _record_throughput(self, tokens: int, seconds: float) -> None:
        s = self.stats
        s.tokens_generated += tokens
        s.generate_s += seconds
        if seconds > 0:
            rate = tokens / seconds
            s.tokens_per_s = rate if s.tokens_per_s is None else 0.7 * s.tokens_per_s + 0.3 * rate

    async def _submit(self, lease: Lease, sub: RolloutSubmission) -> None:
        """Submit, retrying network errors until the lease deadline (re-sends are idempotent)."""
        assert self.client is not None
        self.phase = "submitting rollouts"
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s, self.rng)
        while True:
            try:
                verdict = await self.client.submit(sub)
                break
            except CoordinatorError as exc:
                self.stats.coordinator_errors += 1
                left = lease.deadline - self.clock()
                if left <= 0 or not isinstance(exc, CoordinatorUnavailable):
                    log.error("lease %s: submission lost: %s", lease.lease_id, exc)
                    return
                delay = min(backoff.next_delay(), left)
                if self.stopping and backoff.failures > 2:
                    log.error("lease %s: giving up the submission on shutdown", lease.lease_id)
                    return
                log.warning("submit failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
        self.stats.leases_done += 1
        if isinstance(verdict, Ack):
            self.stats.leases_accepted += 1
            self.stats.samples_accepted += sum(len(g.samples) for g in sub.groups)
            log.debug("lease %s accepted: %s", lease.lease_id, verdict.detail)
        else:
            self.stats.leases_rejected += 1
            self.stats.last_reject = f"{verdict.code.value}: {verdict.detail}"
            self.stats.last_reject_at = self.clock()
            log.warning("lease %s rejected: %s", lease.lease_id, self.stats.last_reject)

    async def _release(self, lease: Lease, reason: str) -> None:
        assert self.client is not None
        try:
            await self.client.release(lease.lease_id, lease.epoch, reason)
            self.stats.leases_released += 1
            log.info("released lease %s (%s)", lease.lease_id, reason)
        except CoordinatorError as exc:
            log.warning("could not release lease %s (%s): %s", lease.lease_id, reason, exc)
