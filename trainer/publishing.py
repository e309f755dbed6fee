"""Versions going out: when the learner publishes, under which number, and what it hands over.

:class:`Publications` receives what it uses (the config, the model and its engine, the ranks,
the recipe's :class:`~trainer.progress.LearnerProgress`) and is built once by
:class:`trainer.recipe.Trainer`; the loop (:meth:`trainer.recipe.Trainer.run`) calls it at
step boundaries with the publisher, the background :class:`~trainer.pipeline.PublicationSlot`
and the run's :class:`~trainer.metrics.IdleClock`.

Numbering: a version is published every κ (``kappa``) learner steps. The swarm's newest version
is a floor: :meth:`Publications.sync` (before a run, with the coordinator's newest version)
and a publisher's :class:`~trainer.sources.VersionNotNewer` refusal both adopt it, so the next
publication is strictly newer and a version number never names two sets of weights. Rank 0
holds the publisher and decides; every rank follows (gathering sharded weights is a
collective). ``published.json`` (:mod:`trainer.checkpoints`) records each version handed over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from trainer.checkpoints import write_published
from trainer.config import TrainerConfig
from trainer.distributed import DistContext, leader_wait
from trainer.engine import Engine
from trainer.metrics import IdleClock
from trainer.pipeline import PublicationSlot
from trainer.progress import LearnerProgress
from trainer.sources import Publisher, VersionNotNewer

log = logging.getLogger(__name__)


class Publications:
    """Publishes the model's weights through the publisher it is handed, advancing the version
    numbers of the :class:`~trainer.progress.LearnerProgress` it receives."""

    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        *,
        engine: Engine,
        dist: DistContext,
        progress: LearnerProgress,
        lora_base: str | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.engine = engine
        self.dist = dist
        self.progress = progress
        #: where ``published.json`` is written
        self.out_dir = Path(config.out_dir)
        #: the base model's fingerprint a LoRA version names (hashed at the first publication
        #: when not given)
        self._lora_base = lora_base
        #: publish the current weights when the run starts (see :meth:`sync`)
        self.publish_first = False

    @property
    def first_due(self) -> bool:
        """A run starts by publishing: nothing was published yet, or :meth:`sync` asked for it."""
        return self.progress.published_version is None or self.publish_first

    def sync(self, latest: int | None) -> None:
        """Reconcile with ``latest``, the newest version the swarm (the coordinator) holds, before
        a run: the next publication is then strictly newer than it.

        * ``latest`` is ahead of this trainer's record (it was killed after the coordinator
          recorded a publication and before ``published.json`` / a checkpoint did): adopt it as
          the floor, like a resume adopts ``published.json`` (those weights are lost; the nodes
          keep sampling them until the next publication, which importance weighting allows);
        * this trainer never published, but the swarm has versions (a fresh trainer, or one that
          lost its state): publish the current weights at once, as ``latest + 1``;
        * the coordinator has nothing, or less than this trainer published (its state was reset):
          publish the current weights at once, so that nodes have a version to work on.
        """
        progress = self.progress
        if latest is None:
            self.publish_first = True
        elif progress.published_version is None:
            progress.version = max(progress.version, latest + 1)
            self.publish_first = True
        elif latest > progress.published_version:
            log.warning(
                "the coordinator already holds v%d, newer than v%d recorded here (killed while "
                "publishing?); continuing after v%d",
                latest,
                progress.published_version,
                latest,
            )
            progress.version = max(progress.version, latest)
            progress.published_version = latest
        elif latest < progress.published_version:
            self.publish_first = True

    def state_dict(self) -> dict[str, Tensor]:
        """Detached CPU copies of the current weights (every key, tied ones included); with LoRA
        (``lora_rank``) the adapter only, as a :class:`policy.lora.AdapterState` naming its base.
        Sharded, a collective: every rank calls it, rank 0 gets the gathered weights, the others
        ``{}``."""
        cfg = self.config
        if not cfg.lora_rank:
            return self.engine.full_state_dict(self.model)
        from policy.lora import AdapterState, adapter_state, base_fingerprint
        from policy.model import ModelSpec

        named = self.engine.trainable_state_dict(self.model)
        if not self.dist.is_leader:
            return {}
        if self._lora_base is None:
            spec = ModelSpec(path=cfg.model_path, dtype=cfg.dtype)
            self._lora_base = base_fingerprint(spec)
        return AdapterState(
            adapter_state(named.items()),
            base_model=self._lora_base,
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
        )

    async def publish_now(self, publisher: Publisher | None, idle: IdleClock) -> None:
        """Publish the current weights now; the learner waits (counted as ``publish`` idle)."""
        t0 = time.monotonic()
        try:
            await self._publish(publisher)
        finally:
            self.progress.publish_s = time.monotonic() - t0
            idle.add_wait(self.progress.publish_s, "publish")

    async def publish_due(
        self, publisher: Publisher | None, slot: PublicationSlot, idle: IdleClock
    ) -> None:
        """At a step boundary: collect a finished background publication, then start the next
        one if κ versions have passed since the last (in flight or done). Rank 0 decides (only
        it holds the slot) and every rank follows: gathering sharded weights is a collective."""
        cfg, progress = self.config, self.progress
        action: str | None = None
        if self.dist.is_leader:
            refused = self._collect(slot)
            last = slot.version if slot.busy else progress.published_version
            due = last is None or progress.version - last >= cfg.kappa
            if refused or (due and not cfg.overlap):
                action = "block"
            elif due and slot.busy:
                # published at the first boundary after the one in flight lands
                progress.publish_deferred = slot.defer()
            elif due:
                action = "start"
        if self.dist.enabled:
            action, progress.version = self.dist.share((action, progress.version))
        if action == "block":
            await self.publish_now(publisher, idle)
        elif action == "start":
            version, state = progress.version, self.state_dict()
            if self.dist.is_leader and publisher is not None:
                slot.start(version, self._publish_version(publisher, version, state))

    async def settle(
        self, publisher: Publisher | None, slot: PublicationSlot, idle: IdleClock
    ) -> None:
        """End of a run: wait for the publication in flight (rank 0); one the swarm refused as
        not newer is renumbered and published again, by every rank."""
        progress = self.progress
        refused = False
        if self.dist.is_leader and slot.busy:
            await leader_wait(self.dist, slot.wait_done())
            refused = self._collect(slot)
        if self.dist.enabled:  # the followers learn what landed (they checkpoint it too)
            refused, progress.version, progress.published_version = self.dist.share(
                (refused, progress.version, progress.published_version)
            )
        if refused:
            await self.publish_now(publisher, idle)

    def _collect(self, slot: PublicationSlot) -> bool:
        """Rank 0: take the outcome of a finished background publication. True when the swarm
        refused it as not newer (the version is then renumbered past the swarm's: publish the
        current weights at once)."""
        progress = self.progress
        try:
            slot.collect()
        except VersionNotNewer as exc:  # the swarm is ahead of our record: renumber, in the loop
            log.warning("%s; publishing the current weights instead", exc)
            progress.version = max(progress.version, exc.latest + 1)
            return True
        finally:
            if slot.last_s is not None:
                progress.publish_s = slot.last_s
            progress.publish_deferred = slot.deferred
        return False

    async def _publish(self, publisher: Publisher | None) -> None:
        """Publish the current weights (every rank calls it; rank 0 holds the publisher)."""
        progress = self.progress
        state = self.state_dict()
        if not self.dist.is_leader or publisher is None:
            # A follower: rank 0's numbers (maybe renumbered) come with the next batch.
            progress.published_version = progress.version
            self.publish_first = False
            return
        try:
            await leader_wait(self.dist, publisher.publish(progress.version, state))
        except VersionNotNewer as exc:  # the swarm is ahead of our record: renumber, once
            progress.version = max(progress.version, exc.latest + 1)
            log.warning("%s; publishing these weights as v%d instead", exc, progress.version)
            await leader_wait(self.dist, publisher.publish(progress.version, state))
        progress.published_version = progress.version
        self.publish_first = False
        write_published(self.out_dir, progress.version)

    async def _publish_version(
        self, publisher: Publisher, version: int, state: Mapping[str, Tensor]
    ) -> None:
        """The background publication of ``state`` as ``version`` (see :meth:`publish_due`)."""
        await publisher.publish(version, state)
        published = self.progress.published_version
        if published is None or version > published:
            self.progress.published_version = version
            self.publish_first = False
            write_published(self.out_dir, version)
