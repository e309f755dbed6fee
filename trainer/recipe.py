"""The GRPO recipe: ``setup`` → ``run`` (one visible loop) → ``train_step`` / checkpoints.

Read top to bottom: :class:`Trainer.setup` builds the model and optimizer (and resumes);
:meth:`Trainer.run` is the loop — fetch a batch of complete groups, :meth:`Trainer.train_step`,
publish every κ versions, checkpoint every ``checkpoint_every`` steps; :meth:`Trainer.train_step`
is one learner step on a list of :class:`~trainer.batch.Rollout`.

Versions: the weights after ``n`` optimizer steps carry version ``n`` (version 0 = initial weights),
so staleness Δ = trainer version − rollout version counts learner steps. Only every κ-th version is
published. After a resume the version is ``max(saved, last published)``, so a version number is
never reused for different weights (versions stay monotonic across restarts). The trainer's own
record can lag the swarm's: killed after the coordinator recorded a publication but before
``published.json`` did. :meth:`Trainer.sync_published` (called with the coordinator's newest
version before :meth:`Trainer.run`) and a publisher's :class:`~trainer.sources.VersionNotNewer`
refusal both adopt the swarm's newest version as a floor, so the next publication is strictly
newer.

Where rollouts come from and versions go: :mod:`trainer.sources`; the checkpoint directories and
``published.json`` on disk: :mod:`trainer.checkpoints`. One learner step: :mod:`trainer.step`;
saving and loading checkpoints: :mod:`trainer.resume`; the counters both advance:
:mod:`trainer.progress`. :meth:`Trainer._compose` wires them together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from trainer.batch import Rollout
from trainer.checkpoints import read_published, write_published
from trainer.config import TrainerConfig
from trainer.distributed import KEEPALIVE_S, DistContext
from trainer.engine import Engine, make_engine
from trainer.evaluation import EvalRunner, make_replica
from trainer.filtering import GroupFilter
from trainer.metrics import IdleClock, MetricsWriter
from trainer.monitors import GradSpikeGuard, monitor_from_config
from trainer.pipeline import PublicationSlot, RolloutFeed
from trainer.progress import LearnerProgress, PendingRollouts, StepTiming
from trainer.resume import CheckpointStore
from trainer.sources import Publisher, RolloutSource, VersionNotNewer
from trainer.step import LearnerStep

log = logging.getLogger(__name__)
T = TypeVar("T")


class Trainer:
    """The learner. Build with :meth:`setup`; drive with :meth:`run` or :meth:`train_step`.

    It composes, in :meth:`_compose`, a :class:`~trainer.step.LearnerStep` (:attr:`learner`) and
    a :class:`~trainer.resume.CheckpointStore` (:attr:`checkpoints`) from the parts it holds:
    the model, optimizer, engine and ranks, the monitors, and the counters of
    :mod:`trainer.progress` that both advance (:attr:`progress`, :attr:`pending`,
    :attr:`timing`). The counters are also read here as attributes (``step``, ``version``, …)."""

    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int,
        dist: DistContext | None = None,
        metrics: MetricsWriter | None = None,
        stop_token_ids: Collection[int] | None = None,
        engine: Engine | None = None,
    ) -> None:
        self._config = config
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        #: the leases' stop set: a completion is trained up to its first stop token
        self.stop_token_ids = frozenset(stop_token_ids or ()) | {eos_token_id}
        self.dist = dist or DistContext()
        #: how the model runs: one process, or FSDP2 over the ranks (see :mod:`trainer.engine`).
        self.engine = engine or Engine(self.dist)
        if config.lora_rank and not _has_lora(model):  # built by the caller, not by setup
            _inject_lora(model, config)
        #: the base model's fingerprint a LoRA version names (computed at the first publication)
        self._lora_base: str | None = None
        self._optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
        )
        self.out_dir = Path(config.out_dir)
        self.metrics = metrics
        #: step, version, published version, the KL-adaptive factor, rollbacks, publication times
        self.progress = LearnerProgress()
        #: rollouts fetched and not yet trained on; the resumable cursor
        self.pending = PendingRollouts()
        #: T_train and its variability
        self.timing = StepTiming()
        #: publish the current weights when :meth:`run` starts (see :meth:`sync_published`).
        self._publish_first = False
        self._stop_requested = False
        self._feed: RolloutFeed | None = None
        #: a step is running in the worker thread (the feed then fetches for the next version)
        self._training = False
        self.idle = IdleClock(window_s=config.idle_window_s)
        #: rolling stability checks; each step's record carries its ``stability_warning``.
        self.monitor = monitor_from_config(config)
        self._spike_guard = GradSpikeGuard(config.grad_spike_factor)
        #: called with each step's metrics record (after it is written), e.g. to report upstream.
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        #: the held-out evaluation (``eval_every``; trainer/evaluation.py), built by :meth:`setup`
        self.evaluation: EvalRunner | None = None
        self._compose()

    def _compose(self) -> None:
        """Build the learner step and the checkpoint store from this trainer's parts. Called by
        ``__init__``, again when a part they receive is replaced (``config``, ``optimizer``,
        ``spike_guard``), and by :meth:`run` (a fresh idle clock, rank 0's stop set); the
        counters they advance are the same objects throughout."""
        #: one learner step (trainer/step.py)
        self.learner = LearnerStep(
            self._config,
            self.model,
            self._optimizer,
            engine=self.engine,
            dist=self.dist,
            pad_token_id=self.pad_token_id,
            stop_token_ids=self.stop_token_ids,
            progress=self.progress,
            pending=self.pending,
            timing=self.timing,
            idle=self.idle,
            monitor=self.monitor,
            spike_guard=self._spike_guard,
            metrics=self.metrics,
            on_step=self.on_step,
        )
        #: saving, finding and loading checkpoints (trainer/resume.py)
        self.checkpoints = CheckpointStore(
            self._config,
            self.model,
            self._optimizer,
            engine=self.engine,
            dist=self.dist,
            progress=self.progress,
            pending=self.pending,
            spike_guard=self._spike_guard,
        )

    # --------------------------------------------------------- parts and counters
    @property
    def config(self) -> TrainerConfig:
        return self._config

    @config.setter
    def config(self, value: TrainerConfig) -> None:
        self._config = value
        self._compose()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self._optimizer = value
        self._compose()

    @property
    def spike_guard(self) -> GradSpikeGuard:
        return self._spike_guard

    @spike_guard.setter
    def spike_guard(self, value: GradSpikeGuard) -> None:
        self._spike_guard = value
        self._compose()

    @property
    def processing(self) -> dict[str, Any]:
        """Temperature/top-p/top-k of the leases (the config's)."""
        return self._config.processing

    @property
    def step(self) -> int:
        """Optimizer steps (learner steps) done."""
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    @property
    def version(self) -> int:
        """Version of the current weights."""
        return self.progress.version

    @version.setter
    def version(self, value: int) -> None:
        self.progress.version = value

    @property
    def published_version(self) -> int | None:
        """Last version handed to a publisher (None: nothing published yet)."""
        return self.progress.published_version

    @published_version.setter
    def published_version(self, value: int | None) -> None:
        self.progress.published_version = value

    @property
    def lr_factor(self) -> float:
        """Learning-rate factor of the KL-adaptive schedule."""
        return self.progress.lr_factor

    @lr_factor.setter
    def lr_factor(self, value: float) -> None:
        self.progress.lr_factor = value

    @property
    def rollbacks(self) -> int:
        """Learner steps undone (``max_step_kl``)."""
        return self.progress.rollbacks

    @property
    def publish_s(self) -> float | None:
        """Seconds the last publication took."""
        return self.progress.publish_s

    @publish_s.setter
    def publish_s(self, value: float | None) -> None:
        self.progress.publish_s = value

    @property
    def publish_deferred(self) -> int:
        """Publications deferred because the previous one was still in flight."""
        return self.progress.publish_deferred

    @publish_deferred.setter
    def publish_deferred(self, value: int) -> None:
        self.progress.publish_deferred = value

    @property
    def t_train_s(self) -> float | None:
        """T_train: moving average of the time in :meth:`train_step`."""
        return self.timing.t_train_s

    @property
    def t_train_cv(self) -> float | None:
        """Coefficient of variation of the step time (:class:`~trainer.progress.StepTiming`)."""
        return self.timing.t_train_cv

    @property
    def cursor(self) -> int:
        """Resumable cursor: every rollout with ``seq ≤ cursor`` was trained on or dropped."""
        return self.pending.cursor

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --------------------------------------------------------- the step and checkpoints
    def train_step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One learner step (:meth:`trainer.step.LearnerStep.train_step`)."""
        return self.learner.train_step(rollouts)

    def save_checkpoint(self, path: Path | None = None) -> Path:
        """Save a checkpoint (:meth:`trainer.resume.CheckpointStore.save_checkpoint`)."""
        return self.checkpoints.save_checkpoint(path)

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint (:meth:`trainer.resume.CheckpointStore.load_checkpoint`)."""
        self.checkpoints.load_checkpoint(path)

    def latest_checkpoint(self) -> Path | None:
        """The newest intact checkpoint (:meth:`.CheckpointStore.latest_checkpoint`)."""
        return self.checkpoints.latest_checkpoint()

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(
        cls,
        config: TrainerConfig,
        *,
        dist: DistContext | None = None,
        model: torch.nn.Module | None = None,
    ) -> Trainer:
        """Build model, optimizer and metrics from ``config``; resume from ``out_dir`` if asked."""
        from policy.model import ModelSpec, build_model, load_tokenizer, model_stop_ids

        dist = dist or DistContext()
        # Rank 0's config for every rank: it may have adopted the coordinator's sampling contract.
        config = dist.share(config)
        spec = ModelSpec(path=config.model_path, dtype=config.dtype)
        engine = make_engine(config, dist)
        if model is None:
            # LoRA over the embedded default: its weights at seed 0, the base every node and the
            # coordinator build (`seed` still draws the adapters and the minibatch order)
            model = build_model(spec, seed=0 if config.lora_rank else config.seed)
        if config.lora_rank:  # before sharding: FSDP2 wraps the adapted layers
            _inject_lora(model, config)
        device = _resolve_device(config.device, dist)
        # the held-out evaluation's copy of the model as built (rank 0; trainer/evaluation.py)
        replica = make_replica(model) if config.eval_every and dist.is_leader else None
        model = engine.prepare(model, device)
        tok = load_tokenizer(spec)
        writer = None
        if dist.is_leader:
            writer = MetricsWriter(
                Path(config.out_dir) / "metrics.jsonl", max_staleness=config.max_staleness
            )
        trainer = cls(
            config,
            model,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            dist=dist,
            metrics=writer,
            stop_token_ids=model_stop_ids(spec, tok),
            engine=engine,
        )
        if config.eval_every:
            replica = replica.to(device) if replica is not None else None
            trainer.evaluation = EvalRunner(config, dist, replica, threads=config.eval_threads)
        if config.lora_rank and dist.is_leader:  # hashed once here, not in the first publication
            from policy.lora import base_fingerprint

            trainer._lora_base = base_fingerprint(spec)
        # Every rank resumes from what rank 0 finds (the same files on a shared filesystem).
        latest, logged = (
            dist.share((trainer.latest_checkpoint(), read_published(trainer.out_dir)))
            if config.resume
            else (None, None)
        )
        if latest is not None:
            trainer.load_checkpoint(latest)
            log.info("resumed from %s at step %d version %d", latest, trainer.step, trainer.version)
        elif logged is not None:
            # Killed before its first checkpoint: the weights are lost, the version numbers are
            # not (a version already published must never name other weights).
            trainer.version = trainer.published_version = logged
            log.info("no checkpoint to resume; continuing the version numbers after v%d", logged)
        return trainer

    def sync_published(self, latest: int | None) -> None:
        """Reconcile with ``latest``, the newest version the swarm (the coordinator) holds, before
        :meth:`run`: the next publication is then strictly newer than it.

        * ``latest`` is ahead of this trainer's record (it was killed after the coordinator
          recorded a publication and before ``published.json`` / a checkpoint did): adopt it as
          the floor, like a resume adopts ``published.json`` (those weights are lost; the nodes
          keep sampling them until the next publication, which importance weighting allows);
        * this trainer never published, but the swarm has versions (a fresh trainer, or one that
          lost its state): publish the current weights at once, as ``latest + 1``;
        * the coordinator has nothing, or less than this trainer published (its state was reset):
          publish the current weights at once, so that nodes have a version to work on.
        """
        if latest is None:
            self._publish_first = True
        elif self.published_version is None:
            self.version = max(self.version, latest + 1)
            self._publish_first = True
        elif latest > self.published_version:
            log.warning(
                "the coordinator already holds v%d, newer than v%d recorded here (killed while "
                "publishing?); continuing after v%d",
                latest,
                self.published_version,
                latest,
            )
            self.version = max(self.version, latest)
            self.published_version = latest
        elif latest < self.published_version:
            self._publish_first = True

    # ------------------------------------------------------------------ the loop
    async def run(self, source: RolloutSource, publisher: Publisher | None = None) -> None:
        """Fetch → train → publish every κ versions → checkpoint, until ``max_steps`` or the
        source ends. Every rank runs this; rank 0 alone reads ``source`` and ``publisher`` (the
        others pass anything) and the others follow its decisions: each batch's groups are
        scattered from it, and publications and checkpoints are collectives.

        With ``overlap`` (the default) the swarm's plumbing stays off the critical path
        (:mod:`trainer.pipeline`): rank 0's step runs in a worker thread while its event loop
        keeps fetching rollouts and publishes the previous version in the background (the
        weights are gathered at the step boundary, by every rank)."""
        cfg = self.config
        self.idle = IdleClock(window_s=cfg.idle_window_s)
        has_publisher = self.dist.share(publisher is not None)
        first = self.published_version is None or self._publish_first
        if self.dist.enabled:  # rank 0 alone knows the swarm's version numbers and stop set
            first, self.version, self.published_version, self.stop_token_ids = self.dist.share(
                (first, self.version, self.published_version, self.stop_token_ids)
            )
        self._compose()  # the step gets this run's idle clock (and rank 0's stop set)
        leader = self.dist.is_leader
        feed: RolloutFeed | None = None
        if leader:
            batch_size = cfg.batch_prompts * cfg.group_size
            feed = RolloutFeed(
                source,
                after=self.pending.fetched,
                page=batch_size,
                capacity=batch_size * cfg.prefetch_batches,
                admissible=lambda r: not self._too_stale(r),
                # While a step runs, what arrives is used at the next version: skip what will be
                # stale by then (in an oversupplied swarm the queue's head sits at that edge).
                min_version=lambda: max(0, self.version + self._training - cfg.max_staleness),
                idle=self.idle,
                background=cfg.overlap,
            )
            if cfg.trace_rollouts:
                feed.fetched_at = {}
            self.pending.fetched_at = feed.fetched_at  # the step's trace pops what it trained
        self._feed = feed
        slot = PublicationSlot()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-step")
        threads = torch.get_num_threads()
        try:
            if has_publisher and first:
                await self._blocking_publish(publisher)
            self._evaluate_due(start=True)
            if feed is not None:
                feed.start()
            while True:
                batch = None
                more = cfg.max_steps is None or self.step < cfg.max_steps
                if feed is not None and more and not self._stop_requested:
                    batch = await self._leader_wait(self._next_batch(feed))
                if not self._follow_leader(batch):
                    break
                if cfg.overlap and leader:
                    self._training = True
                    try:
                        await asyncio.get_running_loop().run_in_executor(
                            executor, _train_in_thread, self, batch or [], threads
                        )
                    finally:
                        self._training = False
                else:
                    self.train_step(batch or [])
                self._evaluate_due()
                if has_publisher:
                    await self._publish_due(publisher, slot)
                if self.step % cfg.checkpoint_every == 0 and self._writes_checkpoints:
                    t0 = time.monotonic()
                    self.save_checkpoint()
                    self.idle.add_wait(time.monotonic() - t0, "checkpoint")
            if has_publisher:
                await self._settle_publication(publisher, slot)
        finally:
            self._feed = None
            self.pending.fetched_at = None
            if feed is not None:
                await feed.stop()
            executor.shutdown(wait=True)
        if self._writes_checkpoints and (self._stop_requested or self.step % cfg.checkpoint_every):
            self.save_checkpoint()

    def _evaluate_due(self, *, start: bool = False) -> None:
        """Hand the weights to the held-out evaluation if this version is due (every rank: a
        sharded copy is a collective); it runs in its own thread (trainer/evaluation.py)."""
        if self.evaluation is not None:
            self.evaluation.after_step(
                self.model, self.engine, self.version, self.step, start=start
            )

    def _follow_leader(self, batch: list[Rollout] | None) -> bool:
        """Every rank takes rank 0's decisions: is there a batch to train on, the version numbers
        (a refused publication may have raised them), stop. Returns whether to train."""
        if not self.dist.enabled:
            return batch is not None
        shared = (batch is not None, self.version, self.published_version, self._stop_requested)
        go, self.version, self.published_version, self._stop_requested = self.dist.share(shared)
        return bool(go)

    async def _leader_wait(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` (rank 0: rollouts, a publication); followers waiting for it in a
        collective get a keep-alive every ``KEEPALIVE_S``, so a long wait does not trip the
        process group's timeout."""
        if not self.dist.enabled:
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=KEEPALIVE_S)
                if done:
                    return task.result()
                self.dist.keepalive()
        finally:
            task.cancel()

    @property
    def _writes_checkpoints(self) -> bool:
        """Rank 0 writes a single-process checkpoint; every rank writes its shards."""
        return self.dist.is_leader or self.engine.sharded

    def request_stop(self) -> None:
        """End :meth:`run` soon, cleanly: a step or a publication in progress finishes (the
        coordinator may already have recorded that version: ``published.json`` must say so too),
        a wait for rollouts ends at once; then a checkpoint is saved."""
        self._stop_requested = True
        if self._feed is not None:
            self._feed.interrupt()

    async def _publish_due(self, publisher: Publisher | None, slot: PublicationSlot) -> None:
        """At a step boundary: collect a finished background publication, then start the next
        one if κ versions have passed since the last (in flight or done). Rank 0 decides (only
        it holds the slot) and every rank follows: gathering sharded weights is a collective."""
        cfg = self.config
        action: str | None = None
        if self.dist.is_leader:
            refused = self._collect_publication(slot)
            last = slot.version if slot.busy else self.published_version
            due = last is None or self.version - last >= cfg.kappa
            if refused or (due and not cfg.overlap):
                action = "block"
            elif due and slot.busy:
                slot.deferred += 1  # published at the first boundary after the one in flight lands
                self.publish_deferred = slot.deferred
            elif due:
                action = "start"
        if self.dist.enabled:
            action, self.version = self.dist.share((action, self.version))
        if action == "block":
            await self._blocking_publish(publisher)
        elif action == "start":
            version, state = self.version, self.state_dict_for_publish()
            if self.dist.is_leader and publisher is not None:
                slot.start(version, self._publish_version(publisher, version, state))

    async def _settle_publication(self, publisher: Publisher | None, slot: PublicationSlot) -> None:
        """End of :meth:`run`: wait for the publication in flight (rank 0); one the swarm refused
        as not newer is renumbered and published again, by every rank."""
        refused = False
        if self.dist.is_leader and slot.busy:
            await self._leader_wait(slot.wait_done())
            refused = self._collect_publication(slot)
        if self.dist.enabled:  # the followers learn what landed (they checkpoint it too)
            refused, self.version, self.published_version = self.dist.share(
                (refused, self.version, self.published_version)
            )
        if refused:
            await self._blocking_publish(publisher)

    def _collect_publication(self, slot: PublicationSlot) -> bool:
        """Rank 0: take the outcome of a finished background publication. True when the swarm
        refused it as not newer (the version is then renumbered past the swarm's: publish the
        current weights at once)."""
        try:
            slot.collect()
        except VersionNotNewer as exc:  # the swarm is ahead of our record: renumber, in the loop
            log.warning("%s; publishing the current weights instead", exc)
            self.version = max(self.version, exc.latest + 1)
            return True
        finally:
            if slot.last_s is not None:
                self.publish_s = slot.last_s
            self.publish_deferred = slot.deferred
        return False

    async def _blocking_publish(self, publisher: Publisher | None) -> None:
        """Publish the current weights now; the learner waits (counted as ``publish`` idle)."""
        t0 = time.monotonic()
        try:
            await self._publish(publisher)
        finally:
            self.publish_s = time.monotonic() - t0
            self.idle.add_wait(self.publish_s, "publish")

    async def _next_batch(self, feed: RolloutFeed) -> list[Rollout] | None:
        """``batch_prompts`` complete groups (``group_size`` samples each), oldest first; with
        ``filter_groups``, informative ones (:mod:`trainer.filtering`)."""
        cfg = self.config
        pick = (
            GroupFilter(cfg.batch_prompts, cfg.filter_max_batches, cfg.minibatches, cfg.filter_drop)
            if cfg.filter_groups
            else None
        )
        pending = self.pending.groups
        while True:
            # A group that became too stale while incomplete will never be trained on.
            for gid in [k for k, g in pending.items() if self._too_stale(g[0])]:
                self.pending.dropped_at_fetch += len(pending.pop(gid))
            complete = [k for k, g in pending.items() if len(g) >= cfg.group_size]
            if pick is None:
                if len(complete) >= cfg.batch_prompts:
                    return self._pop_groups(complete[: cfg.batch_prompts])
                need = (cfg.batch_prompts - len(complete)) * cfg.group_size
            else:
                offered = set(pick.informative) | set(pick.uniform)
                for gid in complete:
                    if pick.done:
                        break
                    if gid not in offered:
                        pick.offer(gid, [r.reward for r in pending[gid][: cfg.group_size]])
                if pick.done:
                    train, drop = pick.chosen()
                    for gid in drop:
                        group = pending.pop(gid)[: cfg.group_size]
                        self.pending.uniform_rewards.extend(float(r.reward) for r in group)
                    return self._pop_groups(train)
                need = pick.missing * cfg.group_size
            t0 = time.monotonic()
            items = await feed.take(need, cfg.fetch_timeout_s)
            self.pending.dropped_at_fetch += feed.take_dropped()
            if items == [] and time.monotonic() - t0 >= cfg.fetch_timeout_s:
                log.warning(
                    "waiting for rollouts: %d/%d complete groups after %.0f s",
                    len(complete) if pick is None else len(pick.informative),
                    cfg.batch_prompts,
                    cfg.fetch_timeout_s,
                )
            if items is None or self._stop_requested:
                return None
            for r in items:
                self.pending.fetched = max(self.pending.fetched, r.seq)
                if self._too_stale(r):
                    self.pending.dropped_at_fetch += 1
                    continue
                pending.setdefault(r.group_id, []).append(r)

    def _pop_groups(self, group_ids: Sequence[str]) -> list[Rollout]:
        batch: list[Rollout] = []
        for gid in group_ids:
            batch.extend(self.pending.groups.pop(gid)[: self.config.group_size])
        return batch

    def _too_stale(self, rollout: Rollout) -> bool:
        return self.version - rollout.policy_version > self.config.max_staleness

    # ------------------------------------------------------------------ publish
    def state_dict_for_publish(self) -> dict[str, Tensor]:
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

    async def _publish(self, publisher: Publisher | None) -> None:
        """Publish the current weights (every rank calls it; rank 0 holds the publisher)."""
        state = self.state_dict_for_publish()
        if not self.dist.is_leader or publisher is None:
            # A follower: rank 0's numbers (maybe renumbered) come with the next batch.
            self.published_version = self.version
            self._publish_first = False
            return
        try:
            await self._leader_wait(publisher.publish(self.version, state))
        except VersionNotNewer as exc:  # the swarm is ahead of our record: renumber, once
            self.version = max(self.version, exc.latest + 1)
            log.warning("%s; publishing these weights as v%d instead", exc, self.version)
            await self._leader_wait(publisher.publish(self.version, state))
        self.published_version = self.version
        self._publish_first = False
        write_published(self.out_dir, self.version)

    async def _publish_version(
        self, publisher: Publisher, version: int, state: Mapping[str, Tensor]
    ) -> None:
        """The background publication of ``state`` as ``version`` (see :meth:`run`)."""
        await publisher.publish(version, state)
        if self.published_version is None or version > self.published_version:
            self.published_version = version
            self._publish_first = False
            write_published(self.out_dir, version)


def _train_in_thread(trainer: Trainer, batch: list[Rollout], threads: int) -> None:
    """:meth:`Trainer.train_step` on the step thread, with the loop thread's torch thread count."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    trainer.train_step(batch)


def _has_lora(model: torch.nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


def _inject_lora(model: torch.nn.Module, config: TrainerConfig) -> None:
    """peft adapters on ``model`` (policy/lora.py), initialised from ``config.seed``: every rank
    draws the same ``lora_A`` (FSDP2 broadcasts rank 0's anyway)."""
    from policy.lora import inject_lora

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        inject_lora(
            model,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            target_modules=list(config.lora_target_modules),
        )


def _resolve_device(name: str, dist: DistContext) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if dist.enabled:  # this rank's GPU under NCCL; the CPU under gloo
        return torch.device(dist.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
