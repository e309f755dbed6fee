"""The coordinator process: the :class:`~coordinator.core.Coordinator` on the network.

:class:`CoordinatorService` composes, in :meth:`CoordinatorService.start` (top to bottom), the
collaborators that each own their state and take what they use as constructor arguments:

* the core (:class:`~coordinator.core.Coordinator`) over the SQLite store, with the log-prob
  verifier whose models :class:`~coordinator.holding.SpotCheckModels` builds from the chunk store;
* a swarm peer (DHT bootstrap peer + libp2p handle), its transport, and a
  :class:`~swarm.broadcast.BroadcastNode` that downloads every published version (it signs the
  manifests the trainer proposes, the trainer seeds the chunks) so it can re-score log-probs and
  serve as a manifest source for nodes;
* :class:`~coordinator.holding.VersionHolder` (the versions held, T_bcast through
  :class:`~coordinator.holding.TBcastEstimate`, the spot-check models preloaded);
* the RPC handlers: :class:`~coordinator.node_rpc.NodeHandlers` (the nodes' methods),
  :class:`~coordinator.learner_link.LearnerLink` (the trainer's: publications and the rollout
  feed), :meth:`~coordinator.status_board.StatusBoard.on_status`;
* a read-only HTTP endpoint (:mod:`coordinator.http`): the dashboard, ``/status`` JSON
  (:class:`~coordinator.status_board.StatusBoard`), its history (:mod:`coordinator.history`) and
  ``/metrics``; a holder census of the recent versions (:mod:`coordinator.dissemination`);
* an upkeep task (:class:`~coordinator.upkeep.Upkeep`): lease expiry, re-planning, DHT records,
  the status snapshot.

Each part is stopped in the reverse order of its start (one exit stack), whatever step a start
got to. Every RPC answer is a protocol message; refusals are ``Reject(code, detail)``, never a
dropped stream, so a node always learns why.

The command line launcher is :mod:`coordinator.launch`, the status document
:mod:`coordinator.status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.dissemination import coordinator_census
from coordinator.history import StatusHistory
from coordinator.holding import SpotCheckModels, TBcastEstimate, VersionHolder, model_spec
from coordinator.http import StatusHttpServer
from coordinator.learner_link import LearnerLink
from coordinator.logprobs import InProcessLogprobVerifier
from coordinator.node_rpc import NodeHandlers
from coordinator.status_board import StatusBoard, node_pages_on
from coordinator.store import Store
from coordinator.tasks import make_task
from coordinator.upkeep import RECORD_TTL_S, TICK_S, Upkeep
from coordinator.verifier_pool import VerifierHandlers, VerifierPool
from policy.preflight import PolicySetup
from protocol import rpc
from protocol.codec import encode
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity, parse_fingerprint
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
    StatusRequest,
    VerifyTake,
    VerifyVerdict,
)
from swarm.adverts import swarm_validators
from swarm.broadcast import BroadcastNode
from swarm.chunks import ChunkStore
from swarm.dht import PeerConfig, SwarmPeer
from swarm.direct import settings_for
from swarm.files import atomic_write_text
from swarm.holders import DhtHolderDirectory
from swarm.ratelimit import TokenBucket
from swarm.reachability import DialbackServer
from swarm.records import publish_coordinator_address, publish_policy_version
from swarm.transport import P2PTransport, Transport

__all__ = ["TICK_S", "CoordinatorService", "register_handlers", "request_limits", "rpc_table"]

log = logging.getLogger(__name__)

#: An RPC handler: ``(calling peer id, request bytes) -> answer bytes``.
Handler = Callable[[str, bytes], Awaitable[bytes]]


class CoordinatorService:
    """Coordinator core + libp2p RPC + checkpoint holder + HTTP status (see the module)."""

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
        #: tokenizer, prompt renderer and stop set, checked at start (policy.preflight); the
        #: launcher passes what it already checked, else :meth:`start` checks
        self.setup: PolicySetup | None = setup
        self.history = StatusHistory()  # what the dashboard draws over time
        self.http: StatusHttpServer | None = None
        self.multiaddrs: list[str] = []
        self._started_at = time.time()
        #: what :meth:`start` started, stopped by :meth:`stop` in reverse order
        self._running = contextlib.AsyncExitStack()

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
        keep = cfg.staleness_bound + 1
        running = self._running
        setup = self.setup = self._preflight()
        # the core, its store and its verifier (whose models come from the chunk store)
        db_path = cfg.db_path if cfg.db_path.is_absolute() else self.state_dir / cfg.db_path.name
        store = Store(db_path)
        chunks = ChunkStore(self.state_dir / "checkpoints", keep_versions=keep)
        models = SpotCheckModels(chunks, model_spec(cfg))
        verifier = InProcessLogprobVerifier.for_config(
            cfg, models.load, pad_id=setup.tokenizer.pad_token_id
        )
        # with verifier processes, re-scores are jobs any of them (and this process) may take
        vcfg = cfg.verification
        pool = (
            VerifierPool(
                verifier if vcfg.local_verifier else None,
                job_timeout_s=vcfg.job_timeout_s,
                attempts=vcfg.job_attempts,
            )
            if vcfg.verifier_keys
            else None
        )
        core = Coordinator(
            cfg,
            store=store,
            task=make_task(cfg.task, seed=cfg.task_seed, format_reward=cfg.format_reward),
            tokenizer=setup.tokenizer,
            prompts=setup.renderer,
            stop_token_ids=setup.stop_token_ids,
            verifier=pool if pool is not None else verifier,
            publisher_key=self.identity.public_key,
            servable=chunks.is_complete,  # leases name versions nodes can fetch from here
            signer=self.identity,
        )
        running.callback(core.close)
        if pool is not None:
            pool.start()
            running.push_async_callback(pool.stop)
        # the network: peer, transport, the broadcast node that fills the chunk store
        running.push_async_callback(_quietly(self.peer.stop))
        await self.peer.start()
        rate = cfg.network.upload_rate_mb_s
        transport = P2PTransport(
            self.peer.p2p,
            upload_limiter=TokenBucket(rate * 1e6) if rate else None,
            io_timeout=cfg.network.request_timeout_s,
        )
        broadcast = BroadcastNode(
            transport, chunks, DhtHolderDirectory(self.peer), self.identity.public_key,
            direct=settings_for([f"/ip4/{cfg.network.host}/tcp/0"], cfg.network.direct_port),
        )  # fmt: skip
        running.push_async_callback(_quietly(broadcast.stop))
        await broadcast.start()
        # the versions held (fetched from the trainer, T_bcast, spot-check models preloaded)

        def plan_t_bcast(seconds: float) -> None:
            core.t_bcast_s = seconds

        t_bcast = TBcastEstimate(apply=plan_t_bcast)
        holder = VersionHolder(
            chunks=chunks,
            downloader=broadcast,
            published=store,
            models=verifier,
            staleness_bound=cfg.staleness_bound,
            # its own re-scores only: with local_verifier off the verifier processes hold the
            # models, and loading each version here would cost memory and CPU for nothing
            spot_checks=cfg.intake.spot_check_fraction > 0
            and (pool is None or pool.local is not None),
            lease_version=core.lease_version,
            on_held=t_bcast.held,
            warm_up=models.warm_up,
        )
        running.callback(holder.stop)
        holder.resume()
        await holder.warm()
        # nodes measure whether they can be dialled by asking for a dial-back from here
        dialback = DialbackServer(transport, host=cfg.network.host)
        running.push_async_callback(_quietly(dialback.stop))
        await dialback.start()
        rollouts_stored = asyncio.Event()  # set by a submission, waited on by the learner's fetch
        nodes = NodeHandlers(core, versions=holder, on_rollouts=rollouts_stored.set)
        running.push_async_callback(nodes.stop)
        nodes.resume_checks()  # leases acknowledged before a restart, their re-score not done

        def reachability(fingerprint: str) -> str | None:
            peer_id = nodes.peer_of(fingerprint)
            return dialback.reachability_of(peer_id) if peer_id else None

        # observability: the holder census, the HTTP server, the status document
        census = coordinator_census(store, chunks, DhtHolderDirectory(self.peer), keep)
        self.http = http = StatusHttpServer(
            cfg.network.http_host,
            cfg.network.http_port,
            core_registry=core.registry,
            history=self.history,
            node_pages=node_pages_on(asyncio.get_running_loop(), core, census),
        )
        http.start()
        running.callback(http.stop)
        census.start()
        running.push_async_callback(census.stop)
        board = StatusBoard(
            core,
            fingerprint=self.fingerprint,
            peer_id=self.peer_id,
            history=self.history,
            serve=http.set_status,
            loaded_versions=holder.loaded_versions,
            reachability=reachability,
            broadcast=broadcast,
            census=census,
            longest_prompt=setup.report.longest_prompt,
            started_at=self._started_at,
        )
        board.refresh()
        # upkeep: the tick (expiries, re-planning, the status snapshot) and the DHT records

        def tick() -> None:
            core.tick()
            board.refresh()

        upkeep = Upkeep(
            tick=tick,
            publish_records=lambda: _publish_records(
                self.peer, self.identity, store.latest_version(), holder.seeder_of
            ),
        )

        def published(version: int) -> None:  # named at once: in the DHT and on /status
            upkeep.records_soon()
            board.show_published(version)

        learner = LearnerLink(
            core,
            signer=self.identity,
            trainer_fingerprint=self.trainer_fingerprint,
            holder=holder,
            t_bcast=t_bcast,
            rollouts_stored=rollouts_stored,
            on_report=board.trainer_report,
            on_published=published,
            check_version=models.check_lora_base,
        )
        handlers = rpc_table(nodes, learner, board)
        if pool is not None:
            verifiers = VerifierHandlers(
                pool, vcfg.verifier_keys, replay=core.replay, clock=core.clock
            )
            handlers |= {rpc.VERIFY_TAKE: verifiers.on_take, rpc.VERIFY_DONE: verifiers.on_done}
        await register_handlers(transport, handlers)
        self.multiaddrs = await self.peer.visible_maddrs()
        upkeep.start()
        running.push_async_callback(upkeep.stop)
        # written whole (renamed into place): launchers poll for it to exist and then parse it
        info = json.dumps(self.address_info(), indent=2)
        atomic_write_text(self.state_dir / "coordinator.json", info)
        log.info("coordinator up: %s key %s", self.multiaddrs[0], self.fingerprint)

    def _preflight(self) -> PolicySetup:
        """The tokenizer, prompt renderer and stop set: the launcher's (already checked), else
        checked here (:func:`policy.preflight.prepare`)."""
        if self.setup is not None:
            return self.setup
        from policy.preflight import prepare

        cfg = self.config
        task = make_task(cfg.task, seed=cfg.task_seed, format_reward=cfg.format_reward)
        try:
            return prepare(
                model_spec(cfg),
                task=task,
                max_new_tokens=cfg.sampling.max_new_tokens,
                extra_stop_ids=cfg.sampling.stop_token_ids,
                template=cfg.prompt.template,
                system_prompt=cfg.prompt.system_prompt,
            )
        finally:
            close = getattr(task, "close", None)
            if callable(close):
                close()

    def address_info(self) -> dict[str, Any]:
        """What nodes, trainers and ``swarm inspect`` need to reach this coordinator."""
        return {
            "multiaddrs": self.multiaddrs,
            "peer_id": self.peer_id,
            "fingerprint": self.fingerprint,
            "http_url": self.http_url,
        }

    async def stop(self) -> None:
        """Stop what :meth:`start` started, last started first (whatever step it got to)."""
        await self._running.aclose()


async def _publish_records(
    peer: SwarmPeer, identity: Identity, latest: int | None, seeder_of: Callable[[int], str | None]
) -> None:
    """The coordinator's address and the latest version with its seeds (us, and the trainer that
    published it while we know it) in the DHT, for ``RECORD_TTL_S``."""
    await publish_coordinator_address(peer, identity, ttl=RECORD_TTL_S)
    if latest is not None:
        trainer = seeder_of(latest)
        seeds = [peer.peer_id] + ([trainer] if trainer is not None else [])
        await publish_policy_version(peer, identity, latest, seeds, ttl=RECORD_TTL_S)


def _quietly(stop: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``stop`` with its failure ignored (a part that failed to start may fail to stop)."""

    async def run() -> None:
        with contextlib.suppress(Exception):
            await stop()

    return run


def rpc_table(nodes: NodeHandlers, learner: LearnerLink, board: StatusBoard) -> dict[str, Handler]:
    """The ``rswarm/*`` methods and the collaborator that answers each."""
    return {
        rpc.REGISTER: nodes.on_register,
        rpc.HEARTBEAT: nodes.on_heartbeat,
        rpc.LEASE: nodes.on_lease,
        rpc.SUBMIT: nodes.on_submit,
        rpc.RELEASE: nodes.on_release,
        rpc.PUBLISH: learner.on_publish,
        rpc.FETCH: learner.on_fetch,
        rpc.STATUS: board.on_status,
    }


async def register_handlers(transport: Transport, handlers: Mapping[str, Handler]) -> None:
    """Serve ``handlers`` on ``transport``, each with the request size its message type can
    legitimately have (a control request is not buffered up to 16 MiB)."""
    limits = request_limits()
    for name, handler in handlers.items():
        await transport.register(name, _answering(handler), max_request_bytes=limits[name])


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
    signed |= {rpc.VERIFY_TAKE: VerifyTake, rpc.VERIFY_DONE: VerifyVerdict}
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
