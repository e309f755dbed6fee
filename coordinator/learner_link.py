"""The trainer's side of the coordinator service: publications, the rollout feed, its figures.

:class:`LearnerLink` is a mixin of :class:`coordinator.service.CoordinatorService`, which sets the
state declared below in its ``__init__``. Only the configured trainer key may call these handlers
(:meth:`LearnerLink._open_trainer`, checked before the signature). ``rswarm/publish`` signs the
trainer's manifest, records it and starts holding the version (:mod:`coordinator.holding`);
``rswarm/fetch`` long-polls accepted rollouts (at most ``FETCH_WAIT_CAP_S``) and takes the
learner's figures that ride on it: T_train and its variability, B, κ for the capacity rule, and
the step/cursor pairs of the receipt log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.history import StatusHistory
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
from swarm.broadcast import BroadcastNode

M = TypeVar("M", bound=msgspec.Struct)

FETCH_WAIT_CAP_S = 30.0
#: a learner batch or κ above this in the trainer's report is not believed
MAX_LEARNER_BATCH = 1 << 24


class LearnerLink:
    """The trainer's handlers, as a mixin of :class:`~coordinator.service.CoordinatorService`
    (which sets every attribute below in its ``__init__``)."""

    core: Coordinator | None
    broadcast: BroadcastNode | None
    identity: Identity
    trainer_fingerprint: str | None
    trainer_stats: dict[str, Any]
    history: StatusHistory
    _new_rollouts: asyncio.Event
    _trainer_gauges: TrainerGauges | None
    _seeders: dict[int, str]
    _version_tasks: dict[int, asyncio.Task[None]]

    if TYPE_CHECKING:  # defined by the service and coordinator.holding

        def _show_published(self, version: int) -> None: ...

        async def _hold_version(self, version: int, seeder: str | None) -> None: ...

        def _update_t_bcast(self) -> None: ...

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
        self._show_published(manifest.version)
        return encode(ManifestResponse(manifest=env))

    async def _on_fetch(self, caller: str, request: bytes) -> bytes:
        assert self.core is not None
        msg = self._open_trainer(request, FetchRollouts)
        if msg.trainer_stats:
            self.trainer_stats = dict(msg.trainer_stats)
            self.history.record_trainer(self.trainer_stats)
            self._learner_figures(self.trainer_stats)
            # receipts (ledger): which learner step consumed which rollouts, the last step's time
            step_s = positive_of(self.trainer_stats.get("step_time_s")) or 0.0
            step, cursor = self.trainer_stats.get("step"), self.trainer_stats.get("rollout_cursor")
            if count_of(step) > 0:
                self.core.learner_report(count_of(step), count_of(cursor), step_s)
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

    def _learner_figures(self, stats: dict[str, Any]) -> None:
        """The capacity rule's learner inputs, as the trainer measured them: T_train (its smoothed
        step time; the last step's from an older trainer), B, κ, and its publication time."""
        assert self.core is not None
        t_train = positive_of(stats.get("t_train_s", stats.get("step_time_s")))
        if t_train is not None:
            self.core.t_train_s = t_train
        cv = stats.get("t_train_cv")
        if isinstance(cv, int | float) and not isinstance(cv, bool) and 0 <= cv < 10:
            self.core.t_train_cv = float(cv)
        batch, kappa = _count(stats.get("batch_rollouts")), _count(stats.get("kappa"))
        if batch is not None:
            self.core.batch_rollouts = batch
        if kappa is not None:
            self.core.kappa = kappa
        self._update_t_bcast()

    def _export_trainer_gauges(self) -> None:
        """Learner figures on /metrics: one gauge per scalar, the staleness histogram by label."""
        assert self.core is not None
        if self._trainer_gauges is None:
            self._trainer_gauges = TrainerGauges(self.core.registry)
        self._trainer_gauges.export(self.trainer_stats)


def _count(value: Any) -> int | None:
    """A whole number in [1, MAX_LEARNER_BATCH] from the trainer's report, else None."""
    number = positive_of(value)
    if number is None or number > MAX_LEARNER_BATCH or number != int(number):
        return None
    return int(number)
