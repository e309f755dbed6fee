"""The coordinator process: the :class:`~coordinator.core.Coordinator` on the network.

:class:`CoordinatorService` owns

* a swarm peer (DHT bootstrap peer + libp2p handle) and the RPC handlers of :mod:`protocol.rpc`;
* a :class:`~swarm.broadcast.BroadcastNode` that downloads every published version (it signs the
  manifests the trainer proposes, the trainer seeds the chunks) so it can re-score log-probs and
  serve as a manifest source for nodes (:mod:`coordinator.holding`: the versions held and the
  spot-check models);
* the trainer's handlers: publications and the rollout feed (:mod:`coordinator.learner_link`);
* a read-only HTTP endpoint (:mod:`coordinator.http`): the dashboard, ``/status`` JSON, its
  history (:mod:`coordinator.history`) and ``/metrics``; a holder census of the recent versions
  (:mod:`coordinator.dissemination`);
* an upkeep task: lease expiry, re-planning, DHT records, the status snapshot.

Every RPC answer is a protocol message; refusals are ``Reject(code, detail)``, never a dropped
stream, so a node always learns why.

The command line launcher is :mod:`coordinator.launch`, the status document
:mod:`coordinator.status`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.dissemination import HolderCensus, coordinator_census
from coordinator.errors import Rejection
from coordinator.history import StatusHistory
from coordinator.holding import VersionHolding, model_spec
from coordinator.http import PAGE_TIMEOUT_S, StatusHttpServer
from coordinator.learner_link import LearnerLink
from coordinator.logprobs import CalibrationSettings, InProcessLogprobVerifier
from coordinator.status import TrainerGauges, build_status, node_page, wire_status
from coordinator.store import Store
from coordinator.tasks import make_task
from policy.preflight import PolicySetup
from protocol import rpc
from protocol.codec import decode, encode
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity, fingerprint_of, parse_fingerprint
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    FetchRollouts,
    Heartbeat,
    LeaseRequest,
    PublishVersion,
    Register,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    SignedEnvelope,
    StatusRequest,
    StatusResponse,
)
from swarm.adverts import swarm_validators
from swarm.broadcast import BroadcastNode
from swarm.chunks import ChunkStore
from swarm.dht import PeerConfig, SwarmPeer
from swarm.files import atomic_write_text
from swarm.holders import DhtHolderDirectory
from swarm.ratelimit import TokenBucket
from swarm.reachability import DialbackServer
from swarm.records import publish_coordinator_address, publish_policy_version
from swarm.transport import P2PTransport, Transport

log = logging.getLogger(__name__)
M = TypeVar("M", bound=msgspec.Struct)

TICK_S = 1.0
RECORD_TTL_S = 60.0
#: a submission waits at most this long for the coordinator to hold its version (spot checks)
SPOT_CHECK_WAIT_S = 5.0
#: a lease request that finds no leasable version while one is being fetched from the trainer
#: waits up to this long for it (instead of sending the node away for a 1 s standby)
LEASE_VERSION_WAIT_S = 2.0


class CoordinatorService(VersionHolding, LearnerLink):
    """Coordinator core + libp2p RPC + checkpoint holder + HTTP status."""

    def __init__(
        self, config: CoordinatorConfig, state_dir: Path, *, setup: PolicySetup | None = None
    ) -> None:
        self.config = config
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity.load_or_create(self.state_dir / "coordinator.key")
        net = config.network
        self.trainer_fingerprint = (
            parse_fingerprint(net.trainer_key) if net.trainer_key is not None else None
        )
        self.peer = SwarmPeer(
            PeerConfig(
                host_maddrs=(f"/ip4/{net.host}/tcp/{net.port}",),
                announce_maddrs=tuple(net.announce_maddrs),
                identity_path=str(self.state_dir / "p2p.key"),
            ),
            record_validators=swarm_validators(),
        )
        self.core: Coordinator | None = None
        #: tokenizer, prompt renderer and stop set, checked at start (policy.preflight); the
        #: launcher passes what it already checked, else :meth:`start` checks
        self.setup: PolicySetup | None = setup
        self.transport: P2PTransport | None = None
        self.broadcast: BroadcastNode | None = None
        self.http: StatusHttpServer | None = None
        #: the /status document last served (its figures are refreshed on the tick only)
        self._status_doc: dict[str, Any] | None = None
        self._status_seq = 0  # the served document's serial (``status_seq``)
        self.history = StatusHistory()  # what the dashboard draws over time
        self.census: HolderCensus | None = None  # who holds which recent version
        self.multiaddrs: list[str] = []
        self.trainer_stats: dict[str, Any] = {}
        self._new_rollouts = asyncio.Event()
        self._records_soon = asyncio.Event()
        self._trainer_gauges: TrainerGauges | None = None
        self._version_tasks: dict[int, asyncio.Task[None]] = {}
        self.verifier: InProcessLogprobVerifier | None = None
        self._preload_tasks: set[asyncio.Task[None]] = set()
        self._seeders: dict[int, str] = {}
        #: running mean of publish call -> version held here (seconds; T_bcast's main part)
        self._hold_s: float | None = None
        #: set (and replaced) each time a version is held in full: lease requests waiting for one
        self._version_held = asyncio.Event()
        self.dialback: DialbackServer | None = None
        self._peer_ids: dict[str, str] = {}  # node fingerprint -> libp2p peer id (register, hb)
        self._upkeep: asyncio.Task[None] | None = None
        self._started_at = time.time()

    # --- life cycle ------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    @property
    def public_key(self) -> bytes:
        return self.identity.public_key

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def http_url(self) -> str:
        return self.http.url if self.http is not None else ""

    async def start(self) -> None:
        cfg = self.config
        db_path = cfg.db_path if cfg.db_path.is_absolute() else self.state_dir / cfg.db_path.name
        spec = model_spec(cfg)
        from policy.preflight import prepare

        task = make_task(cfg.task, seed=cfg.task_seed, format_reward=cfg.format_reward)
        try:  # the launcher already ran these checks; a service built directly runs them here
            setup = self.setup or prepare(
                spec,
                task=task,
                max_new_tokens=cfg.sampling.max_new_tokens,
                extra_stop_ids=cfg.sampling.stop_token_ids,
                template=cfg.prompt.template,
                system_prompt=cfg.prompt.system_prompt,
            )
        except ValueError:
            close = getattr(task, "close", None)
            if callable(close):
                close()
            raise
        self.setup = setup
        tokenizer = setup.tokenizer
        store = Store(db_path)
        verifier = InProcessLogprobVerifier(
            self._load_model,
            cfg.intake.tolerances,
            cache_size=cfg.staleness_bound + 1,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            pad_id=tokenizer.pad_token_id,
            z_max=cfg.intake.sampling_z_max,
            calibration=CalibrationSettings.from_intake(cfg.intake),
        )
        self.verifier = verifier
        self.core = Coordinator(
            cfg,
            store=store,
            task=task,
            tokenizer=tokenizer,
            prompts=setup.renderer,
            stop_token_ids=setup.stop_token_ids,
            verifier=verifier,
            publisher_key=self.identity.public_key,
            servable=self._holds,
            signer=self.identity,
        )
        await self.peer.start()
        rate = cfg.network.upload_rate_mb_s
        limiter = TokenBucket(rate * 1e6) if rate else None
        self.transport = P2PTransport(
            self.peer.p2p, upload_limiter=limiter, io_timeout=cfg.network.request_timeout_s
        )
        self.broadcast = BroadcastNode(
            self.transport,
            ChunkStore(self.state_dir / "checkpoints", keep_versions=cfg.staleness_bound + 1),
            DhtHolderDirectory(self.peer),
            self.identity.public_key,
        )
        await self.broadcast.start()
        self._resume_versions()
        await self._warm_verifier()
        await self.register_handlers(self.transport)
        # nodes measure whether they can be dialled by asking for a dial-back from here
        self.dialback = DialbackServer(self.transport, host=cfg.network.host)
        await self.dialback.start()
        self.multiaddrs = await self.peer.visible_maddrs()
        self.http = StatusHttpServer(
            cfg.network.http_host,
            cfg.network.http_port,
            core_registry=self.core.registry,
            history=self.history,
            node_pages=self._node_page_threadsafe(asyncio.get_running_loop()),
        )
        self.http.start()
        self.census = coordinator_census(
            store, self.broadcast.store, DhtHolderDirectory(self.peer), cfg.staleness_bound + 1
        )
        self.census.start()
        self._refresh_snapshot()
        self._upkeep = asyncio.create_task(self._upkeep_loop(), name="coordinator-upkeep")
        # written whole (renamed into place): launchers poll for it to exist and then parse it
        info = json.dumps(self.address_info(), indent=2)
        atomic_write_text(self.state_dir / "coordinator.json", info)
        log.info("coordinator up: %s key %s", self.multiaddrs[0], self.fingerprint)

    async def register_handlers(self, transport: Transport) -> None:
        """Serve the ``rswarm/*`` methods on ``transport``, each with the request size its
        message type can legitimately have (a control request is not buffered up to 16 MiB)."""
        handlers: dict[str, Callable[[str, bytes], Awaitable[bytes]]] = {
            rpc.REGISTER: self._on_register,
            rpc.HEARTBEAT: self._on_heartbeat,
            rpc.LEASE: self._on_lease,
            rpc.SUBMIT: self._on_submit,
            rpc.RELEASE: self._on_release,
            rpc.PUBLISH: self._on_publish,
            rpc.FETCH: self._on_fetch,
            rpc.STATUS: self._on_status,
        }
        limits = request_limits()
        for name, handler in handlers.items():
            await transport.register(name, _answering(handler), max_request_bytes=limits[name])

    def address_info(self) -> dict[str, Any]:
        """What nodes, trainers and ``swarm inspect`` need to reach this coordinator."""
        return {
            "multiaddrs": self.multiaddrs,
            "peer_id": self.peer_id,
            "fingerprint": self.fingerprint,
            "http_url": self.http_url,
        }

    async def stop(self) -> None:
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
        for task in [*self._version_tasks.values(), *self._preload_tasks]:
            task.cancel()
        if self.dialback is not None:
            with contextlib.suppress(Exception):
                await self.dialback.stop()
        if self.census is not None:
            await self.census.stop()
        if self.broadcast is not None:
            with contextlib.suppress(Exception):
                await self.broadcast.stop()
        if self.http is not None:
            self.http.stop()
        with contextlib.suppress(Exception):
            await self.peer.stop()
        if self.core is not None:
            self.core.close()

    # --- upkeep ----------------------------------------------------------------------------------
    async def _upkeep_loop(self) -> None:
        """Every TICK_S: the core's tick (expiries, replanning) and the /status snapshot; the DHT
        records every RECORD_TTL_S / 3, and at once after a publication (``_records_soon``).
        A publication does not move the tick: the figures it reads are per-lease averages with
        a short memory, and read right after every publication (versions come more often than
        once a second in the demos) they saw only the leases of mid-period, never the slower
        ones just after a version switch — the 1-node S = 4 plan over-stated the node by ~10 %
        (docs/capacity.md)."""
        last_records = 0.0
        next_tick = time.monotonic()
        while True:
            # Each chore in its own try: one failing must not starve the others.
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                try:
                    assert self.core is not None
                    self.core.tick()
                    self._refresh_snapshot()
                except Exception:  # upkeep must survive a bad tick; the error is logged in full
                    log.exception("coordinator upkeep failed; retrying next tick")
            if self._records_soon.is_set() or time.time() - last_records > RECORD_TTL_S / 3:
                self._records_soon.clear()
                try:
                    await self._publish_records()
                    last_records = time.time()
                except Exception as exc:  # DHT hiccup: retried on the next tick
                    log.warning("could not refresh DHT records: %s", exc)
            with contextlib.suppress(TimeoutError):
                wait = max(0.0, next_tick - time.monotonic())
                await asyncio.wait_for(self._records_soon.wait(), wait)

    async def _publish_records(self) -> None:
        assert self.core is not None
        await publish_coordinator_address(self.peer, self.identity, ttl=RECORD_TTL_S)
        latest = self.core.store.latest_version()
        if latest is not None:
            seeds = [self.peer_id] + ([self._seeders[latest]] if latest in self._seeders else [])
            await publish_policy_version(self.peer, self.identity, latest, seeds, ttl=RECORD_TTL_S)

    def _refresh_snapshot(self) -> None:
        if self.http is not None:
            status = self.status()
            self._serve_status(status)
            census = self.census
            self.history.record_tick(status, census.counts if census and census.taken_at else None)

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (also served over ``rswarm/status``)."""
        assert self.core is not None
        status = build_status(
            self.core,
            fingerprint=self.fingerprint,
            peer_id=self.peer_id,
            started_at=self._started_at,
            trainer_stats=self.trainer_stats,
            broadcast=self.broadcast,
            census=self.census,
        )
        status["versions_loaded"] = self.loaded_versions()  # ready for log-prob spot checks
        status["node_reachability"] = self.node_reachability(status.get("node_states") or {})
        if self.setup is not None:  # the trainer checks its positions against these
            status["longest_prompt_tokens"] = self.setup.report.longest_prompt
        return status

    def _node_page_threadsafe(
        self, loop: asyncio.AbstractEventLoop
    ) -> Callable[[int, int], dict[str, Any]]:
        """``/api/nodes`` for the HTTP threads: the page is built on the event loop (which owns
        the coordinator's state), the thread waits ``PAGE_TIMEOUT_S`` at most."""

        async def build(offset: int, limit: int) -> dict[str, Any]:
            assert self.core is not None
            return node_page(self.core, offset, limit, self.census)

        def page(offset: int, limit: int) -> dict[str, Any]:
            done = asyncio.run_coroutine_threadsafe(build(offset, limit), loop)
            try:
                return done.result(timeout=PAGE_TIMEOUT_S)
            except concurrent.futures.TimeoutError as exc:
                done.cancel()
                raise TimeoutError("node page") from exc

        return page

    def node_reachability(self, nodes: dict[str, Any]) -> dict[str, str]:
        """``{fingerprint: "public" | "private" | "unknown"}``, as measured by this coordinator's
        dial-back of each node (not as the node claims)."""
        out: dict[str, str] = {}
        for fp in nodes:
            peer_id = self._peer_ids.get(fp)
            found = self.dialback.reachability_of(peer_id) if self.dialback and peer_id else None
            out[fp] = found or "unknown"
        return out

    # --- handlers --------------------------------------------------------------------------------
    def _open(self, request: bytes, type_: type[M]) -> tuple[bytes, M]:
        assert self.core is not None
        env = decode(request, SignedEnvelope)
        return self.core.open(env, type_)

    async def _on_register(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, Register)
        if msg.advert.peer_id != caller:
            raise Rejection(ReasonCode.SCHEMA, "advert.peer_id is not the calling libp2p peer")
        ack = self.core.register(node_key, msg.advert)
        self._peer_ids[fingerprint_of(node_key)] = caller
        return encode(ack)

    async def _on_heartbeat(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, Heartbeat)
        ack = self.core.heartbeat(node_key, msg)
        self._peer_ids[fingerprint_of(node_key)] = caller
        return encode(ack)

    async def _on_lease(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, LeaseRequest)
        await self._until_leasable()
        return encode(self.core.request_lease(node_key, msg))

    async def _until_leasable(self) -> None:
        """While no version can be leased but one is on its way from the trainer, wait for it
        (up to ``LEASE_VERSION_WAIT_S``): with κ = 1 two versions can be published before the
        coordinator holds either, and the ``Standby`` a node would get then costs it a whole
        second of generation (at S = 1 one node lost 7–24 s of a 60 s demo run that way)."""
        assert self.core is not None
        deadline = time.monotonic() + LEASE_VERSION_WAIT_S
        while self.core.lease_version() is None and any(
            not t.done() for t in self._version_tasks.values()
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            held = self._version_held
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.wait(), left)

    async def _on_submit(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        env = decode(request, SignedEnvelope)
        try:
            node_key, msg = self.core.open(env, RolloutSubmission)
        except ProtocolError as exc:  # refused before the intake: still an intake rejection
            if exc.code is ReasonCode.REPLAYED:  # the same signed bytes again: same verdict
                stored = self.core.replayed_submission(env)
                if stored is not None:
                    return encode(stored)
            self.core.metrics.rejected.labels(reason=ReasonCode(exc.code).value).inc()
            raise
        pending = self._version_tasks.get(msg.policy_version)
        if pending is not None and not pending.done():  # spot checks need the weights here
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(pending), SPOT_CHECK_WAIT_S)
        verdict = await self.core.submit(node_key, msg)
        if not isinstance(verdict, Reject):
            self._new_rollouts.set()
        return encode(verdict)

    async def _on_release(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, ReleaseLease)
        prompts = self.core.release(node_key, msg.lease_id, msg.epoch, msg.reason)
        from protocol.messages import Ack

        return encode(Ack(ref=msg.lease_id, detail=f"{len(prompts)} prompts released"))

    def _show_published(self, version: int) -> None:
        """A new version is announced at once: the upkeep task refreshes the DHT records right
        away, and /status names it (``policy_version``) before the next tick. Only that field:
        the rest of the document, the capacity figures with it, stays on the tick's clock (see
        :meth:`_upkeep_loop`)."""
        self._records_soon.set()
        if self.http is not None and self._status_doc is not None:
            doc = dict(self._status_doc)  # a new mapping: the tick's history holds the old one
            current = doc.get("policy_version")
            doc["policy_version"] = version if current is None else max(int(current), version)
            self._serve_status(doc)

    def _serve_status(self, doc: dict[str, Any]) -> None:
        """Serve ``doc`` on ``/status`` under the next ``status_seq``: a tick's document and a
        publication's copy of it share their ``uptime_s``, so only the serial tells a reader (the
        dashboard, a test comparing the page with ``/status``) which one it holds."""
        assert self.http is not None
        self._status_seq += 1
        doc["status_seq"] = self._status_seq
        self._status_doc = doc
        self.http.set_status(doc)

    async def _on_status(self, caller: str, request: bytes) -> bytes:
        decode(request, StatusRequest)
        return encode(StatusResponse(status=wire_status(self.status())))


#: Room for a SignedEnvelope's own fields around its payload (keys, nonce, signature, tags).
ENVELOPE_OVERHEAD = 1024


def request_limits(limits: Limits = DEFAULT_LIMITS) -> dict[str, int]:
    """Largest request accepted per method: the frame limit of its payload type, plus the
    envelope around it (``rswarm/status`` is unsigned)."""
    signed: dict[str, type[msgspec.Struct]] = {
        rpc.REGISTER: Register,
        rpc.HEARTBEAT: Heartbeat,
        rpc.LEASE: LeaseRequest,
        rpc.SUBMIT: RolloutSubmission,
        rpc.RELEASE: ReleaseLease,
        rpc.PUBLISH: PublishVersion,
        rpc.FETCH: FetchRollouts,
    }
    out = {name: limits.max_frame(t) + ENVELOPE_OVERHEAD for name, t in signed.items()}
    out[rpc.STATUS] = limits.max_frame(StatusRequest)
    return out


def _answering(
    handler: Callable[[str, bytes], Awaitable[bytes]],
) -> Callable[[str, bytes], Awaitable[bytes]]:
    """Turn refusals into ``Reject`` answers (the caller learns the reason code)."""

    async def wrapped(caller: str, request: bytes) -> bytes:
        try:
            return await handler(caller, request)
        except ProtocolError as exc:  # includes Rejection
            retry = getattr(exc, "retry_after_s", None)
            return encode(
                Reject(ref="-", code=ReasonCode(exc.code), detail=exc.detail[:200],
                       retry_after_s=retry)
            )  # fmt: skip

    return wrapped
