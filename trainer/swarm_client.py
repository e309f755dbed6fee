"""The trainer's side of the swarm protocol: where rollouts come from and versions go.

* :class:`CoordinatorSource` — the recipe's :class:`~trainer.sources.RolloutSource`: long-polls the
  coordinator's ``rswarm/fetch`` (signed by the trainer's publisher key) and reports the learner's
  figures back with each poll, so ``/status`` and ``swarm inspect`` show them.
* :class:`SwarmPublisher` — the recipe's :class:`~trainer.sources.Publisher`: splits the weights
  into safetensors chunks, has the coordinator sign the manifest (``rswarm/publish``), then seeds
  the chunks itself through the peer-assisted broadcast (no full copy goes through the coordinator
  first; the coordinator is just one more receiver). A ``version_not_newer`` refusal becomes
  :class:`~trainer.sources.VersionNotNewer`. The weights go out in ``publish_dtype``, each
  version after the first as a delta against the previous one when that pays
  (:mod:`swarm.publication`).

The process that runs them (``swarm trainer run``) is :mod:`trainer.main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    FetchRollouts,
    LoraInfo,
    Manifest,
    ManifestResponse,
    PublishVersion,
    Reject,
    RolloutBatch,
    StatusRequest,
    StatusResponse,
    logprobs_array,
    tokens_array,
)
from swarm.errors import TransportError
from swarm.transport import Transport
from trainer.batch import Rollout
from trainer.sources import VersionNotNewer

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0
RETRY_MAX_S = 10.0
PUBLISH_ATTEMPTS = 8
MANIFEST_TTL_S = 7 * 24 * 3600.0
#: refusals of a delta version that a keyframe of the same weights avoids
DELTA_REFUSALS = frozenset({ReasonCode.DELTA_BASE_MISSING, ReasonCode.DELTA_INVALID})


class CoordinatorError(RuntimeError):
    """The coordinator refused a trainer request (the message says why)."""


class PublicationStopped(CoordinatorError):
    """The trainer is stopping: a request that failed is not retried (the version stays
    unrecorded here; a restart reconciles with the coordinator, :meth:`Trainer.sync_published`)."""


class CoordinatorSource:
    """Accepted rollouts from the coordinator, in arrival order."""

    def __init__(
        self,
        transport: Transport,
        coordinator_peer: str,
        identity: Identity,
        *,
        stats: Mapping[str, Any] | None = None,
        wait_s: float = FETCH_WAIT_S,
    ) -> None:
        self.transport = transport
        self.coordinator_peer = coordinator_peer
        self.identity = identity
        self.wait_s = wait_s
        #: figures sent with every poll (the run loop updates this dict in place)
        self.stats: dict[str, Any] = dict(stats or {})
        #: rollouts the learner is blocked waiting for (:meth:`set_wanting`; 0: it is not)
        self.wanting = 0
        self.received = 0
        self.failures = 0

    def set_wanting(self, n: int) -> None:
        """The learner is blocked for ``n`` more rollouts (0: it is not); every fetch from now on
        reports it as ``rollouts_wanted`` (the coordinator's backlog bound reads it)."""
        self.wanting = max(0, int(n))

    def _stats(self) -> dict[str, Any]:
        return _wire_stats({**self.stats, "rollouts_wanted": self.wanting})

    async def fetch(
        self, max_items: int, after: int, min_version: int | None = None
    ) -> list[Rollout] | None:
        req = FetchRollouts(
            after_seq=after,
            max_rollouts=max(1, min(max_items, 4096)),
            min_policy_version=min_version,
            wait_s=self.wait_s,
            trainer_stats=self._stats(),
        )
        try:
            raw = await self.transport.call(
                self.coordinator_peer,
                rpc.FETCH,
                encode(seal(self.identity, req, now=time.time())),
                timeout=self.wait_s + rpc.DEFAULT_TIMEOUTS[rpc.FETCH],
            )
        except TransportError as exc:  # the coordinator restarts or the network hiccups
            self.failures += 1
            delay = min(RETRY_MAX_S, 0.2 * 2**self.failures) * (0.5 + random.random())
            log.warning("fetching rollouts failed (%s); retrying in %.1f s", exc, delay)
            await asyncio.sleep(delay)
            return []
        self.failures = 0
        msg = decode(raw)
        if isinstance(msg, Reject):
            raise CoordinatorError(f"coordinator refused fetch: {msg.code}: {msg.detail}")
        if not isinstance(msg, RolloutBatch):
            raise CoordinatorError(f"unexpected answer to fetch: {type(msg).__name__}")
        out = [
            Rollout(
                group_id=f"{r.lease_id}/{r.prompt_id}",
                prompt_ids=tokens_array(r.prompt_token_ids).tolist(),
                completion_ids=tokens_array(r.completion_token_ids).tolist(),
                behaviour_logprobs=logprobs_array(r.behaviour_logprobs).tolist(),
                policy_version=r.policy_version,
                reward=r.reward,
                seq=r.seq,
            )
            for r in msg.rollouts
        ]
        self.received += len(out)
        return out

    async def report(self, timeout: float = rpc.DEFAULT_TIMEOUTS[rpc.FETCH]) -> None:
        """Send the current figures without taking rollouts (a fetch past any seq, no wait);
        gives up silently after ``timeout`` seconds (a coordinator that is gone)."""
        req = FetchRollouts(
            after_seq=2**62, max_rollouts=1, min_policy_version=None, wait_s=0.0,
            trainer_stats=self._stats(),
        )  # fmt: skip
        with contextlib.suppress(TransportError):
            await self.transport.call(
                self.coordinator_peer, rpc.FETCH, encode(seal(self.identity, req, now=time.time())),
                timeout=timeout,
            )  # fmt: skip


class SwarmPublisher:
    """Publishes versions: coordinator signs the manifest, this peer seeds the chunks.

    The weights go out in ``publish_dtype``; each version after the first is built as a delta
    against the previous one when that pays (:class:`swarm.publication.VersionBuilder`)."""

    def __init__(
        self,
        transport: Transport,
        broadcast: Any,
        coordinator_peer: str,
        identity: Identity,
        *,
        model_config_hash: str,
        tokenizer_hash: str,
        chunk_size: int,
        publish_dtype: str = "bfloat16",
        keyframe_every: int = 0,
    ) -> None:
        from swarm.publication import PublishPolicy, VersionBuilder

        self.transport = transport
        self.broadcast = broadcast
        self.coordinator_peer = coordinator_peer
        self.identity = identity
        self.publish_dtype = publish_dtype
        self.builder = VersionBuilder(
            model_config_hash=model_config_hash,
            tokenizer_hash=tokenizer_hash,
            chunk_size=chunk_size,
            policy=PublishPolicy(keyframe_every=keyframe_every),
        )
        self.last_version: int | None = None
        #: seconds the last publication spent serialising and hashing before the coordinator saw it
        self.last_prepare_s: float | None = None
        self._keyframe_next = False
        #: set by :meth:`stop`: failed requests are not retried, back-off waits end at once
        self.stopping = asyncio.Event()

    def stop(self) -> None:
        """The trainer is stopping: a request in flight may still be answered, none is retried."""
        self.stopping.set()

    async def _retry_after(self, delay: float, what: str) -> None:
        """Wait ``delay`` before retrying ``what``; raises :class:`PublicationStopped` at once if
        the trainer is stopping (the wait races the stop, it does not poll)."""
        if not self.stopping.is_set():
            waiter = asyncio.ensure_future(self.stopping.wait())
            try:
                await asyncio.wait([waiter], timeout=delay)
            finally:
                waiter.cancel()
        if self.stopping.is_set():
            raise PublicationStopped(f"stopping: {what} abandoned (not retried)")

    def request_keyframe(self) -> None:
        """Publish the next version as a full keyframe (no delta), whatever the policy says."""
        self._keyframe_next = True

    async def publish(self, version: int, state_dict: Mapping[str, Any]) -> None:
        from swarm.checkpoint_io import cast_floats, state_dict_to_files
        from swarm.publication import held_base

        # Casting, serialising, hashing and diffing are CPU work: off the event loop, which
        # meanwhile keeps fetching rollouts and serving chunks of the versions already published.
        t0 = time.monotonic()
        prepare_s = 0.0
        files = await asyncio.to_thread(
            lambda: state_dict_to_files(cast_floats(state_dict, self.publish_dtype))
        )
        store = self.broadcast.store
        last = self.last_version if self.last_version is not None else store.latest()
        lora = _lora_info(state_dict)  # a LoRA adapter: its own file, never a delta
        if lora is not None:
            from policy.lora import ADAPTER_FILE

            files = {ADAPTER_FILE: b"".join(files.values())}
        base = None if lora is not None else await asyncio.to_thread(held_base, store, last)
        prepare_s += time.monotonic() - t0
        for attempt in ("as planned", "as a keyframe"):
            t_build = time.monotonic()
            now = time.time()
            built = await asyncio.to_thread(
                self.builder.build,
                files,
                version=version,
                parent_version=self.last_version,
                base=base,
                created_at=now,
                expires_at=now + MANIFEST_TTL_S,
                force_keyframe=self._keyframe_next or attempt == "as a keyframe",
                lora=lora,
            )
            prepare_s += time.monotonic() - t_build
            self.last_prepare_s = prepare_s
            t_rpc = time.monotonic()
            msg = await self._propose(version, built.manifest)
            if not (isinstance(msg, Reject) and msg.code in DELTA_REFUSALS):
                break
            # the coordinator does not hold our base (its state was reset, or it pruned it)
            log.warning(
                "coordinator refused v%d as a delta (%s: %s); publishing a keyframe",
                version,
                msg.code,
                msg.detail,
            )
        if isinstance(msg, Reject) and msg.code is ReasonCode.VERSION_NOT_NEWER:
            latest = await self.latest_version()
            if latest is not None and latest >= version:
                raise VersionNotNewer(version, latest)
        if isinstance(msg, Reject):
            raise CoordinatorError(f"coordinator refused v{version}: {msg.code}: {msg.detail}")
        if not isinstance(msg, ManifestResponse) or msg.manifest is None:
            raise CoordinatorError(f"unexpected answer to publish: {type(msg).__name__}")
        t_seed = time.monotonic()
        signed: Manifest = await self.broadcast.seed_version(msg.manifest, built.chunks)
        self.last_version = signed.version
        self._keyframe_next = False
        if signed.lora is not None:
            what = f"a LoRA adapter (rank {signed.lora.rank}) over {signed.lora.base_model[:12]}"
        elif signed.delta is not None:
            what = f"a delta of {built.delta_bytes} bytes against v{signed.delta.base_version}"
        else:
            what = f"a keyframe ({built.reason})"
        log.info(
            "published policy v%d as %s; full checkpoint %d bytes, %d chunks in all (cast+"
            "serialise+hash+diff %.2f s, coordinator %.2f s, seed %.2f s)", version, what,
            built.full_bytes, len(built.chunks), prepare_s, t_seed - t_rpc,
            time.monotonic() - t_seed,
        )  # fmt: skip

    async def _propose(self, version: int, manifest: Manifest) -> Any:
        """``rswarm/publish``: the coordinator's decoded answer (signed manifest or Reject)."""
        req = PublishVersion(manifest=encode(manifest), source=self.transport.peer_id)
        for attempt in range(PUBLISH_ATTEMPTS):
            try:  # publishing is idempotent on the coordinator: a retry gets the same manifest
                raw = await self.transport.call(
                    self.coordinator_peer,
                    rpc.PUBLISH,
                    encode(seal(self.identity, req, now=time.time())),
                    timeout=rpc.DEFAULT_TIMEOUTS[rpc.PUBLISH],
                )
                break
            except TransportError as exc:
                if attempt == PUBLISH_ATTEMPTS - 1:
                    raise CoordinatorError(
                        f"could not publish v{version} after {PUBLISH_ATTEMPTS} attempts: {exc}"
                    ) from exc
                delay = min(RETRY_MAX_S, 0.2 * 2**attempt) * (0.5 + random.random())
                log.warning("publishing v%d failed (%s); retrying in %.1f s", version, exc, delay)
                await self._retry_after(delay, f"publishing v{version}")
        return decode(raw)

    async def latest_version(self) -> int | None:
        """The newest version the coordinator holds (``rswarm/status``); None if it has none."""
        status = await self.status()
        latest = status.get("policy_version")
        if latest is not None and (not isinstance(latest, int) or isinstance(latest, bool)):
            raise CoordinatorError(f"coordinator status has a bad policy_version: {latest!r}")
        return latest

    async def status(self) -> dict[str, Any]:
        """The coordinator's status document (``rswarm/status``), retried like a publication."""
        for attempt in range(PUBLISH_ATTEMPTS):
            try:
                raw = await self.transport.call(
                    self.coordinator_peer,
                    rpc.STATUS,
                    encode(StatusRequest()),
                    timeout=rpc.DEFAULT_TIMEOUTS[rpc.STATUS],
                )
                break
            except TransportError as exc:
                if attempt == PUBLISH_ATTEMPTS - 1:
                    raise CoordinatorError(
                        f"could not read the coordinator's latest version: {exc}"
                    ) from exc
                delay = min(RETRY_MAX_S, 0.2 * 2**attempt) * (0.5 + random.random())
                log.warning("status request failed (%s); retrying in %.1f s", exc, delay)
                await self._retry_after(delay, "the status request")
        msg = decode(raw)
        if not isinstance(msg, StatusResponse):
            raise CoordinatorError(f"unexpected answer to status: {type(msg).__name__}")
        return dict(msg.status)


def _lora_info(state_dict: Mapping[str, Any]) -> LoraInfo | None:
    """The manifest's ``lora`` of a :class:`policy.lora.AdapterState` (None: full weights)."""
    from policy.lora import AdapterState

    if not isinstance(state_dict, AdapterState):
        return None
    return LoraInfo(
        base_model=digest_hex(state_dict.base_model),
        rank=state_dict.rank,
        alpha=float(state_dict.alpha),
    )


def _wire_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out[key] = {str(k): v for k, v in value.items()}
        elif isinstance(value, float) and value != value:
            out[key] = None
        elif value is None or isinstance(value, bool | int | float | str):
            out[key] = value
    return out


def digest_hex(fingerprint: str) -> str:
    """``sha256:<hex>`` → ``<hex>`` (manifests carry bare hex digests)."""
    return fingerprint.split(":", 1)[-1]
