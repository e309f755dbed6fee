"""The coordinator process: the :class:`~coordinator.core.Coordinator` on the network.

:class:`CoordinatorService` owns

* a swarm peer (DHT bootstrap peer + libp2p handle) and the RPC handlers of :mod:`protocol.rpc`;
* a :class:`~swarm.broadcast.BroadcastNode` that downloads every published version (it signs the
  manifests the trainer proposes, the trainer seeds the chunks) so it can re-score log-probs and
  serve as a manifest source for nodes;
* a read-only HTTP endpoint (:mod:`coordinator.http`): ``/status`` JSON and ``/metrics``;
* an upkeep task: lease expiry, re-planning, DHT records, the status snapshot.

Every RPC answer is a protocol message; refusals are ``Reject(code, detail)``, never a dropped
stream, so a node always learns why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client import Gauge

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.http import StatusHttpServer
from coordinator.logprobs import InProcessLogprobVerifier, VerifierUnavailable
from coordinator.store import Store
from coordinator.tasks import make_task
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import open_envelope
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity, fingerprint_of, parse_fingerprint
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.manifest import check_manifest, sign_manifest
from protocol.messages import (
    FetchRollouts,
    Heartbeat,
    LeaseRequest,
    Manifest,
    ManifestResponse,
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
from swarm.holders import DhtHolderDirectory
from swarm.ratelimit import TokenBucket
from swarm.records import publish_coordinator_address, publish_policy_version
from swarm.transport import P2PTransport, Transport

log = logging.getLogger(__name__)
M = TypeVar("M", bound=msgspec.Struct)

TICK_S = 1.0
RECORD_TTL_S = 60.0
FETCH_WAIT_CAP_S = 30.0
VERSION_FETCH_TIMEOUT_S = 60.0
#: a submission waits at most this long for the coordinator to hold its version (spot checks)
SPOT_CHECK_WAIT_S = 5.0


class CoordinatorService:
    """Coordinator core + libp2p RPC + checkpoint holder + HTTP status."""

    def __init__(self, config: CoordinatorConfig, state_dir: Path) -> None:
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
        self.transport: P2PTransport | None = None
        self.broadcast: BroadcastNode | None = None
        self.http: StatusHttpServer | None = None
        self.multiaddrs: list[str] = []
        self.trainer_stats: dict[str, Any] = {}
        self._new_rollouts = asyncio.Event()
        self._records_soon = asyncio.Event()
        self._trainer_gauge: Gauge | None = None
        self._staleness_gauge: Gauge | None = None
        self._version_tasks: dict[int, asyncio.Task[None]] = {}
        self._seeders: dict[int, str] = {}
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
        spec = _model_spec(cfg)
        from node.model import load_tokenizer

        tokenizer = load_tokenizer(spec)
        store = Store(db_path)
        verifier = InProcessLogprobVerifier(
            self._load_model,
            cfg.intake.tolerances,
            cache_size=cfg.staleness_bound + 1,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            pad_id=tokenizer.pad_token_id,
        )
        self.core = Coordinator(
            cfg,
            store=store,
            task=make_task(cfg.task, seed=cfg.task_seed),
            tokenizer=tokenizer,
            verifier=verifier,
            publisher_key=self.identity.public_key,
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
        await self.register_handlers(self.transport)
        self.multiaddrs = await self.peer.visible_maddrs()
        self.http = StatusHttpServer(
            cfg.network.http_host, cfg.network.http_port, core_registry=self.core.registry
        )
        self.http.start()
        self._refresh_snapshot()
        self._upkeep = asyncio.create_task(self._upkeep_loop(), name="coordinator-upkeep")
        (self.state_dir / "coordinator.json").write_text(json.dumps(self.address_info(), indent=2))
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
        for task in self._version_tasks.values():
            task.cancel()
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
        last_records = 0.0
        while True:
            # Each chore in its own try: one failing must not starve the others.
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
                await asyncio.wait_for(self._records_soon.wait(), TICK_S)

    async def _publish_records(self) -> None:
        assert self.core is not None
        await publish_coordinator_address(self.peer, self.identity, ttl=RECORD_TTL_S)
        latest = self.core.store.latest_version()
        if latest is not None:
            seeds = [self.peer_id] + ([self._seeders[latest]] if latest in self._seeders else [])
            await publish_policy_version(self.peer, self.identity, latest, seeds, ttl=RECORD_TTL_S)

    def _refresh_snapshot(self) -> None:
        if self.http is not None:
            self.http.set_status(self.status())

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (also served over ``rswarm/status``)."""
        assert self.core is not None
        snap = self.core.status()
        now = time.time()
        nodes = self.core.store.nodes()
        # one query each for the whole swarm: this runs every tick and on every status request
        alive = {n.node_key for n in self.core.alive_nodes()}
        banned = self.core.store.banned_keys(self.core.clock())
        states: dict[str, str] = {}
        last_seen: dict[str, float] = {}
        tokens_per_s: dict[str, float | None] = {}
        leases_done: dict[str, int] = {}
        for n in nodes:
            tokens_per_s[n.fingerprint] = n.tokens_per_s
            leases_done[n.fingerprint] = n.leases_completed
            if n.node_key in banned:
                states[n.fingerprint] = "banned"
            elif n.node_key not in alive:
                states[n.fingerprint] = "gone"
            else:
                states[n.fingerprint] = "active" if self.core.is_active(n.node_key) else "standby"
            last_seen[n.fingerprint] = round(now - n.last_seen, 1)
        rejected = _counter_by_label(self.core.metrics.rejected, "reason")
        plan = self.core.plan
        snap.update(
            {
                "coordinator_fingerprint": self.fingerprint,
                "peer_id": self.peer_id,
                "uptime_s": round(now - self._started_at, 1),
                "node_states": states,
                "node_last_seen_s": last_seen,
                "node_tokens_per_s": tokens_per_s,
                "node_leases_completed": leases_done,
                "rejected_by_reason": rejected,
                "queue_depth": self.core.store.rollout_count()
                - int(self.trainer_stats.get("rollout_cursor", 0) or 0),
                "plan_available_rollouts_per_s": plan.available if plan else None,
                "plan_meets_rule": plan.meets_rule if plan else None,
                "versions_held": self.broadcast.store.versions() if self.broadcast else [],
            }
        )
        for key, value in self.trainer_stats.items():
            snap[f"trainer_{key}"] = value
        finite: dict[str, Any] = _finite(snap)
        return finite

    # --- handlers --------------------------------------------------------------------------------
    def _open(self, request: bytes, type_: type[M]) -> tuple[bytes, M]:
        assert self.core is not None
        env = decode(request, SignedEnvelope)
        return self.core.open(env, type_)

    def _open_trainer(self, request: bytes, type_: type[M]) -> M:
        env = decode(request, SignedEnvelope)
        assert self.core is not None
        # Who signed is checked before the signature: any other signer is refused without
        # costing a verification or a slot in the replay window.
        if self.trainer_fingerprint is None:
            raise Rejection(
                ReasonCode.UNKNOWN_NODE,
                "no trainer key configured: set network.trainer_key (or --trainer-key)",
            )
        if fingerprint_of(env.signer) != self.trainer_fingerprint:
            raise Rejection(ReasonCode.UNKNOWN_NODE, "signer is not the configured trainer key")
        return open_envelope(env, type_, now=time.time(), replay=self.core.replay)

    async def _on_register(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, Register)
        if msg.advert.peer_id != caller:
            raise Rejection(ReasonCode.SCHEMA, "advert.peer_id is not the calling libp2p peer")
        return encode(self.core.register(node_key, msg.advert))

    async def _on_heartbeat(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, Heartbeat)
        return encode(self.core.heartbeat(node_key, msg))

    async def _on_lease(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        node_key, msg = self._open(request, LeaseRequest)
        return encode(self.core.request_lease(node_key, msg))

    async def _on_submit(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        try:
            node_key, msg = self._open(request, RolloutSubmission)
        except ProtocolError as exc:  # refused before the intake: still an intake rejection
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
        prompts = self.core.release(node_key, msg.lease_id, msg.epoch)
        from protocol.messages import Ack

        return encode(Ack(ref=msg.lease_id, detail=f"{len(prompts)} prompts released"))

    async def _on_publish(self, caller: str, request: bytes) -> bytes:
        """Sign the trainer's manifest, record it, and fetch the chunks from the trainer."""
        assert self.core is not None and self.broadcast is not None
        msg = self._open_trainer(request, PublishVersion)
        manifest = decode(msg.manifest, Manifest)
        check_manifest(manifest, now=time.time())
        stored = self.core.store.get_version(manifest.version)
        if stored is not None:  # a retry whose first answer was lost: same bytes, same answer
            stored_env = decode(stored, SignedEnvelope)
            if decode(stored_env.payload, Manifest).root_hash == manifest.root_hash:
                return encode(ManifestResponse(manifest=stored_env))
        env = sign_manifest(manifest, self.identity, time.time())
        self.core.publish_version(env)
        # Serve the signed manifest at once (nodes ask us first); chunks follow from the trainer.
        self.broadcast.store.put_manifest(env, manifest)
        self._seeders[manifest.version] = caller
        self._version_tasks[manifest.version] = asyncio.create_task(
            self._hold_version(manifest.version, caller), name=f"hold-v{manifest.version}"
        )
        self._records_soon.set()  # the upkeep task refreshes the DHT records right away
        return encode(ManifestResponse(manifest=env))

    def _resume_versions(self) -> None:
        """After a restart: finish fetching the usable versions not yet held in full."""
        assert self.broadcast is not None and self.core is not None
        for version in self.core.store.versions()[-(self.config.staleness_bound + 1) :]:
            if self.broadcast.store.is_complete(version):
                continue
            raw = self.core.store.get_version(version)
            if raw is None:
                continue
            env = decode(raw, SignedEnvelope)
            self.broadcast.store.put_manifest(env, decode(env.payload, Manifest))
            self._version_tasks[version] = asyncio.create_task(
                self._hold_version(version, None), name=f"hold-v{version}"
            )

    async def _hold_version(self, version: int, seeder: str | None) -> None:
        """Download a published version (retrying while the trainer starts seeding it).

        ``seeder`` is the trainer's peer id; None (after a restart) means: find holders in the DHT.
        """
        assert self.broadcast is not None and self.core is not None
        t0 = time.monotonic()
        deadline = t0 + VERSION_FETCH_TIMEOUT_S
        delay = 0.05
        while True:
            try:
                await self.broadcast.download(version, [seeder] if seeder else [])
                break
            except Exception as exc:  # the seed may not serve it yet; retried until the deadline
                if time.monotonic() > deadline:
                    log.error("could not fetch v%d from the trainer: %s", version, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        elapsed = time.monotonic() - t0
        # T_bcast estimate for the capacity rule: a running mean of what a fetch takes here.
        self.core.t_bcast_s = 0.7 * self.core.t_bcast_s + 0.3 * elapsed
        log.info("holding policy v%d (fetched in %.2fs)", version, elapsed)
        for old in [v for v in self._version_tasks if v < version - self.config.staleness_bound]:
            self._version_tasks.pop(old, None)
            self._seeders.pop(old, None)

    def _load_model(self, version: int) -> Any:
        """Model loader of the log-prob verifier: weights of ``version`` from the local store."""
        assert self.broadcast is not None
        from node.model import build_model, load_weights
        from swarm.checkpoint_io import files_to_state_dict

        if not self.broadcast.store.is_complete(version):
            raise VerifierUnavailable(f"policy v{version} is not held by the coordinator")
        try:
            files = self.broadcast.store.load_files(version)
        except KeyError as exc:  # pruned between the check and the read
            raise VerifierUnavailable(f"policy v{version} is no longer held") from exc
        model = build_model(_model_spec(self.config))
        load_weights(model, files_to_state_dict(files))
        return model

    async def _on_fetch(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        msg = self._open_trainer(request, FetchRollouts)
        if msg.trainer_stats:
            self.trainer_stats = dict(msg.trainer_stats)
            step_time = self.trainer_stats.get("step_time_s")
            if isinstance(step_time, int | float) and step_time > 0:  # measured T_train
                self.core.t_train_s = float(step_time)
            self._export_trainer_gauges()
        deadline = time.monotonic() + min(msg.wait_s, FETCH_WAIT_CAP_S)
        while True:
            self._new_rollouts.clear()
            batch = self.core.fetch_rollouts(
                msg.after_seq, msg.max_rollouts, msg.min_policy_version
            )
            left = deadline - time.monotonic()
            if batch.rollouts or left <= 0:
                return encode(batch)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_rollouts.wait(), left)

    def _export_trainer_gauges(self) -> None:
        """Learner figures on /metrics: one gauge per scalar, the staleness histogram by label."""
        assert self.core is not None
        if self._trainer_gauge is None:
            self._trainer_gauge = Gauge(
                "swarm_trainer", "Learner figures reported with each fetch (docs/operations.md)",
                ["figure"], registry=self.core.registry,
            )  # fmt: skip
            self._staleness_gauge = Gauge(
                "swarm_trainer_staleness_rollouts",
                "Rollouts of the learner's last step by staleness (versions behind)",
                ["staleness"], registry=self.core.registry,
            )  # fmt: skip
        for key, value in self.trainer_stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self._trainer_gauge.labels(figure=key).set(value)
        hist = self.trainer_stats.get("staleness_hist")
        if isinstance(hist, dict) and self._staleness_gauge is not None:
            self._staleness_gauge.clear()
            for k, v in hist.items():
                if isinstance(v, int | float):
                    self._staleness_gauge.labels(staleness=str(k)).set(v)

    async def _on_status(self, caller: str, request: bytes) -> bytes:
        decode(request, StatusRequest)
        return encode(StatusResponse(status=_wire_status(self.status())))


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


def _model_spec(cfg: CoordinatorConfig) -> Any:
    from node.model import ModelSpec

    return ModelSpec(path=cfg.model_path)


def _counter_by_label(counter: Any, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and label in sample.labels:
                out[sample.labels[label]] = sample.value
    return out


def _wire_status(status: dict[str, Any]) -> dict[str, Any]:
    """Fit the status document into StatusResponse's bounded shape (depth <= 2, scalars)."""
    out: dict[str, Any] = {}
    for key, value in status.items():
        if isinstance(value, dict):
            out[key] = {str(k): _scalar(v) for k, v in list(value.items())[:256]}
        elif isinstance(value, list | tuple):
            out[key] = [_scalar(v) for v in list(value)[:256]]
        else:
            out[key] = _scalar(value)
    return out


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, float) and not math.isfinite(value):  # NaN/inf: not on the wire
            return None
        return value[:1000] if isinstance(value, str) else value
    return str(value)[:1000]


def launch_from_cli(
    *,
    config: Path | None,
    host: str | None,
    port: int | None,
    http_port: int | None,
    state_dir: Path | None,
    trainer_key: str | None = None,
) -> int:
    """``swarm coordinator launch``: run until SIGINT/SIGTERM.

    Exit 0 clean, 2 bad input (config, flags, state dir, key file), 1 runtime failure (a port
    already in use, the peer failed to start). Every error is one ``error:`` line on stderr.
    """
    import signal

    from coordinator.errors import ConfigError
    from protocol.errors import KeyFileError
    from swarm.cli import install_fork_signal_reset
    from swarm.errors import SwarmError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = _launch_config(config, host=host, port=port, http_port=http_port,
                             trainer_key=trainer_key)  # fmt: skip
    except ConfigError as exc:
        _cli_error(str(exc))
        return 2
    net = cfg.network
    for what, flag, bind_host, bind_port in (
        ("libp2p", "--port", net.host, net.port),
        ("/status", "--http-port", net.http_host, net.http_port),
    ):
        problem = _cannot_bind(bind_host, bind_port)
        if problem is not None:
            in_use, reason = problem
            if in_use:
                _cli_error(
                    f"{what} port {bind_port} on {bind_host} is already in use (another "
                    f"coordinator?); stop that process or pick another {flag} (0 = any free port)"
                )
                return 1
            _cli_error(f"cannot listen for {what} on {bind_host}:{bind_port}: {reason}")
            return 2
    state = Path(state_dir or "coordinator-data")
    try:
        _check_writable(state)
        lock = _lock_state_dir(state)  # held (open) until this function returns
        if isinstance(lock, str):
            _cli_error(
                f"state dir {state} is in use by another running coordinator ({lock}); stop it "
                "or pass another --state-dir"
            )
            return 1
        service = CoordinatorService(cfg, state)
    except KeyFileError as exc:
        _cli_error(str(exc))
        return 2
    except OSError as exc:
        if isinstance(exc, FileExistsError | NotADirectoryError):
            reason = "a file is in the way of the directory"
        else:
            reason = str(exc.strerror or exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(state) else ""
        _cli_error(f"state dir {state} is not usable: {reason}{where}; pass a writable --state-dir")
        return 2
    except ValueError as exc:
        _cli_error(str(exc))
        return 2
    import torch

    torch.set_num_threads(1)
    install_fork_signal_reset()  # the DHT process forks after the signal handlers are set

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await service.start()
        except Exception as exc:  # whatever failed, stop what did start so the process can exit
            if isinstance(exc, SwarmError | OSError):
                message = str(exc)
            else:
                log.exception("coordinator failed to start")
                message = f"{type(exc).__name__}: {exc}"
            await service.stop()
            _cli_error(f"coordinator failed to start: {message}")
            return 1
        for maddr in service.multiaddrs:
            print(f"multiaddr: {maddr}", flush=True)
        print(f"coordinator key: {service.fingerprint}", flush=True)
        print(f"status: {service.http_url}/status  metrics: {service.http_url}/metrics", flush=True)
        await stop.wait()
        log.info("shutting down")
        await service.stop()
        return 0

    return asyncio.run(main())


def _cli_error(message: str) -> None:
    import sys

    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _launch_config(
    config: Path | None,
    *,
    host: str | None,
    port: int | None,
    http_port: int | None,
    trainer_key: str | None,
) -> CoordinatorConfig:
    """The config file (or defaults) with the flags applied; :class:`ConfigError` names the flag."""
    import ipaddress

    from pydantic import ValidationError

    from coordinator.config import NetworkSection, load_config, parse_config
    from coordinator.errors import ConfigError

    cfg = load_config(config) if config is not None else parse_config({})
    flags = {"host": host, "port": port, "http_port": http_port, "trainer_key": trainer_key}
    overrides = {k: v for k, v in flags.items() if v is not None}

    def name(key: str) -> str:
        if key in overrides:
            return f"--{key.replace('_', '-')} {overrides[key]}"
        return f"{config}: network.{key}"

    try:
        net = NetworkSection.model_validate({**cfg.network.model_dump(), **overrides})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else "network"
        raise ConfigError(f"{name(key)}: {first['msg'].removeprefix('Value error, ')}") from exc
    try:
        ipaddress.IPv4Address(net.host)
    except ValueError as exc:
        raise ConfigError(
            f"{name('host')}: not an IPv4 address; use e.g. 127.0.0.1, or 0.0.0.0 for all "
            "interfaces"
        ) from exc
    if net.trainer_key is not None:
        try:
            parse_fingerprint(net.trainer_key)
        except ValueError as exc:
            raise ConfigError(f"{name('trainer_key')}: {exc}") from exc
    source = str(config) if config is not None else "defaults"
    model_dir = None if cfg.model_path is None else Path(cfg.model_path).expanduser()
    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{source}: model_path {cfg.model_path!r} is not a local HF model directory (no "
            "config.json); fix the path or unset it for the embedded default"
        )
    try:
        task = make_task(cfg.task, seed=cfg.task_seed)
    except OSError as exc:
        raise ConfigError(
            f"{source}: task {cfg.task!r}: cannot read {exc.filename or 'the file'}: "
            f"{exc.strerror or exc}"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"{source}: task: {exc}") from exc
    close = getattr(task, "close", None)
    if callable(close):
        close()
    return cfg.model_copy(update={"network": net})


def _cannot_bind(host: str, port: int) -> tuple[bool, str] | None:
    """None if ``host:port`` can be listened on now, else (address in use?, reason).

    A plain bind without SO_REUSEPORT: libp2p sets that option, so a second coordinator on the
    same port would otherwise start "successfully" and share the port with the first one.
    """
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return False, f"cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            sock.bind(address)
            sock.listen(1)
        except OverflowError as exc:
            return False, str(exc)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE, exc.strerror or str(exc)
    return None


def _lock_state_dir(state: Path) -> Any:
    """An exclusive lock on ``state/coordinator.lock`` (the open file), or who holds it (str).

    Two coordinators on one state dir would share the SQLite state, the keys and the libp2p
    identity; nothing else stops the second one from starting.
    """
    import fcntl
    import os

    fh = open(state / "coordinator.lock", "a+")  # noqa: SIM115 (held for the process's life)
    try:
        # a POSIX record lock: held by this process only (a forked child does not inherit it)
        # and released when it exits, however it exits
        fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip()
        fh.close()
        return f"pid {holder}" if holder.isdigit() else "lock file held"
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _check_writable(state: Path) -> None:
    """Create ``state`` and write a probe file in it; raises OSError when that fails."""
    import os

    state.mkdir(parents=True, exist_ok=True)
    probe = state / f".write-test-{os.getpid()}"
    probe.write_bytes(b"ok")
    probe.unlink()


def _finite(value: Any) -> Any:
    """Replace NaN/inf anywhere in a status document with None (JSON and the wire refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
