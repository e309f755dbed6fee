"""The versions the coordinator holds, and the models its log-prob spot checks use.

Three collaborators of :class:`coordinator.service.CoordinatorService`, each owning its state:

* :class:`VersionHolder` downloads every published version in full from the trainer
  (:meth:`VersionHolder.hold`, retried while the trainer starts seeding it); from then on leases
  may name it, lease requests waiting for a version look again
  (:meth:`VersionHolder.until_leasable`), and its spot-check model is loaded in a worker thread.
* :class:`TBcastEstimate`: the time from the publish call to holding the version is T_bcast's
  main part (docs/capacity.md); the trainer's serialise-and-hash time is the rest.
* :class:`SpotCheckModels` builds the model of a held version from the local chunk store (the
  log-prob verifier's loader).

A LoRA version (``Manifest.lora``) is scored on its adapter merged into a copy of the base model,
which is built once per process (:func:`_lora_base`) and must have the fingerprint the version
names; the merge is the node's ``"merged"`` one (:func:`policy.lora.merged_copy`), so an honest
node's log-probs agree as they do for full versions. A LoRA version over another base is refused
at publication (:meth:`SpotCheckModels.check_lora_base`): the coordinator could not score it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.logprobs import VerifierUnavailable
from protocol.codec import decode
from protocol.errors import ReasonCode
from protocol.messages import Manifest, SignedEnvelope
from swarm.chunks import ChunkStore

log = logging.getLogger(__name__)

VERSION_FETCH_TIMEOUT_S = 60.0
#: cap of the back-off while the trainer starts seeding a version just published
HOLD_RETRY_MAX_S = 0.25


class PublishedVersions(Protocol):
    """The durable record of published versions (:class:`coordinator.store.Store`)."""

    def versions(self) -> list[int]: ...

    def get_version(self, version: int) -> bytes | None: ...


class Downloader(Protocol):
    """Fetches a version's full checkpoint into the chunk store
    (:class:`swarm.broadcast.BroadcastNode`)."""

    async def download(self, version: int | None, seeds: Sequence[str]) -> Any: ...


class ModelCache(Protocol):
    """The log-prob verifier's model cache
    (:class:`coordinator.logprobs.InProcessLogprobVerifier`)."""

    def preload(self, version: int) -> None: ...

    def cached_versions(self) -> list[int]: ...


class TBcastEstimate:
    """T_bcast of the capacity rule (docs/capacity.md): the trainer's serialise-and-hash time of
    its last publication plus the running mean of publish call -> version held here (from then on
    leases name it; each node's own download and load are its d_i, and the time a node takes to
    finish its current lease is in the rule's spread of starts). ``apply`` receives each new
    estimate (the service hands it to the core's capacity plan)."""

    def __init__(self, apply: Callable[[float], None]) -> None:
        self._apply = apply
        #: running mean of publish call -> version held here (seconds; T_bcast's main part)
        self.hold_s: float | None = None
        #: the trainer's serialise-and-hash time of its last publication (seconds; 0 unknown)
        self.prepare_s = 0.0

    def held(self, elapsed: float) -> None:
        """A published version was held ``elapsed`` seconds after its publish call."""
        self.hold_s = elapsed if self.hold_s is None else 0.7 * self.hold_s + 0.3 * elapsed
        self._update()

    def prepared(self, prepare_s: float | None) -> None:
        """The trainer's report of its publication time (None: not in the report)."""
        self.prepare_s = prepare_s or 0.0
        self._update()

    def _update(self) -> None:
        if self.hold_s is not None:
            self._apply(self.prepare_s + self.hold_s)


class VersionHolder:
    """Every published version held in full here, and the tasks that fetch them.

    ``chunks`` is the chunk store ``downloader`` fills (and nodes fetch from); ``published`` the
    durable record of versions; ``models`` the verifier's cache, preloaded with each held version
    when ``spot_checks``; ``lease_version`` names the version new leases would name now (None:
    none); ``on_held`` receives the publish -> held time of each version fetched after a
    publication (not after a restart)."""

    def __init__(
        self,
        *,
        chunks: ChunkStore,
        downloader: Downloader,
        published: PublishedVersions,
        models: ModelCache | None,
        staleness_bound: int,
        spot_checks: bool,
        lease_version: Callable[[], int | None],
        on_held: Callable[[float], None],
        warm_up: Callable[[], None] = lambda: None,
        fetch_timeout_s: float = VERSION_FETCH_TIMEOUT_S,
    ) -> None:
        self.chunks = chunks
        self._downloader = downloader
        self._published = published
        self._models = models
        self._keep = staleness_bound + 1
        self._staleness_bound = staleness_bound
        self._spot_checks = spot_checks and models is not None
        self._lease_version = lease_version
        self._on_held = on_held
        self._warm_up = warm_up
        self._fetch_timeout_s = fetch_timeout_s
        self._fetches: dict[int, asyncio.Task[None]] = {}
        self._preloads: set[asyncio.Task[None]] = set()
        self._seeders: dict[int, str] = {}
        #: set (and replaced) each time a version is held in full: lease requests waiting for one
        self._version_held = asyncio.Event()

    # --- holding -------------------------------------------------------------------------------
    def holds(self, version: int) -> bool:
        """Every chunk of ``version`` is here: nodes can fetch it (leases name such versions)."""
        return self.chunks.is_complete(version)

    def seeder_of(self, version: int) -> str | None:
        """The trainer peer that seeds ``version`` (None: unknown, e.g. after a restart)."""
        return self._seeders.get(version)

    def hold(self, env: SignedEnvelope, manifest: Manifest, seeder: str) -> None:
        """A version was just published: serve its signed manifest at once (nodes ask us first)
        and fetch its chunks from ``seeder`` (the trainer's peer id)."""
        self.chunks.put_manifest(env, manifest)
        self._seeders[manifest.version] = seeder
        self._fetch(manifest.version, seeder)

    def resume(self) -> None:
        """After a restart: finish fetching the usable versions not yet held in full."""
        for version in self._published.versions()[-self._keep :]:
            if self.chunks.is_complete(version):
                continue
            raw = self._published.get_version(version)
            if raw is None:
                continue
            env = decode(raw, SignedEnvelope)
            self.chunks.put_manifest(env, decode(env.payload, Manifest))
            self._fetch(version, None)

    def fetching(self, version: int) -> bool:
        """``version`` is being fetched now."""
        task = self._fetches.get(version)
        return task is not None and not task.done()

    async def wait_held(self, version: int, timeout: float) -> None:
        """Wait up to ``timeout`` for the fetch of ``version`` under way (if any) to end."""
        pending = self._fetches.get(version)
        if pending is not None and not pending.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(pending), timeout)

    async def until_leasable(self, wait_s: float) -> None:
        """While no version can be leased but one is on its way from the trainer, wait for it
        (up to ``wait_s``): with κ = 1 two versions can be published before the coordinator
        holds either, and the ``Standby`` a node would get then costs it a whole second of
        generation (at S = 1 one node lost 7–24 s of a 60 s demo run that way)."""
        deadline = time.monotonic() + wait_s
        while self._lease_version() is None and any(not t.done() for t in self._fetches.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            held = self._version_held
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.wait(), left)

    def stop(self) -> None:
        """Cancel the fetches and preloads under way."""
        for task in [*self._fetches.values(), *self._preloads]:
            task.cancel()

    def _fetch(self, version: int, seeder: str | None) -> None:
        self._fetches[version] = asyncio.create_task(
            self._hold_version(version, seeder), name=f"hold-v{version}"
        )

    async def _hold_version(self, version: int, seeder: str | None) -> None:
        """Download a published version (retrying while the trainer starts seeding it).

        ``seeder`` is the trainer's peer id; None (after a restart) means: find holders in the DHT.
        """
        t0 = time.monotonic()
        deadline = t0 + self._fetch_timeout_s
        delay = 0.02
        while True:
            try:
                await self._downloader.download(version, [seeder] if seeder else [])
                break
            except Exception as exc:  # the seed may not serve it yet; retried until the deadline
                if time.monotonic() > deadline:
                    log.error("could not fetch v%d from the trainer: %s", version, exc)
                    self._wake_lease_waiters()  # no use waiting for this one
                    return
                await asyncio.sleep(delay)
                # The trainer starts seeding right after our answer: a short cap, so the back-off
                # does not add to the time the version takes to reach the leases.
                delay = min(delay * 2, HOLD_RETRY_MAX_S)
        elapsed = time.monotonic() - t0
        if seeder is not None:  # a resumed fetch after a restart says nothing about T_bcast
            self._on_held(elapsed)
        log.info("holding policy v%d (fetched in %.2fs)", version, elapsed)
        self._wake_lease_waiters()
        # Its own task: submissions waiting for this one (see wait_held) need the weights on
        # disk, not the model built.
        task = asyncio.create_task(self._preload(version), name=f"preload-v{version}")
        self._preloads.add(task)
        task.add_done_callback(self._preloads.discard)
        for old in [v for v in self._fetches if v < version - self._staleness_bound]:
            self._fetches.pop(old, None)
            self._seeders.pop(old, None)

    def _wake_lease_waiters(self) -> None:
        """Lease requests waiting for a leasable version (:meth:`until_leasable`) look again."""
        held, self._version_held = self._version_held, asyncio.Event()
        held.set()

    # --- models for the log-prob spot check ----------------------------------------------------
    def loaded_versions(self) -> list[int]:
        """Versions whose model is ready for spot checks (in the verifier's cache)."""
        return sorted(self._models.cached_versions()) if self._models is not None else []

    async def warm(self) -> None:
        """Before serving: import the model stack (seconds of GIL-bound work: transformers and
        the architecture's modules) and load the usable versions already held. Done lazily, the
        first spot check after a (re)start waited for it inside a submission, and the import in
        a worker thread starved the event loop, so every answer slowed down meanwhile."""
        if not self._spot_checks:
            return
        await asyncio.to_thread(self._warm_up)
        for version in self._published.versions()[-self._keep :]:
            if self.chunks.is_complete(version):
                await self._preload(version)

    async def _preload(self, version: int) -> None:
        """Load the spot-check model of a held ``version`` into the verifier now, in a worker
        thread, so the first submission drawn for a spot check at that version does not wait."""
        if not self._spot_checks or self._models is None:
            return
        try:
            await asyncio.to_thread(self._models.preload, version)
        except Exception as exc:  # the spot check loads it itself (or is skipped, and counted)
            log.warning("could not preload policy v%d for spot checks: %s", version, exc)


class SpotCheckModels:
    """The model of each held version, built from the weights in ``chunks`` (the log-prob
    verifier's loader; :meth:`load` runs in a worker thread). ``spec`` is the coordinator's
    model (:func:`model_spec`): a full version's architecture, a LoRA version's base."""

    def __init__(self, chunks: ChunkStore, spec: Any) -> None:
        self._chunks = chunks
        self._spec = spec

    def load(self, version: int) -> Any:
        """The model of ``version`` (VerifierUnavailable: not held, or a LoRA over another base)."""
        from policy.model import build_model, load_weights
        from swarm.checkpoint_io import files_to_state_dict

        if not self._chunks.is_complete(version):
            raise VerifierUnavailable(f"policy v{version} is not held by the coordinator")
        try:
            files = self._chunks.load_files(version)
            entry = self._chunks.manifest(version)
        except KeyError as exc:  # pruned between the check and the read
            raise VerifierUnavailable(f"policy v{version} is no longer held") from exc
        lora = entry[1].lora if entry is not None else None
        if lora is not None:
            from policy.lora import merged_copy

            fingerprint, base = _lora_base(self._spec)
            if fingerprint.split(":", 1)[-1] != lora.base_model:
                raise VerifierUnavailable(
                    f"policy v{version} is a LoRA adapter over base {lora.base_model[:16]}…, "
                    f"the coordinator's model_path is {fingerprint[:23]}…"
                )
            return merged_copy(base, files_to_state_dict(files), rank=lora.rank, alpha=lora.alpha)
        model = build_model(self._spec)
        load_weights(model, files_to_state_dict(files))
        return model

    def warm_up(self) -> None:
        """Import what building and scoring the model needs, without building it."""
        _import_model_stack(self._spec)

    def check_lora_base(self, manifest: Manifest) -> None:
        """Refuse (:class:`Rejection`, one line) a LoRA version whose base is not the
        coordinator's model: it could not spot-check its log-probs. Blocking the first time (the
        base's fingerprint hashes the model directory): call it from a worker thread."""
        lora = manifest.lora
        if lora is None:
            return
        ours = _base_fingerprint(self._spec)
        if ours.split(":", 1)[-1] != lora.base_model:
            raise Rejection(
                ReasonCode.LORA_BASE_MISSING,
                f"v{manifest.version} is a LoRA adapter over base {lora.base_model[:16]}…, the "
                f"coordinator's model_path is {ours[:23]}… (it could not spot-check it): start "
                "the trainer and the coordinator on the same base model",
            )


_BASES: dict[str | None, tuple[str, Any]] = {}
_FINGERPRINTS: dict[str | None, str] = {}
_BASES_LOCK = threading.Lock()


def _base_fingerprint(spec: Any) -> str:
    """The fingerprint of the base model of ``spec``, computed once per process."""
    from policy.lora import base_fingerprint

    with _BASES_LOCK:
        if spec.path not in _FINGERPRINTS:
            _FINGERPRINTS[spec.path] = base_fingerprint(spec)
        return _FINGERPRINTS[spec.path]


def _lora_base(spec: Any) -> tuple[str, Any]:
    """``(fingerprint, model)`` of the base model of ``spec``, built once per process (read only:
    each LoRA version scores on its own merged copy)."""
    from policy.model import build_model

    fingerprint = _base_fingerprint(spec)
    with _BASES_LOCK:
        if spec.path not in _BASES:
            _BASES[spec.path] = (fingerprint, build_model(spec))
        return _BASES[spec.path]


def _import_model_stack(spec: Any) -> None:
    """Import what building and scoring the model of ``spec`` needs, without building it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import policy.scoring  # noqa: F401  (the re-scoring code and its torch imports)
    from policy.model import load_config

    MODEL_FOR_CAUSAL_LM_MAPPING[type(load_config(spec))]  # imports the architecture's modules


def model_spec(cfg: CoordinatorConfig) -> Any:
    from policy.model import ModelSpec

    return ModelSpec(path=cfg.model_path)
