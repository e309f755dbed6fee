"""The versions the coordinator holds, and the models its log-prob spot checks use.

:class:`VersionHolding` is a mixin of :class:`coordinator.service.CoordinatorService`, which sets
the state declared below in its ``__init__``. Every published version is downloaded in full from
the trainer (:meth:`VersionHolding._hold_version`, retried while the trainer starts seeding it);
from then on leases may name it, lease requests waiting for a version look again, and its
spot-check model is loaded in a worker thread (:meth:`VersionHolding._preload`). The time from the
publish call to holding the version is T_bcast's main part (:meth:`VersionHolding._update_t_bcast`,
docs/capacity.md).

A LoRA version (``Manifest.lora``) is scored on its adapter merged into a copy of the base model,
which is built once per process (:func:`_lora_base`) and must have the fingerprint the version
names; the merge is the node's ``"merged"`` one (:func:`policy.lora.merged_copy`), so an honest
node's log-probs agree as they do for full versions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.logprobs import InProcessLogprobVerifier, VerifierUnavailable
from coordinator.status import positive_of
from protocol.codec import decode
from protocol.messages import Manifest, SignedEnvelope
from swarm.broadcast import BroadcastNode

log = logging.getLogger(__name__)

VERSION_FETCH_TIMEOUT_S = 60.0
#: cap of the back-off while the trainer starts seeding a version just published
HOLD_RETRY_MAX_S = 0.25


class VersionHolding:
    """Versions held and spot-check models, as a mixin of
    :class:`~coordinator.service.CoordinatorService` (which sets every attribute below in its
    ``__init__``)."""

    config: CoordinatorConfig
    core: Coordinator | None
    broadcast: BroadcastNode | None
    verifier: InProcessLogprobVerifier | None
    trainer_stats: dict[str, Any]
    _version_tasks: dict[int, asyncio.Task[None]]
    _preload_tasks: set[asyncio.Task[None]]
    _seeders: dict[int, str]
    #: running mean of publish call -> version held here (seconds; T_bcast's main part)
    _hold_s: float | None
    #: set (and replaced) each time a version is held in full: lease requests waiting for one
    _version_held: asyncio.Event

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
        delay = 0.02
        while True:
            try:
                await self.broadcast.download(version, [seeder] if seeder else [])
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
            self._hold_s = elapsed if self._hold_s is None else 0.7 * self._hold_s + 0.3 * elapsed
            self._update_t_bcast()
        log.info("holding policy v%d (fetched in %.2fs)", version, elapsed)
        self._wake_lease_waiters()
        # Its own task: submissions waiting for this one (see _on_submit) need the weights on
        # disk, not the model built.
        task = asyncio.create_task(self._preload(version), name=f"preload-v{version}")
        self._preload_tasks.add(task)
        task.add_done_callback(self._preload_tasks.discard)
        for old in [v for v in self._version_tasks if v < version - self.config.staleness_bound]:
            self._version_tasks.pop(old, None)
            self._seeders.pop(old, None)

    def _wake_lease_waiters(self) -> None:
        """Lease requests waiting for a leasable version (:meth:`_until_leasable`) look again."""
        held, self._version_held = self._version_held, asyncio.Event()
        held.set()

    def _update_t_bcast(self) -> None:
        """T_bcast of the capacity rule (docs/capacity.md): the trainer's serialise-and-hash time
        of its last publication plus the running mean of publish call -> version held here
        (from then on leases name it; each node's own download and load are its d_i, and the
        time a node takes to finish its current lease is in the rule's spread of starts)."""
        assert self.core is not None
        prepare_s = positive_of(self.trainer_stats.get("publish_prepare_s")) or 0.0
        if self._hold_s is not None:
            self.core.t_bcast_s = prepare_s + self._hold_s

    def _holds(self, version: int) -> bool:
        """Every chunk of ``version`` is here: nodes can fetch it (leases name such versions)."""
        return self.broadcast is not None and self.broadcast.store.is_complete(version)

    # --- models for the log-prob spot check ------------------------------------------------------
    def loaded_versions(self) -> list[int]:
        """Versions whose model is ready for spot checks (in the verifier's cache)."""
        return sorted(self.verifier.cached_versions()) if self.verifier is not None else []

    async def _warm_verifier(self) -> None:
        """Before serving: import the model stack (seconds of GIL-bound work: transformers and
        the architecture's modules) and load the usable versions already held. Done lazily, the
        first spot check after a (re)start waited for it inside a submission, and the import in
        a worker thread starved the event loop, so every answer slowed down meanwhile."""
        if self.config.intake.spot_check_fraction <= 0:
            return
        assert self.broadcast is not None and self.core is not None
        await asyncio.to_thread(_import_model_stack, model_spec(self.config))
        for version in self.core.store.versions()[-(self.config.staleness_bound + 1) :]:
            if self.broadcast.store.is_complete(version):
                await self._preload(version)

    async def _preload(self, version: int) -> None:
        """Load the spot-check model of a held ``version`` into the verifier now, in a worker
        thread, so the first submission drawn for a spot check at that version does not wait."""
        if self.config.intake.spot_check_fraction <= 0 or self.verifier is None:
            return
        try:
            await asyncio.to_thread(self.verifier.preload, version)
        except Exception as exc:  # the spot check loads it itself (or is skipped, and counted)
            log.warning("could not preload policy v%d for spot checks: %s", version, exc)

    def _load_model(self, version: int) -> Any:
        """Model loader of the log-prob verifier: ``version`` from the weights in the local chunk
        store (runs in a worker thread)."""
        assert self.broadcast is not None
        from policy.model import build_model, load_weights
        from swarm.checkpoint_io import files_to_state_dict

        if not self.broadcast.store.is_complete(version):
            raise VerifierUnavailable(f"policy v{version} is not held by the coordinator")
        try:
            files = self.broadcast.store.load_files(version)
            entry = self.broadcast.store.manifest(version)
        except KeyError as exc:  # pruned between the check and the read
            raise VerifierUnavailable(f"policy v{version} is no longer held") from exc
        lora = entry[1].lora if entry is not None else None
        if lora is not None:
            from policy.lora import merged_copy

            fingerprint, base = _lora_base(model_spec(self.config))
            if fingerprint.split(":", 1)[-1] != lora.base_model:
                raise VerifierUnavailable(
                    f"policy v{version} is a LoRA adapter over base {lora.base_model[:16]}…, "
                    f"the coordinator's model_path is {fingerprint[:23]}…"
                )
            return merged_copy(base, files_to_state_dict(files), rank=lora.rank, alpha=lora.alpha)
        model = build_model(model_spec(self.config))
        load_weights(model, files_to_state_dict(files))
        return model


_BASES: dict[str | None, tuple[str, Any]] = {}
_BASES_LOCK = threading.Lock()


def _lora_base(spec: Any) -> tuple[str, Any]:
    """``(fingerprint, model)`` of the base model of ``spec``, built once per process (read only:
    each LoRA version scores on its own merged copy)."""
    from policy.lora import base_fingerprint
    from policy.model import build_model

    with _BASES_LOCK:
        if spec.path not in _BASES:
            _BASES[spec.path] = (base_fingerprint(spec), build_model(spec))
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
