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
``published.json`` on disk: :mod:`trainer.checkpoints`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from trainer.batch import Rollout, TrainBatch, build_batch, group_rollouts
from trainer.checkpoints import (
    CHECKPOINT_DIR,
    atomic_write_json,
    complete_checkpoints,
    prune_checkpoints,
    read_published,
    write_published,
)
from trainer.config import TrainerConfig
from trainer.dcp_checkpoint import (
    SHARDED_DIR,
    load_full_checkpoint,
    load_sharded,
    save_sharded,
)
from trainer.distributed import KEEPALIVE_S, DistContext
from trainer.engine import Engine, make_engine
from trainer.filtering import GroupFilter
from trainer.loss import (
    admission_mask,
    behaviour_weights,
    effective_sample_size,
    entropy_bonus,
    ess_lr_scale,
    group_advantages,
    policy_loss,
    sequence_ratio_sums,
    token_logprobs,
    token_logprobs_and_entropy,
    weight_stats,
)
from trainer.metrics import IdleClock, MetricsWriter
from trainer.microbatch import MicroBatch, plan_micro_batches
from trainer.monitors import GradSpikeGuard, monitor_from_config
from trainer.pipeline import PublicationSlot, RolloutFeed
from trainer.rollback import StepSnapshot, kl_k3_sums
from trainer.sources import Publisher, RolloutSource, VersionNotNewer

log = logging.getLogger(__name__)
T = TypeVar("T")

#: :class:`~trainer.loss.WeightStats` sums accumulated over a step's minibatches.
_WEIGHT_SUMS = (
    "kl_sum", "kl_k1_sum", "m2_sum", "modified", "zeroed_tokens", "w_sum", "w_sq_sum", "units",
    "tokens",
)  # fmt: skip


