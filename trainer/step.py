"""One learner step: :meth:`LearnerStep.train_step` and the passes it is made of.

:class:`LearnerStep` receives everything it uses (model, optimizer, engine, the ranks, the
monitors, the metrics writer and the recipe's counters, :mod:`trainer.progress`) as constructor
arguments; :class:`trainer.recipe.Trainer` builds it. Read top to bottom: ``train_step``
computes the group advantages and admits Δ ≤ S; ``_local_minibatches`` splits the groups over
minibatches (and ranks); ``_proximal`` recomputes log π_prox before the first update;
``_weights`` turns π_prox and the nodes' log μ into behaviour weights
(:func:`trainer.loss.behaviour_weights`); ``_update`` is one optimizer update over a minibatch's
micro-batches; ``_step_kl`` measures the step's move for the rollback; ``_record`` is the step's
metrics record.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.adaptive_lr import next_lr_factor
from trainer.batch import Rollout, TrainBatch, build_batch, group_rollouts
from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.engine import Engine
from trainer.loss import (
    admission_mask,
    behaviour_weights,
    effective_sample_size,
    entropy_bonus,
    ess_lr_scale,
    group_advantages,
    policy_loss,
    second_moment_keep,
    sequence_ratio_sums,
    shared_log_ratio,
    support_mask,
    token_logprobs,
    token_logprobs_and_entropy,
    weight_stats,
)
from trainer.metrics import IdleClock, MetricsWriter
from trainer.microbatch import MicroBatch, plan_micro_batches
from trainer.monitors import GradSpikeGuard, StabilityMonitor
from trainer.progress import LearnerProgress, PendingRollouts, StepTiming
from trainer.rollback import StepSnapshot, kl_k3_sums

log = logging.getLogger(__name__)

#: :class:`~trainer.loss.WeightStats` sums accumulated over a step's minibatches.
_WEIGHT_SUMS = (
    "kl_sum", "kl_k1_sum", "m2_sum", "modified", "zeroed_tokens", "w_sum", "w_sq_sum", "units",
    "tokens", "support_tokens", "out_of_support",
)  # fmt: skip


class LearnerStep:
    """One learner step over the model and optimizer it is given. It owns no counters: the
    recipe's :class:`~trainer.progress.LearnerProgress`, :class:`~trainer.progress.PendingRollouts`
    and :class:`~trainer.progress.StepTiming` are handed in, and it advances them."""

    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        engine: Engine,
        dist: DistContext,
        pad_token_id: int,
        stop_token_ids: frozenset[int],
        progress: LearnerProgress,
        pending: PendingRollouts,
        timing: StepTiming,
        monitor: StabilityMonitor,
        spike_guard: GradSpikeGuard,
        metrics: MetricsWriter | None = None,
        on_step: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.engine = engine
        self.dist = dist
        self.pad_token_id = pad_token_id
        #: the leases' stop set: a completion is trained up to its first stop token
        self.stop_token_ids = stop_token_ids
        #: temperature/top-p/top-k of the leases: π_θ and π_prox come from the same processed
        #: distribution as the nodes' μ (trainer/loss.py processed_log_softmax)
        self.processing = config.processing
        self.progress = progress
        self.pending = pending
        self.timing = timing
        self.monitor = monitor
        self.spike_guard = spike_guard
        self.metrics = metrics
        #: called with each step's record (after it is written); the recipe's list, so that a
        #: callback added later is called too
        self.on_step = on_step

    def train_step(
        self,
        rollouts: Sequence[Rollout],
        *,
        idle: IdleClock,
        fetched_at: dict[int, float] | None = None,
    ) -> dict[str, Any]:
        """One learner step on ``rollouts`` (complete groups): advantages over each whole group,
        admission Δ ≤ S, then ``ppo_epochs`` × ``minibatches`` optimizer updates. Returns the
        step's metrics (also written to metrics.jsonl on rank 0).

        What belongs to the run rather than to the step comes with each call: ``idle``, the run's
        :class:`~trainer.metrics.IdleClock` (the step's time is counted busy, and the record
        carries its idle figures), and ``fetched_at``, the feed's arrival times by ``seq`` when
        ``trace_rollouts`` is on (the step pops the ones it trained; None: unknown).

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
        staleness = [self.progress.version - r.policy_version for r in flat]
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
        minibatches, rows = self._local_minibatches(kept)
        plans = self._micro_plans(minibatches)
        prox = self._proximal(minibatches, plans)  # π_prox: weights before the first update
        weights = [
            self._weights(mb, p, r, sums) for mb, p, r in zip(minibatches, prox, rows, strict=True)
        ]
        # after the π_prox forward (FSDP2 keeps the root unsharded): the snapshot reshards first
        snapshot = (
            StepSnapshot.take(self.model, self.optimizer) if cfg.max_step_kl is not None else None
        )
        updates = 0
        for _epoch in range(cfg.ppo_epochs):
            for mb, plan, p, w in zip(minibatches, plans, prox, weights, strict=True):
                updates += self._update(mb, plan, p, w, sums)
        step_kl = None
        rolled_back = False
        lr_factor = self.progress.lr_factor  # the factor this step's updates used
        if snapshot is not None or cfg.target_step_kl is not None:
            step_kl = self._step_kl(minibatches, plans, prox)
            if snapshot is not None and cfg.max_step_kl is not None and step_kl > cfg.max_step_kl:
                snapshot.restore(self.model, self.optimizer)
                rolled_back = True
                self.progress.rollbacks += 1
                log.warning(
                    "step %d moved the policy by %.3g nats/token (> max_step_kl %.3g): undone",
                    self.progress.step + 1, step_kl, cfg.max_step_kl,
                )  # fmt: skip

        self.progress.step += 1
        self.progress.version += 1
        step_time = time.monotonic() - t0
        idle.add_busy(step_time)
        idle.mark()
        self.timing.add_step(step_time)
        record = self._record(flat, staleness, admitted, sums, updates, step_time)
        record.update(_idle_figures(idle))
        record["step_kl"] = step_kl
        record["rolled_back"] = rolled_back
        record["rollbacks"] = self.progress.rollbacks
        record["lr_factor"] = lr_factor
        self._adapt_lr(record, updates)
        if cfg.trace_rollouts:
            record["trace"] = self._trace(flat, started_at, fetched_at)
        record["stability_warning"] = self.monitor.observe(record)
        if self.metrics is not None:
            self.metrics.write(record)
        for callback in self.on_step:
            callback(record)
        return record

    def _adapt_lr(self, record: dict[str, Any], updates: int) -> None:
        """The KL-adaptive learning rate (trainer/adaptive_lr.py): the next step's factor from
        this step's move (``target_step_kl``) or mismatch (``target_mismatch_kl``)."""
        cfg = self.config
        if not updates:  # nothing was trained: no evidence about the step size
            return
        if cfg.target_step_kl is not None and record["step_kl"] is not None:
            signal, target = float(record["step_kl"]), cfg.target_step_kl
        elif cfg.target_mismatch_kl is not None:
            signal, target = float(record["mismatch_kl"]), cfg.target_mismatch_kl
        else:
            return
        self.progress.lr_factor = next_lr_factor(
            self.progress.lr_factor, signal, target, change=cfg.adaptive_lr_change,
            low=cfg.adaptive_lr_min, high=cfg.adaptive_lr_max,
        )  # fmt: skip

    def _trace(
        self, flat: Sequence[Rollout], started_at: float, stamps: dict[int, float] | None
    ) -> dict[str, Any]:
        """The step's part of the per-rollout age breakdown (``trace_rollouts``): when it started
        and ended (Unix time; its end is when the new version's weights exist) and, per rollout,
        ``[seq, policy_version, fetched_at]`` (fetched_at: when the feed received it, null if
        unknown)."""
        rows = []
        for r in flat:
            at = stamps.pop(r.seq, None) if stamps is not None else None
            rows.append([r.seq, r.policy_version, None if at is None else round(at, 4)])
        if stamps:  # forget the ones dropped before training (all below the resume cursor)
            cursor = self.pending.cursor  # (the feed adds stamps on the event loop meanwhile)
            for seq in [s for s in list(stamps) if s <= cursor]:
                stamps.pop(seq, None)
        return {"start": round(started_at, 4), "end": round(time.time(), 4), "rollouts": rows}

    def _local_minibatches(
        self, kept: list[list[tuple[Rollout, float, int]]]
    ) -> tuple[list[TrainBatch | None], list[Tensor | None]]:
        """Seeded shuffle of the groups, split into ``minibatches`` parts; rank ``r`` trains on
        the groups ``part[r::world]`` of each part, which rank 0 scatters (so the sharded run
        takes the single-process run's minibatches). Also returns, per minibatch, the ``[n]``
        row each of this rank's sequences has in the whole minibatch (the single-process
        batch's order: groups as in the part, samples as in the group)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.progress.step)
        order = torch.randperm(len(kept), generator=gen).tolist() if len(kept) > 1 else [0]
        order = order[: len(kept)]
        n_mb = min(cfg.minibatches, max(1, len(kept)))
        parts = [order[i * len(order) // n_mb : (i + 1) * len(order) // n_mb] for i in range(n_mb)]
        first_row: dict[int, int] = {}  # group → its first row in its part's whole minibatch
        for part in parts:
            row = 0
            for gi in part:
                first_row[gi] = row
                row += len(kept[gi])
        world = self.dist.world_size
        per_rank = [
            [
                [(*it, first_row[gi] + j) for gi in part[r::world] for j, it in enumerate(kept[gi])]
                for part in parts
            ]
            for r in range(world)
        ]
        shares = self.dist.scatter(per_rank if self.dist.is_leader else None)
        out: list[TrainBatch | None] = []
        rows: list[Tensor | None] = []
        for local in shares:
            if not local:
                out.append(None)
                rows.append(None)
                continue
            batch = build_batch(
                [it[0] for it in local],
                [it[1] for it in local],
                [it[2] for it in local],
                pad_token_id=self.pad_token_id,
                eos_token_id=self.stop_token_ids,
            )
            out.append(batch.to(self.device))
            rows.append(torch.tensor([it[3] for it in local], dtype=torch.long))
        return out, rows

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
        forward pass per micro-batch after the updates; the same value on every rank. Over the
        tokens both π_prox and π_new support (trainer.loss.support_mask): with top-k/top-p a
        token the step took into its support or out of it has an infinite KL term (e^60 ≈ 1e26
        or 59 at the ±60 clamp), which would undo the step or cut the learning rate."""
        kl_sum = tokens = 0.0
        for mb, plan, p in zip(minibatches, plans, prox, strict=True):
            for micro in plan:
                if micro is None:
                    self.engine.pad_pass(self.model, backward=False)
                    continue
                assert mb is not None and p is not None
                new = self._forward(micro.batch, entropy=False)[0]
                old = micro.take(p)
                both = support_mask(new, old, micro.batch.completion_mask)
                k, n = kl_k3_sums(new, old, both)
                kl_sum += k
                tokens += n
        kl_sum, tokens = self.dist.sum_floats([kl_sum, tokens])
        return kl_sum / tokens if tokens > 0 else 0.0

    def _weights(
        self,
        mb: TrainBatch | None,
        prox: Tensor | None,
        rows: Tensor | None,
        sums: defaultdict[str, float],
    ) -> Tensor | None:
        """The minibatch's behaviour weights (``[n, T]``, this rank's rows); a collective with
        ``m2_threshold`` (every rank calls it, with or without rows of its own)."""
        cfg = self.config
        keep = None
        if cfg.m2_threshold is not None:
            keep = self._m2_keep(mb, prox, rows, cfg.m2_threshold)
        if mb is None or prox is None:
            return None
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
            m2_keep=keep,
        )
        st = weight_stats(prox, mb.behaviour_logprobs, mb.completion_mask, bw, cfg.weight_level)
        for key in _WEIGHT_SUMS:
            sums[key] += getattr(st, key)
        return bw.weights

    def _m2_keep(
        self, mb: TrainBatch | None, prox: Tensor | None, rows: Tensor | None, threshold: float
    ) -> Tensor | None:
        """M2PO's mask (``[n, T]``, 1.0 kept) chosen over the whole minibatch, every rank's tokens:
        each rank's (log π_prox/μ)² and their places in the minibatch (row, token) are gathered
        and every rank runs :func:`~trainer.loss.second_moment_keep` on all of them, in the
        single-process order, so the mask (and the loss, ESS and update) do not depend on the
        number of ranks. A collective (every rank calls it, ``mb`` None when it has no rows)."""
        if mb is None or prox is None or rows is None:
            m2 = torch.zeros(0, dtype=torch.float64)
            keys = torch.zeros(0, dtype=torch.long)
        else:
            mask = mb.completion_mask
            # as behaviour_weights computes it: over the tokens both policies support
            shared = support_mask(prox, mb.behaviour_logprobs, mask)
            log_ratio = shared_log_ratio(prox, mb.behaviour_logprobs, shared)
            sel = shared > 0
            m2 = (log_ratio * log_ratio)[sel].double()  # float32 → float64: exact, same order
            t_idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
            row_idx = rows.to(mask.device).unsqueeze(-1).expand_as(mask)
            keys = (row_idx * (1 << 32) + t_idx)[sel]  # position in the single-process batch
        values_by_rank = self.dist.all_gather_1d(m2)
        keys_by_rank = self.dist.all_gather_1d(keys)
        values, all_keys = torch.cat(values_by_rank), torch.cat(keys_by_rank)
        by_position = torch.argsort(all_keys, stable=True)
        kept = torch.empty_like(values, dtype=torch.bool)
        kept[by_position] = second_moment_keep(values[by_position], threshold)
        if mb is None or prox is None:
            return None
        start = sum(int(v.numel()) for v in values_by_rank[: self.dist.rank])
        mask = mb.completion_mask
        keep = torch.zeros_like(mask)
        sel = support_mask(prox, mb.behaviour_logprobs, mask) > 0
        keep[sel] = kept[start : start + int(m2.numel())].to(mask.device, mask.dtype)
        return keep

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
        if cfg.ess_lr_scaling:
            scale = self._ess_lr_scale(mb, prox)
        adaptive = cfg.target_step_kl is not None or cfg.target_mismatch_kl is not None
        if cfg.ess_lr_scaling or adaptive:
            # otherwise the optimizer's learning rate is left as it is
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * self.progress.lr_factor * scale
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
        uniform, self.pending.uniform_rewards = self.pending.uniform_rewards, []
        # what the step consumed: its batch and the uniform groups left out (filter_groups), so
        # that the reward figures follow the policy, not the filter
        rewards = [float(r.reward) for r in flat] + uniform
        n = max(1, len(rewards))
        hist = Counter(staleness)
        dropped = len(flat) - sum(admitted) + self.pending.dropped_at_fetch
        self.pending.dropped_at_fetch = 0
        consumed = len(rewards)
        self.timing.add_consumed(consumed)
        batch_rollouts = self.config.batch_prompts * self.config.group_size
        tokens = max(1.0, g["tokens"])
        # the mismatch figures are over the tokens both policies support (trainer.loss
        # support_mask); the others are counted apart: out_of_support_*
        support = max(1.0, g["support_tokens"])
        ess = effective_sample_size(g["w_sum"], g["w_sq_sum"])
        return {
            "step": self.progress.step,
            "version": self.progress.version,
            "published_version": self.progress.published_version,
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
            "mismatch_kl": g["kl_sum"] / support,
            "mismatch_kl_k1": g["kl_k1_sum"] / support,
            "mismatch_m2": g["m2_sum"] / support,
            "out_of_support_tokens": round(g["out_of_support"]),
            "out_of_support_frac": g["out_of_support"] / tokens,
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
            "t_train_s": self.timing.t_train_s,
            "t_train_cv": self.timing.t_train_cv,
            # B, rollouts consumed per step (more than the batch when groups are filtered)
            "batch_rollouts": (
                max(batch_rollouts, round(self.timing.consumed or 0))
                if self.config.filter_groups
                else batch_rollouts
            ),
            "completion_tokens": int(g["tokens"]),
            "publish_s": self.progress.publish_s,
            "publish_deferred": self.progress.publish_deferred,
        }


def _idle_figures(idle: IdleClock) -> dict[str, float]:
    """``idle_frac`` and its breakdown over the window; cumulative seconds since the run began."""
    out = {"idle_frac": idle.fraction()}
    out.update({f"idle_{k}_frac": v for k, v in idle.breakdown().items()})
    out.update(idle.totals())
    return out
