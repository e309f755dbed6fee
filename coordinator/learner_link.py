"""The trainer's side of the coordinator service: publications, the rollout feed, its figures.

:class:`LearnerLink` owns the learner's handlers and the trainer's gauges; a waiting fetch wakes
on the event the node handlers set when a submission stores rollouts. Only the configured trainer
key may call them (:meth:`LearnerLink._open_trainer`, checked before the signature).
``rswarm/publish`` refuses a LoRA version over another base than the coordinator's (the
coordinator could not spot-check it), signs the trainer's manifest, records it and hands it to
the version holder (:class:`coordinator.holding.VersionHolder`); ``rswarm/fetch`` long-polls
accepted rollouts (at most ``FETCH_WAIT_CAP_S``) and takes the learner's figures that ride on
it: T_train and its variability, B, κ for the capacity rule, and the step/cursor pairs of the
receipt log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.holding import TBcastEstimate
from coordinator.status import TrainerGauges, count_of, positive_of
from protocol.codec import decode, encode
from protocol.envelope import open_envelope
from protocol.errors import ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.manifest import check_manifest, sign_manifest
from protocol.messages import (
    FetchRollouts,
    Manifest,
    ManifestResponse,
    PublishVersion,
    SignedEnvelope,
)

M = TypeVar("M", bound=msgspec.Struct)

FETCH_WAIT_CAP_S = 30.0
#: ``after_seq`` at or above this: a trainer's report-only fetch (past any seq), no position
REPORT_AFTER_SEQ = 2**62
#: a learner batch or κ above this in the trainer's report is not believed
MAX_LEARNER_BATCH = 1 << 24


class VersionSink(Protocol):
    """Where a signed publication goes (:meth:`coordinator.holding.VersionHolder.hold`)."""

    def hold(self, env: SignedEnvelope, manifest: Manifest, seeder: str) -> None: ...


class LearnerLink:
    """The trainer's handlers (``rswarm/publish``, ``rswarm/fetch``).

    ``core`` records versions, serves rollouts and takes the learner's figures; ``signer`` (the
    coordinator key) signs manifests; ``trainer_fingerprint`` is the only key allowed to call
    (None: no trainer configured, every call refused); ``holder`` fetches each published version;
    ``t_bcast`` takes the trainer's publication time; ``rollouts_stored`` is set when a
    submission stored rollouts (a waiting fetch looks again); ``on_report`` takes each report of
    the trainer (the figures riding on a fetch: /status and its history show them);
    ``on_published`` is told each new version (the service refreshes /status and the DHT);
    ``check_version`` refuses a manifest the coordinator cannot serve (blocking, run in a worker
    thread, LoRA versions only); ``clock`` is Unix time."""

    def __init__(
        self,
        core: Coordinator,
        *,
        signer: Identity,
        trainer_fingerprint: str | None,
        holder: VersionSink,
        t_bcast: TBcastEstimate,
        rollouts_stored: asyncio.Event,
        on_report: Callable[[dict[str, Any]], None],
        on_published: Callable[[int], None],
        check_version: Callable[[Manifest], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._core = core
        self._signer = signer
        self._trainer_fingerprint = trainer_fingerprint
        self._holder = holder
        self._t_bcast = t_bcast
        self._on_report = on_report
        self._on_published = on_published
        self._check_version = check_version
        self._clock = clock
        self._gauges: TrainerGauges | None = None
        self._rollouts_stored = rollouts_stored

    def _open_trainer(self, request: bytes, type_: type[M]) -> M:
        env = decode(request, SignedEnvelope)
        # Who signed is checked before the signature: any other signer is refused without
        # costing a verification or a slot in the replay window.
        if self._trainer_fingerprint is None:
            raise Rejection(
                ReasonCode.UNKNOWN_NODE,
                "no trainer key configured: set network.trainer_key (or --trainer-key)",
            )
        if fingerprint_of(env.signer) != self._trainer_fingerprint:
            raise Rejection(ReasonCode.UNKNOWN_NODE, "signer is not the configured trainer key")
        return open_envelope(env, type_, now=self._clock(), replay=self._core.replay)

    async def on_publish(self, caller: str, request: bytes) -> bytes:
        """Sign the trainer's manifest, record it, and fetch the chunks from the trainer."""
        msg = self._open_trainer(request, PublishVersion)
        manifest = decode(msg.manifest, Manifest)
        check_manifest(manifest, now=self._clock())
        stored = self._core.store.get_version(manifest.version)
        if stored is not None:  # a retry whose first answer was lost: same bytes, same answer
            stored_env = decode(stored, SignedEnvelope)
            if decode(stored_env.payload, Manifest).root_hash == manifest.root_hash:
                return encode(ManifestResponse(manifest=stored_env))
        if manifest.lora is not None and self._check_version is not None:
            await asyncio.to_thread(self._check_version, manifest)
        env = sign_manifest(manifest, self._signer, self._clock())
        self._core.publish_version(env)
        # Serve the signed manifest at once (nodes ask us first); chunks follow from the trainer.
        self._holder.hold(env, manifest, caller)
        self._on_published(manifest.version)
        return encode(ManifestResponse(manifest=env))

    async def on_fetch(self, caller: str, request: bytes) -> bytes:
        msg = self._open_trainer(request, FetchRollouts)
        if msg.trainer_stats:
            stats = dict(msg.trainer_stats)
            self._on_report(stats)
            self._learner_figures(stats)
            # receipts (ledger): which learner step consumed which rollouts, the last step's time
            step_s = positive_of(stats.get("step_time_s")) or 0.0
            step, cursor = stats.get("step"), stats.get("rollout_cursor")
            if count_of(step) > 0:
                self._core.learner_report(count_of(step), count_of(cursor), step_s)
            # a learner blocked on an empty queue says so (the backlog bound must not stand
            # nodes by then); report() calls (after_seq past any seq) carry no position
            if "rollouts_wanted" in stats and msg.after_seq < REPORT_AFTER_SEQ:
                self._core.learner_waiting(
                    msg.after_seq,
                    count_of(stats.get("rollouts_wanted")),
                    _staleness(stats.get("max_staleness")),
                )
            self._export_trainer_gauges(stats)
        deadline = time.monotonic() + min(msg.wait_s, FETCH_WAIT_CAP_S)
        while True:
            self._rollouts_stored.clear()
            batch = self._core.fetch_rollouts(
                msg.after_seq, msg.max_rollouts, msg.min_policy_version
            )
            left = deadline - time.monotonic()
            if batch.rollouts or left <= 0:
                return encode(batch)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rollouts_stored.wait(), left)

    def _learner_figures(self, stats: dict[str, Any]) -> None:
        """The capacity rule's learner inputs, as the trainer measured them: T_train (its smoothed
        step time; the last step's from an older trainer), B, κ, and its publication time."""
        core = self._core
        t_train = positive_of(stats.get("t_train_s", stats.get("step_time_s")))
        if t_train is not None:
            core.t_train_s = t_train
        cv = stats.get("t_train_cv")
        if isinstance(cv, int | float) and not isinstance(cv, bool) and 0 <= cv < 10:
            core.t_train_cv = float(cv)
        batch, kappa = _count(stats.get("batch_rollouts")), _count(stats.get("kappa"))
        if batch is not None:
            core.batch_rollouts = batch
        if kappa is not None:
            core.kappa = kappa
        self._t_bcast.prepared(positive_of(stats.get("publish_prepare_s")))

    def _export_trainer_gauges(self, stats: dict[str, Any]) -> None:
        """Learner figures on /metrics: one gauge per scalar, the staleness histogram by label."""
        if self._gauges is None:
            self._gauges = TrainerGauges(self._core.registry)
        self._gauges.export(stats)


def _staleness(value: Any) -> int | None:
    """The learner's S from its report: a whole number in [0, 1024], else None (not said)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1024:
        return None
    return value


def _count(value: Any) -> int | None:
    """A whole number in [1, MAX_LEARNER_BATCH] from the trainer's report, else None."""
    number = positive_of(value)
    if number is None or number > MAX_LEARNER_BATCH or number != int(number):
        return None
    return int(number)