class Trainer:
    """The learner. Build with :meth:`setup`; drive with :meth:`run` or :meth:`train_step`."""

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
        self.config = config
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        #: the leases' stop set: a completion is trained up to its first stop token
        self.stop_token_ids = frozenset(stop_token_ids or ()) | {eos_token_id}
        #: temperature/top-p/top-k of the leases: π_θ and π_prox come from the same processed
        #: distribution as the nodes' μ (trainer/loss.py processed_log_softmax)
        self.processing = config.processing
        self.dist = dist or DistContext()
        #: how the model runs: one process, or FSDP2 over the ranks (see :mod:`trainer.engine`).
        self.engine = engine or Engine(self.dist)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
        )
        self.out_dir = Path(config.out_dir)
        self.metrics = metrics
        #: optimizer steps (learner steps) done.
        self.step = 0
        #: version of the current weights.
        self.version = 0
        #: last version handed to a publisher (None: nothing published yet).
        self.published_version: int | None = None
        #: publish the current weights when :meth:`run` starts (see :meth:`sync_published`).
        self._publish_first = False
        self._stop_requested = False
        self._feed: RolloutFeed | None = None
        #: a step is running in the worker thread (the feed then fetches for the next version)
        self._training = False
        #: highest rollout ``seq`` fetched; see :attr:`cursor` for the resumable one.
        self._fetched = 0
        self._pending: dict[str, list[Rollout]] = {}
        self._dropped_at_fetch = 0
        #: rewards of the rollouts of uniform-reward groups left out (``filter_groups``), not yet
        #: reported: the step's reward figures cover what it consumed, not only what it trained on
        self._uniform_rewards: list[float] = []
        #: rollouts consumed per step (trained + left out as uniform), moving average (weight
        #: 0.2): B as the coordinator's capacity plan needs it when ``filter_groups`` is on
        self._consumed: float | None = None
        self.idle = IdleClock(window_s=config.idle_window_s)
        #: T_train: exponential moving average of the time in train_step (weight 0.2 per step)
        self.t_train_s: float | None = None
        #: running mean of the squared step time (same weight): T_train's variability
        self._t_train_sq: float | None = None
        #: seconds the last publication took (weights copied -> the publisher returned)
        self.publish_s: float | None = None
        #: publications deferred because the previous one was still in flight
        self.publish_deferred = 0
        #: rolling stability checks; each step's record carries its ``stability_warning``.
        self.monitor = monitor_from_config(config)
        self.spike_guard = GradSpikeGuard(config.grad_spike_factor)
        #: learner steps undone because they moved the policy more than ``max_step_kl``
        self.rollbacks = 0
        #: called with each step's metrics record (after it is written), e.g. to report upstream.
        self.on_step: list[Callable[[dict[str, Any]], None]] = []

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
            model = build_model(spec, seed=config.seed)
        model = engine.prepare(model, _resolve_device(config.device, dist))
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
        leader = self.dist.is_leader
        feed: RolloutFeed | None = None
        if leader:
            batch_size = cfg.batch_prompts * cfg.group_size
            feed = RolloutFeed(
                source,
                after=self._fetched,
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
        self._feed = feed
        slot = PublicationSlot()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-step")
        threads = torch.get_num_threads()
        try:
            if has_publisher and first:
                await self._blocking_publish(publisher)
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
            if feed is not None:
                await feed.stop()
            executor.shutdown(wait=True)
        if self._writes_checkpoints and (self._stop_requested or self.step % cfg.checkpoint_every):
            self.save_checkpoint()

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
        while True:
            # A group that became too stale while incomplete will never be trained on.
            for gid in [k for k, g in self._pending.items() if self._too_stale(g[0])]:
                self._dropped_at_fetch += len(self._pending.pop(gid))
            complete = [k for k, g in self._pending.items() if len(g) >= cfg.group_size]
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
                        pick.offer(gid, [r.reward for r in self._pending[gid][: cfg.group_size]])
                if pick.done:
                    train, drop = pick.chosen()
                    for gid in drop:
                        group = self._pending.pop(gid)[: cfg.group_size]
                        self._uniform_rewards.extend(float(r.reward) for r in group)
                    return self._pop_groups(train)
                need = pick.missing * cfg.group_size
            t0 = time.monotonic()
            items = await feed.take(need, cfg.fetch_timeout_s)
            self._dropped_at_fetch += feed.take_dropped()
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
                self._fetched = max(self._fetched, r.seq)
                if self._too_stale(r):
                    self._dropped_at_fetch += 1
                    continue
                self._pending.setdefault(r.group_id, []).append(r)

    def _pop_groups(self, group_ids: Sequence[str]) -> list[Rollout]:
        batch: list[Rollout] = []
        for gid in group_ids:
            batch.extend(self._pending.pop(gid)[: self.config.group_size])
        return batch

    def _too_stale(self, rollout: Rollout) -> bool:
        return self.version - rollout.policy_version > self.config.max_staleness

    @property
    def cursor(self) -> int:
        """Resumable cursor: every rollout with ``seq ≤ cursor`` was trained on or dropped."""
        pending = [r.seq for g in self._pending.values() for r in g]
        return min(pending) - 1 if pending else self._fetched

    # ------------------------------------------------------------------ one step
    def train_step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One learner step on ``rollouts`` (complete groups): advantages over each whole group,
        admission Δ ≤ S, then ``ppo_epochs`` × ``minibatches`` optimizer updates. Returns the
        step's metrics (also written to metrics.jsonl on rank 0).

        With several ranks every rank calls it; rank 0's ``rollouts`` count (it scatters each
        rank its share of the groups) and its returned record is the complete one."""
        cfg = self.config
        t0, started_at = time.monotonic(), time.time()
        groups = group_rollouts(rollouts)
        flat = [r for g in groups for r in g]
        rewards = torch.tensor([float(r.reward) for r in flat], dtype=torch.float64)
        gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g], dtype=torch.long)
        adv = group_advantages(
            rewards, gidx, std_normalize=cfg.std_normalize, eps=cfg.adv_eps
        ).tolist()
        staleness = [self.version - r.policy_version for r in flat]
        admitted = admission_mask(torch.tensor(staleness), cfg.max_staleness).tolist()

        # Admitted samples, still grouped: a minibatch (and a rank's shard) holds whole groups.
        kept: list[list[tuple[Rollout, float, int]]] = []
        pos = 0
        for g in groups:
            items = [(flat[pos + j], adv[pos + j], staleness[pos + j]) for j in range(len(g))]
            kept_g = [it for it, ok in zip(items, admitted[pos : pos + len(g)], strict=True) if ok]
            if kept_g:
                kept.append(kept_g)
            pos += len(g)

        sums: defaultdict[str, float] = defaultdict(float)
        minibatches = self._local_minibatches(kept)
        plans = self._micro_plans(minibatches)
        prox = self._proximal(minibatches, plans)  # π_prox: weights before the first update
        weights = [self._weights(mb, p, sums) for mb, p in zip(minibatches, prox, strict=True)]
        params = [p for p in self.model.parameters() if p.requires_grad]
        snapshot = (
            StepSnapshot.take(params, self.optimizer) if cfg.max_step_kl is not None else None
        )
        updates = 0
        for _epoch in range(cfg.ppo_epochs):
            for mb, plan, p, w in zip(minibatches, plans, prox, weights, strict=True):
                updates += self._update(mb, plan, p, w, sums)
        step_kl = None
        if snapshot is not None:
            step_kl = self._step_kl(minibatches, plans, prox)
            if cfg.max_step_kl is not None and step_kl > cfg.max_step_kl:
                snapshot.restore(params, self.optimizer)
                self.rollbacks += 1
                log.warning(
                    "step %d moved the policy by %.3g nats/token (> max_step_kl %.3g): undone",
                    self.step + 1, step_kl, cfg.max_step_kl,
                )  # fmt: skip

        self.step += 1
        self.version += 1
        step_time = time.monotonic() - t0
        self.idle.add_busy(step_time)
        self.idle.mark()
        self.t_train_s = (
            step_time if self.t_train_s is None else 0.8 * self.t_train_s + 0.2 * step_time
        )
        sq = step_time * step_time
        self._t_train_sq = sq if self._t_train_sq is None else 0.8 * self._t_train_sq + 0.2 * sq
        record = self._record(flat, staleness, admitted, sums, updates, step_time)
        record["step_kl"] = step_kl
        record["rolled_back"] = step_kl is not None and step_kl > (cfg.max_step_kl or 0.0)
        record["rollbacks"] = self.rollbacks
        if cfg.trace_rollouts:
            record["trace"] = self._trace(flat, started_at)
        record["stability_warning"] = self.monitor.observe(record)
        if self.metrics is not None:
            self.metrics.write(record)
        for callback in self.on_step:
            callback(record)
        return record

    def _trace(self, flat: Sequence[Rollout], started_at: float) -> dict[str, Any]:
        """The step's part of the per-rollout age breakdown (``trace_rollouts``): when it started
        and ended (Unix time; its end is when the new version's weights exist) and, per rollout,
        ``[seq, policy_version, fetched_at]`` (fetched_at: when the feed received it, null if
        unknown)."""
        stamps = self._feed.fetched_at if self._feed is not None else None
        rows = []
        for r in flat:
            at = stamps.pop(r.seq, None) if stamps is not None else None
            rows.append([r.seq, r.policy_version, None if at is None else round(at, 4)])
        if stamps:  # forget the ones dropped before training (all below the resume cursor)
            cursor = self.cursor  # (the feed adds stamps on the event loop meanwhile)
            for seq in [s for s in list(stamps) if s <= cursor]:
                stamps.pop(seq, None)
        return {"start": round(started_at, 4), "end": round(time.time(), 4), "rollouts": rows}

    @property
    def t_train_cv(self) -> float | None:
        """Coefficient of variation of the step time (running, weight 0.2): on a shared machine
        a step takes 0.3–0.8 s where T_train is 0.5, and a learner whose steps vary outruns its
        rollouts after the short ones (docs/capacity.md, the fluid model)."""
        if self.t_train_s is None or self._t_train_sq is None or self.t_train_s <= 0:
            return None
        var = max(0.0, self._t_train_sq - self.t_train_s * self.t_train_s)
        return math.sqrt(var) / self.t_train_s

    def _local_minibatches(
        self, kept: list[list[tuple[Rollout, float, int]]]
    ) -> list[TrainBatch | None]:
        """Seeded shuffle of the groups, split into ``minibatches`` parts; rank ``r`` trains on
        the groups ``part[r::world]`` of each part, which rank 0 scatters (so the sharded run
        takes the single-process run's minibatches)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
        order = torch.randperm(len(kept), generator=gen).tolist() if len(kept) > 1 else [0]
        order = order[: len(kept)]
        n_mb = min(cfg.minibatches, max(1, len(kept)))
        parts = [order[i * len(order) // n_mb : (i + 1) * len(order) // n_mb] for i in range(n_mb)]
        world = self.dist.world_size
        per_rank = [
            [[it for gi in part[r::world] for it in kept[gi]] for part in parts]
            for r in range(world)
        ]
        shares = self.dist.scatter(per_rank if self.dist.is_leader else None)
        out: list[TrainBatch | None] = []
        for local in shares:
            if not local:
                out.append(None)
                continue
            batch = build_batch(
                [it[0] for it in local],
                [it[1] for it in local],
                [it[2] for it in local],
                pad_token_id=self.pad_token_id,
                eos_token_id=self.stop_token_ids,
            )
            out.append(batch.to(self.device))
        return out

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, batch: TrainBatch, *, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """``[N, T]`` log π_θ of the completion tokens (and their entropy); ``batch`` is on the
        model's device."""
        t_len = batch.completion_ids.shape[1]
        with self.engine.autocast():
            out = self.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=t_len + 1,
            )
        logits = out.logits[:, :-1]
        if entropy:
            logp, ent = token_logprobs_and_entropy(logits, batch.completion_ids, **self.processing)
            return logp, ent
        return token_logprobs(logits, batch.completion_ids, **self.processing), None

    def _micro_plans(self, minibatches: list[TrainBatch | None]) -> list[list[MicroBatch | None]]:
        """Each minibatch's micro-batches (``micro_batch_tokens``); every rank runs as many
        passes per minibatch as the rank with the most (None: a pass that contributes nothing)."""
        plans: list[list[MicroBatch | None]] = [
            [] if mb is None else list(plan_micro_batches(mb, self.config.micro_batch_tokens))
            for mb in minibatches
        ]
        counts = self.dist.max_ints([len(p) for p in plans])
        return [p + [None] * (c - len(p)) for p, c in zip(plans, counts, strict=True)]

    @torch.no_grad()
    def _proximal(
        self, minibatches: list[TrainBatch | None], plans: list[list[MicroBatch | None]]
    ) -> list[Tensor | None]:
        """log π_prox: the weights before this step's first update, recomputed by the trainer."""
        out: list[Tensor | None] = []
        for mb, plan in zip(minibatches, plans, strict=True):
            prox = None if mb is None else torch.zeros_like(mb.completion_mask)
            for micro in plan:
                if micro is None:
                    self.engine.pad_pass(self.model, backward=False)
                    continue
                assert prox is not None
                prox[micro.rows, : micro.width] = self._forward(micro.batch, entropy=False)[0]
            out.append(prox)
        return out

    @torch.no_grad()
    def _step_kl(
        self,
        minibatches: list[TrainBatch | None],
        plans: list[list[MicroBatch | None]],
        prox: list[Tensor | None],
    ) -> float:
        """How far this step moved the policy on its own tokens (rollback.kl_k3_sums), one
        forward pass per micro-batch after the updates; the same value on every rank."""
        kl_sum = tokens = 0.0
        for mb, plan, p in zip(minibatches, plans, prox, strict=True):
            for micro in plan:
                if micro is None:
                    self.engine.pad_pass(self.model, backward=False)
                    continue
                assert mb is not None and p is not None
                new = self._forward(micro.batch, entropy=False)[0]
                k, n = kl_k3_sums(new, micro.take(p), micro.batch.completion_mask)
                kl_sum += k
                tokens += n
        kl_sum, tokens = self.dist.sum_floats([kl_sum, tokens])
        return kl_sum / tokens if tokens > 0 else 0.0

    def _weights(
        self, mb: TrainBatch | None, prox: Tensor | None, sums: defaultdict[str, float]
    ) -> Tensor | None:
        if mb is None or prox is None:
            return None
        cfg = self.config
        bw = behaviour_weights(
            prox,
            mb.behaviour_logprobs,
            mb.completion_mask,
            mb.staleness,
            cap=cfg.weight_cap,
            mode=cfg.weight_mode,
            level=cfg.weight_level,
            decay=cfg.staleness_decay,
            cap_low=cfg.weight_cap_low,
            m2_threshold=cfg.m2_threshold,
        )
        st = weight_stats(prox, mb.behaviour_logprobs, mb.completion_mask, bw, cfg.weight_level)
        for key in _WEIGHT_SUMS:
            sums[key] += getattr(st, key)
        return bw.weights

    def _update(
        self,
        mb: TrainBatch | None,
        plan: list[MicroBatch | None],
        prox: Tensor | None,
        weights: Tensor | None,
        sums: defaultdict[str, float],
    ) -> int:
        """One optimizer update on a (global) minibatch, gradients accumulated over its
        micro-batches (reduced over ranks by the engine); returns 1 if an update was attempted
        (applied, or skipped by the gradient-spike guard: counted in ``skipped_updates``)."""
        cfg = self.config
        local_tokens = float(mb.completion_mask.sum()) if mb is not None else 0.0
        (global_tokens,) = self.dist.sum_floats([local_tokens])
        if global_tokens <= 0:
            return 0
        self.optimizer.zero_grad(set_to_none=True)
        for micro in plan:
            if micro is None:
                self.engine.pad_pass(self.model, backward=True)
                continue
            assert prox is not None and weights is not None
            part = micro.batch
            logp, ent = self._forward(part, entropy=True)
            assert ent is not None
            pl = policy_loss(
                logp,
                micro.take(prox),
                part.advantages,
                micro.take(weights),
                part.completion_mask,
                eps=cfg.clip_eps,
                eps_high=cfg.eps_high,
                normalizer=global_tokens,
            )
            ent_mask = part.completion_mask
            if cfg.entropy_groups == "informative":  # the bonus only where the policy term acts
                ent_mask = ent_mask * (part.advantages != 0).to(ent_mask.dtype).unsqueeze(-1)
            loss = pl.loss + entropy_bonus(
                ent,
                ent_mask,
                coef=cfg.entropy_coef,
                normalizer=global_tokens,
            )
            loss.backward()  # type: ignore[no-untyped-call]
            sums["loss"] += float(loss.detach())
            sums["entropy_sum"] += float((ent.detach() * part.completion_mask).sum())
            sums["clipped"] += float(pl.clipped_tokens)
            sums["update_tokens"] += float(part.completion_mask.sum())
        if cfg.max_grad_norm is not None or cfg.grad_spike_factor is not None:
            # the norm is the global one on every rank, so every rank skips the same updates
            clip_to = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
            norm = self.engine.clip_grad_norm(self.model, clip_to)
            sums["grad_norm"] += norm / max(1, self.dist.world_size)
            if self.spike_guard.skip(norm):
                sums["skipped_updates"] += 1.0 / max(1, self.dist.world_size)
                self.optimizer.zero_grad(set_to_none=True)
                return 1
        scale = 1.0
        if cfg.ess_lr_scaling:  # otherwise the optimizer's learning rate is left as it is
            scale = self._ess_lr_scale(mb, prox)
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * scale
        sums["lr_scale"] += scale
        self.optimizer.step()
        return 1

    def _ess_lr_scale(self, mb: TrainBatch | None, prox: Tensor | None) -> float:
        """VCPO's factor from the (global) minibatch's sequence-level ESS; identical on every
        rank because the sums are all-reduced."""
        local = (0.0, 0.0, 0.0)
        if mb is not None and prox is not None:
            local = sequence_ratio_sums(prox, mb.behaviour_logprobs, mb.completion_mask)
        w_sum, w_sq_sum, n = self.dist.sum_floats(list(local))
        return ess_lr_scale(w_sum, w_sq_sum, n)

    def _record(
        self,
        flat: Sequence[Rollout],
        staleness: Sequence[int],
        admitted: Sequence[bool],
        sums: defaultdict[str, float],
        updates: int,
        step_time: float,
    ) -> dict[str, Any]:
        keys = [
            *_WEIGHT_SUMS, "loss", "entropy_sum", "clipped", "update_tokens", "grad_norm",
            "lr_scale", "skipped_updates",
        ]  # fmt: skip
        g = dict(zip(keys, self.dist.sum_floats([sums[k] for k in keys]), strict=True))
        uniform, self._uniform_rewards = self._uniform_rewards, []
        # what the step consumed: its batch and the uniform groups left out (filter_groups), so
        # that the reward figures follow the policy, not the filter
        rewards = [float(r.reward) for r in flat] + uniform
        n = max(1, len(rewards))
        hist = Counter(staleness)
        dropped = len(flat) - sum(admitted) + self._dropped_at_fetch
        self._dropped_at_fetch = 0
        consumed = len(rewards)
        last = self._consumed
        self._consumed = consumed if last is None else 0.8 * last + 0.2 * consumed
        batch_rollouts = self.config.batch_prompts * self.config.group_size
        tokens = max(1.0, g["tokens"])
        ess = effective_sample_size(g["w_sum"], g["w_sq_sum"])
        return {
            "step": self.step,
            "version": self.version,
            "published_version": self.published_version,
            "rollouts": len(flat),
            "admitted": int(sum(admitted)),
            "dropped_stale": dropped,
            # filter_groups: rollouts of groups with one reward for all samples, left out
            "dropped_uniform": len(uniform),
            "reward_mean": sum(rewards) / n,
            "reward_full_frac": sum(1 for x in rewards if x >= 1.0 - 1e-9) / n,
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "loss": g["loss"] / max(1, updates),
            "entropy": g["entropy_sum"] / max(1.0, g["update_tokens"]),
            "clip_frac": g["clipped"] / max(1.0, g["update_tokens"]),
            "mismatch_kl": g["kl_sum"] / tokens,
            "mismatch_kl_k1": g["kl_k1_sum"] / tokens,
            "mismatch_m2": g["m2_sum"] / tokens,
            "weight_modified_frac": g["modified"] / max(1.0, g["units"]),
            "mask_frac": g["zeroed_tokens"] / tokens,
            "ess": ess,
            "ess_frac": ess / g["units"] if g["units"] > 0 else 0.0,
            "grad_norm": g["grad_norm"] / max(1, updates),
            # mean learning-rate factor of the applied updates (< 1 only with ess_lr_scaling);
            # every rank applies the same factor, so the sum counts it world_size times
            "lr_scale": g["lr_scale"]
            / max(1, (updates - round(g["skipped_updates"])) * self.dist.world_size),
            "skipped_updates": round(g["skipped_updates"]),
            "updates": updates,
            "step_time_s": step_time,
            "t_train_s": self.t_train_s,
            "t_train_cv": self.t_train_cv,
            # B, rollouts consumed per step (more than the batch when groups are filtered)
            "batch_rollouts": (
                max(batch_rollouts, round(self._consumed))
                if self.config.filter_groups
                else batch_rollouts
            ),
            "completion_tokens": int(g["tokens"]),
            "publish_s": self.publish_s,
            "publish_deferred": self.publish_deferred,
            **self._idle_figures(),
        }

    def _idle_figures(self) -> dict[str, float]:
        """``idle_frac`` and its breakdown over the window; cumulative seconds since run()."""
        out = {"idle_frac": self.idle.fraction()}
        out.update({f"idle_{k}_frac": v for k, v in self.idle.breakdown().items()})
        out.update(self.idle.totals())
        return out

    # ------------------------------------------------------------------ publish / checkpoint
    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """Detached CPU copies of the current weights (every key, tied ones included). Sharded,
        a collective: every rank calls it, rank 0 gets the gathered weights, the others ``{}``."""
        return self.engine.full_state_dict(self.model)

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

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (a ``.tmp`` one left by a crash mid-save is not)."""
        done = complete_checkpoints(self.out_dir / CHECKPOINT_DIR)
        return done[-1] if done else None

    def save_checkpoint(self, path: Path | None = None) -> Path:
        """Write weights, optimizer, step, version, published version and rollout cursor to a new
        directory (atomically renamed into place); keep the last ``keep_checkpoints``.

        Sharded (several ranks), a collective: every rank writes its shards with
        ``torch.distributed.checkpoint`` (:mod:`trainer.dcp_checkpoint`), rank 0 the rest."""
        from safetensors.torch import save_model

        root = self.out_dir / CHECKPOINT_DIR
        final = path or root / f"step-{self.step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        leader = self.dist.is_leader
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.engine.sharded:
            self.dist.barrier()  # the directory is fresh before any rank writes into it
            save_sharded(tmp / SHARDED_DIR, self.model, self.optimizer)
        else:
            save_model(self.model, str(tmp / "model.safetensors"))
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        if leader:
            state = {
                "step": self.step,
                "version": self.version,
                "published_version": self.published_version,
                "cursor": self.cursor,
                "world_size": self.dist.world_size,
                "config": self.config.model_dump(),
            }
            atomic_write_json(tmp / "state.json", state)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            if path is None:
                prune_checkpoints(root, self.config.keep_checkpoints)
        self.dist.barrier()  # no rank goes on (to read it, or to the next save) before it is done
        return final

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`. The version becomes
        ``max(saved version, last published version)`` so it never goes back. The optimizer's
        moments come back; its learning rate, weight decay and β2 are this run's config's.

        Any number of ranks loads any checkpoint: a sharded one is resharded by
        ``torch.distributed.checkpoint``; a single-process one is split over the ranks."""
        from safetensors.torch import load_file, load_model

        state = json.loads((path / "state.json").read_text())
        if (path / SHARDED_DIR).is_dir():
            load_sharded(path / SHARDED_DIR, self.model, self.optimizer)
        elif self.engine.sharded:
            opt_state = torch.load(path / "optimizer.pt", weights_only=True)
            model_state = load_file(str(path / "model.safetensors"))
            load_full_checkpoint(self.model, self.optimizer, model_state, opt_state)
        else:
            load_model(self.model, str(path / "model.safetensors"))
            opt_state = torch.load(path / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(opt_state)
        for group in self.optimizer.param_groups:  # the config wins over the saved values
            group["lr"] = self.config.lr
            group["weight_decay"] = self.config.weight_decay
            group["betas"] = (self.config.adam_beta1, self.config.adam_beta2)
        self.step = int(state["step"])
        published = state.get("published_version")
        logged = read_published(self.out_dir)
        if logged is not None:
            published = logged if published is None else max(int(published), logged)
        self.published_version = None if published is None else int(published)
        self.version = max(int(state["version"]), self.published_version or 0, self.version)
        self._fetched = int(state["cursor"])
        self._pending.clear()


def _train_in_thread(trainer: Trainer, batch: list[Rollout], threads: int) -> None:
    """:meth:`Trainer.train_step` on the step thread, with the loop thread's torch thread count."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    trainer.train_step(batch)


def _resolve_device(name: str, dist: DistContext) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if dist.enabled:  # this rank's GPU under NCCL; the CPU under gloo
        return torch.device(dist.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
