"""The GRPO recipe: ``setup`` → ``run`` (one visible loop) → ``train_step`` / checkpoints.

Read top to bottom: :meth:`Trainer.setup` builds the parts (:mod:`trainer.build`: model, engine,
optimizer, token ids, metrics writer, held-out evaluation) and resumes; :meth:`Trainer.__init__`
composes them, once; :meth:`Trainer.run` is the loop — fetch a batch of complete groups, train
one learner step, publish every κ versions, checkpoint every ``checkpoint_every`` steps;
:meth:`Trainer.train_step` is one learner step on a list of :class:`~trainer.batch.Rollout`.

Versions: the weights after ``n`` optimizer steps carry version ``n`` (version 0 = initial weights),
so staleness Δ = trainer version − rollout version counts learner steps. Only every κ-th version is
published. After a resume the version is ``max(saved, last published)``, so a version number is
never reused for different weights (versions stay monotonic across restarts). The trainer's own
record can lag the swarm's: killed after the coordinator recorded a publication but before
``published.json`` did. :meth:`Trainer.sync_published` (called with the coordinator's newest
version before :meth:`Trainer.run`) and a publisher's :class:`~trainer.sources.VersionNotNewer`
refusal both adopt the swarm's newest version as a floor, so the next publication is strictly
newer (:mod:`trainer.publishing`).

Where rollouts come from and versions go: :mod:`trainer.sources`; the checkpoint directories and
``published.json`` on disk: :mod:`trainer.checkpoints`. The collaborators the Trainer composes:
one learner step, :mod:`trainer.step`; saving, loading and resuming checkpoints,
:mod:`trainer.resume`; publications, :mod:`trainer.publishing`; the counters they advance,
:mod:`trainer.progress`. Each receives what it uses in its constructor; what belongs to one run
(the idle clock, the feed's arrival times) is handed to the call that uses it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer.batch import Rollout
from trainer.build import OptimizerFactory, adamw, build_parts, has_lora, inject_lora, trainable
from trainer.config import TrainerConfig
from trainer.distributed import DistContext, leader_wait
from trainer.engine import Engine
from trainer.evaluation import EvalRunner
from trainer.filtering import GroupFilter
from trainer.metrics import IdleClock, MetricsWriter
from trainer.monitors import GradSpikeGuard, monitor_from_config
from trainer.pipeline import PublicationSlot, RolloutFeed
from trainer.progress import LearnerProgress, PendingRollouts, StepTiming
from trainer.publishing import Publications
from trainer.resume import CheckpointStore
from trainer.sources import Publisher, RolloutSource
from trainer.step import LearnerStep

log = logging.getLogger(__name__)


class Trainer:
    """The learner. Build with :meth:`setup`; drive with :meth:`run` or :meth:`train_step`.

    Its constructor is the one place the parts are composed: it holds the model, optimizer,
    engine and ranks, the monitors and the counters of :mod:`trainer.progress`
    (:attr:`progress`, :attr:`pending`, :attr:`timing`), and hands them to a
    :class:`~trainer.step.LearnerStep` (:attr:`learner`), a
    :class:`~trainer.resume.CheckpointStore` (:attr:`checkpoints`) and
    :class:`~trainer.publishing.Publications` (:attr:`publications`), built once. The parts are
    read-only afterwards (build another Trainer to change one); the counters are also read here
    as attributes (``step``, ``version``, …)."""

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
        optimizer: torch.optim.Optimizer | None = None,
        spike_guard: GradSpikeGuard | None = None,
        evaluation: EvalRunner | None = None,
        lora_base: str | None = None,
    ) -> None:
        self._config = config
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self._stop_token_ids = frozenset(stop_token_ids or ()) | {eos_token_id}
        self.dist = dist or DistContext()
        #: how the model runs: one process, or FSDP2 over the ranks (see :mod:`trainer.engine`).
        self.engine = engine or Engine(self.dist)
        if config.lora_rank and not has_lora(model):  # built by the caller, not by setup
            inject_lora(model, config)
        #: AdamW over the trainable parameters unless one is given (built over ``model``)
        self._optimizer = optimizer if optimizer is not None else adamw(config, trainable(model))
        self.out_dir = Path(config.out_dir)
        self.metrics = metrics
        #: step, version, published version, the KL-adaptive factor, rollbacks, publication times
        self.progress = LearnerProgress()
        #: rollouts fetched and not yet trained on; the resumable cursor
        self.pending = PendingRollouts()
        #: T_train and its variability
        self.timing = StepTiming()
        #: where the learner's time goes; :meth:`run` starts a fresh one for each run
        self.idle = IdleClock(window_s=config.idle_window_s)
        #: rolling stability checks; each step's record carries its ``stability_warning``.
        self.monitor = monitor_from_config(config)
        self._spike_guard = (
            spike_guard if spike_guard is not None else GradSpikeGuard(config.grad_spike_factor)
        )
        #: called with each step's metrics record (after it is written), e.g. to report upstream.
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        #: the held-out evaluation (``eval_every``; trainer/evaluation.py), None when off
        self.evaluation = evaluation
        self._stop_requested = False
        self._feed: RolloutFeed | None = None
        #: a step is running in the worker thread (the feed then fetches for the next version)
        self._training = False

        #: one learner step (trainer/step.py)
        self.learner = LearnerStep(
            config,
            model,
            self._optimizer,
            engine=self.engine,
            dist=self.dist,
            pad_token_id=pad_token_id,
            stop_token_ids=self._stop_token_ids,
            progress=self.progress,
            pending=self.pending,
            timing=self.timing,
            monitor=self.monitor,
            spike_guard=self._spike_guard,
            metrics=metrics,
            on_step=self.on_step,
        )
        #: saving, finding, loading and resuming checkpoints (trainer/resume.py)
        self.checkpoints = CheckpointStore(
            config,
            model,
            self._optimizer,
            engine=self.engine,
            dist=self.dist,
            progress=self.progress,
            pending=self.pending,
            spike_guard=self._spike_guard,
        )
        #: when versions go out and under which numbers (trainer/publishing.py)
        self.publications = Publications(
            config,
            model,
            engine=self.engine,
            dist=self.dist,
            progress=self.progress,
            lora_base=lora_base,
        )

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(
        cls,
        config: TrainerConfig,
        *,
        dist: DistContext | None = None,
        model: torch.nn.Module | None = None,
        make_optimizer: OptimizerFactory | None = None,
        spike_guard: GradSpikeGuard | None = None,
        lease_stop_ids: Collection[int] = (),
    ) -> Trainer:
        """Build the parts from ``config`` (:func:`trainer.build.build_parts`), compose them,
        and resume from ``out_dir`` if asked (:meth:`trainer.resume.CheckpointStore.resume`).

        ``model``: the model to train instead of building one; ``make_optimizer``: builds the
        optimizer over the prepared model's trainable parameters (AdamW by default);
        ``spike_guard``: the gradient-spike guard (the config's by default);
        ``lease_stop_ids``: the leases' stop tokens, trained up to like EOS. Under several ranks
        every rank calls it, and rank 0's config and lease stop set hold on all of them."""
        parts = build_parts(
            config, dist=dist, model=model, make_optimizer=make_optimizer,
            lease_stop_ids=lease_stop_ids,
        )  # fmt: skip
        trainer = cls(
            parts.config,
            parts.model,
            pad_token_id=parts.pad_token_id,
            eos_token_id=parts.eos_token_id,
            dist=parts.dist,
            metrics=parts.metrics,
            stop_token_ids=parts.stop_token_ids,
            engine=parts.engine,
            optimizer=parts.optimizer,
            spike_guard=spike_guard,
            evaluation=parts.evaluation,
            lora_base=parts.lora_base,
        )
        if parts.config.resume:
            trainer.checkpoints.resume()
        return trainer

    # --------------------------------------------------------- parts and counters
    @property
    def config(self) -> TrainerConfig:
        return self._config

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def spike_guard(self) -> GradSpikeGuard:
        return self._spike_guard

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The leases' stop set with EOS: a completion is trained up to its first stop token."""
        return self._stop_token_ids

    @property
    def processing(self) -> dict[str, Any]:
        """Temperature/top-p/top-k of the leases (the config's)."""
        return self._config.processing

    @property
    def training(self) -> bool:
        """A learner step is running in :meth:`run`'s worker thread."""
        return self._training

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

    @property
    def distributed(self) -> bool:
        """Several ranks train together (a checkpoint or a publication is a collective)."""
        return self.dist.enabled

    # ------------------------------------------ the step, checkpoints, publications
    def train_step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One learner step (:meth:`trainer.step.LearnerStep.train_step`), timed on this run's
        idle clock (with ``trace_rollouts``, the feed's arrival times while :meth:`run` runs)."""
        fetched_at = self._feed.fetched_at if self._feed is not None else None
        return self.learner.train_step(rollouts, idle=self.idle, fetched_at=fetched_at)

    def save_checkpoint(self, path: Path | None = None) -> Path:
        """Save a checkpoint (:meth:`trainer.resume.CheckpointStore.save_checkpoint`)."""
        return self.checkpoints.save_checkpoint(path)

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint (:meth:`trainer.resume.CheckpointStore.load_checkpoint`)."""
        self.checkpoints.load_checkpoint(path)

    def latest_checkpoint(self) -> Path | None:
        """The newest intact checkpoint (:meth:`.CheckpointStore.latest_checkpoint`)."""
        return self.checkpoints.latest_checkpoint()

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """The weights a publication hands over (:meth:`.Publications.state_dict`)."""
        return self.publications.state_dict()

    def sync_published(self, latest: int | None) -> None:
        """Reconcile with the swarm's newest version before :meth:`run`
        (:meth:`trainer.publishing.Publications.sync`)."""
        self.publications.sync(latest)

    def close(self) -> None:
        """Stop the held-out evaluation's worker, if any (the learner itself holds no thread)."""
        if self.evaluation is not None:
            self.evaluation.close()

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
        first = self.publications.first_due
        if self.dist.enabled:  # rank 0 alone knows the swarm's version numbers
            first, self.version, self.published_version = self.dist.share(
                (first, self.version, self.published_version)
            )
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
                trace=cfg.trace_rollouts,  # the step's trace pops what it trained (train_step)
                # the coordinator's source reports a blocked learner (rollouts_wanted)
                on_wanting=getattr(source, "set_wanting", None),
            )
        self._feed = feed
        slot = PublicationSlot()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-step")
        threads = torch.get_num_threads()
        try:
            if has_publisher and first:
                await self.publications.publish_now(publisher, self.idle)
            self._evaluate_due(start=True)
            if feed is not None:
                feed.start()
            while True:
                batch = None
                more = cfg.max_steps is None or self.step < cfg.max_steps
                if feed is not None and more and not self._stop_requested:
                    batch = await leader_wait(self.dist, self._next_batch(feed))
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
                    await self.publications.publish_due(publisher, slot, self.idle)
                if self.step % cfg.checkpoint_every == 0 and self._writes_checkpoints:
                    t0 = time.monotonic()
                    self.save_checkpoint()
                    self.idle.add_wait(time.monotonic() - t0, "checkpoint")
            if has_publisher:
                await self.publications.settle(publisher, slot, self.idle)
        finally:
            self._feed = None
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


def _train_in_thread(trainer: Trainer, batch: list[Rollout], threads: int) -> None:
    """:meth:`Trainer.train_step` on the step thread, with the loop thread's torch thread count."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    trainer.train_step(batch)
