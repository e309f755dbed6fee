"""The simulated learner: the trainer's loop (``trainer.recipe.Trainer.run``) in virtual time.

It fetches accepted rollouts from the real coordinator (``Coordinator.fetch_rollouts``, the
``rswarm/fetch`` handler's call), keeps them by group (``lease_id/prompt_id``, as
``trainer.main`` names groups), drops rollouts and incomplete groups that fell more than S
versions behind (``Trainer._next_batch``), takes ``B / G`` complete groups oldest first, admits
them with :func:`admitted` (0 ≤ Δ ≤ S: the rule of :func:`trainer.loss.admission_mask`, which the
coordinator may not import; a test holds the two equal), and spends the step time. Every κ
versions it publishes (the coordinator records the version at once; the seed is ready
``publish_s`` later; the learner does not wait). Idle time is the time spent waiting for a batch.
With every fetch it reports what the trainer reports (``trainer.network``): the steps done and
the resumable cursor as of its last step's end, and, while blocked on an empty feed, the
rollouts it waits for (a blocked trainer asks again every ``FETCH_WAIT_S``).
"""

from __future__ import annotations

import math
from collections import Counter

from coordinator.sim.base import Gen, WorldApi
from protocol.messages import AcceptedRollout

#: seconds a blocked learner's fetch waits for rollouts before it asks again
#: (``trainer.swarm_client.FETCH_WAIT_S``)
FETCH_WAIT_S = 2.0


def admitted(staleness: int, bound: int) -> bool:
    """The trainer's admission rule (``trainer.loss.admission_mask``): 0 ≤ Δ ≤ S."""
    return 0 <= staleness <= bound


class Learner:
    """The learner process and its ledger (what it trained, dropped, waited)."""

    def __init__(self, world: WorldApi) -> None:
        self.w = world
        cfg = world.scenario.learner
        self.version = 0
        self.published = 0
        self.cursor = 0  # the highest seq fetched
        #: the trainer's resumable cursor as of its last step's end: every seq at or below it
        #: trained on or dropped (``trainer.progress.PendingRollouts.cursor``)
        self.consumed = 0
        #: rollouts it is blocked for (``rollouts_wanted``; 0: not blocked)
        self.wanting = 0
        self.pending: dict[str, list[AcceptedRollout]] = {}
        self.kappa = cfg.kappa
        self.s = cfg.staleness_bound
        self.prompts_per_step = max(1, cfg.batch_rollouts // cfg.group_size)
        self.steps = 0
        self.steps_in_window = 0
        self.idle_s = 0.0  # waiting for a batch, within the measured window
        #: when the wait for the current batch began (None while training): a learner that never
        #: gets a batch is idle the whole time, and :meth:`idle_until` counts that wait too
        self.waiting_since: float | None = 0.0
        self.busy_s = 0.0  # training, within the measured window
        self.trained = 0  # rollouts trained on, within the window
        self.trained_total = 0
        self.dropped_stale = 0
        self.bad_trained = 0
        self.staleness: Counter[int] = Counter()
        self.seen: set[int] = set()  # seq of every rollout fetched (doubles would show here)
        self.doubled = 0

    def _clip(self, a: float, b: float) -> float:
        lo, hi = self.w.window
        return max(0.0, min(b, hi) - max(a, lo))

    def _too_stale(self, r: AcceptedRollout) -> bool:
        return self.version - r.policy_version > self.s

    def _dropped(self, rollouts: list[AcceptedRollout]) -> None:
        """``rollouts`` are dropped as too stale (counted by GPU kind within the window)."""
        self.dropped_stale += len(rollouts)
        w = self.w
        if w.window[0] <= w.env.now <= w.window[1]:
            for r in rollouts:
                self._book(r, "dropped")

    def _book(self, r: AcceptedRollout, figure: str) -> None:
        """Count ``r`` in ``figure`` of its node's GPU kind (``Stats.by_gpu``)."""
        stats = self.w.stats
        stats.by_gpu[stats.gpu_of.get(r.node_fingerprint, "?")][figure] += 1

    def idle_until(self, end: float) -> float:
        """Idle seconds within the window up to ``end``, the wait in progress included."""
        ongoing = 0.0 if self.waiting_since is None else self._clip(self.waiting_since, end)
        return self.idle_s + ongoing

    def _fetch(self, need: int) -> int:
        w = self.w
        # The trainer's figures ride on its fetch (coordinator.learner_link.on_fetch) as the
        # trainer builds them at a step's end (trainer.network): the steps done and the cursor
        # of what they consumed, so the rollouts past it are judged at version ``steps`` or
        # later (the lease backlog bound counts on that; reporting the fetched cursor instead
        # counted the batch in hand as still ahead, and the bound let a step's worth too many
        # be generated per version, to be dropped). The coordinator's consumed receipts,
        # retention and a banned node's withdrawal follow the same cursor; a learner blocked
        # on an empty feed says how many rollouts it waits for (``rollouts_wanted``).
        w.core.learner_report(self.steps, self.consumed, w.scenario.learner.step_s)
        w.core.learner_waiting(self.cursor, self.wanting, self.s)
        batch = w.call("fetch", w.core.fetch_rollouts, self.cursor, need)
        self.cursor = batch.last_seq
        for r in batch.rollouts:
            if r.seq in self.seen:
                self.doubled += 1
            self.seen.add(r.seq)
            if self._too_stale(r):
                self._dropped([r])
                continue
            self.pending.setdefault(f"{r.lease_id}/{r.prompt_id}", []).append(r)
        return len(batch.rollouts)

    def _complete(self) -> list[str]:
        g = self.w.scenario.learner.group_size
        for gid in [k for k, v in self.pending.items() if self._too_stale(v[0])]:
            self._dropped(self.pending.pop(gid))
        return [k for k, v in self.pending.items() if len(v) >= g]

    def run(self) -> Gen:
        w = self.w
        env = w.env
        cfg = w.scenario.learner
        env.process(w.publish(0))
        while True:
            t0 = env.now
            self.waiting_since = t0
            while True:
                complete = self._complete()
                if len(complete) >= self.prompts_per_step:
                    break
                need = (self.prompts_per_step - len(complete)) * cfg.group_size
                got = self._fetch(need)
                lag = w.reply_lag()  # the fetch's answer waits for the coordinator's core
                if lag > 0:
                    yield env.timeout(lag)
                self.wanting = 0 if got else need
                if not got:  # the trainer's long poll: back within FETCH_WAIT_S with or without
                    yield w.env.any_of([w.wait_for_rollouts(), w.env.timeout(FETCH_WAIT_S)])
            self.waiting_since = None
            self.idle_s += self._clip(t0, env.now)
            w.stats.book_span("learner_idle_s", t0, env.now)
            batch = [r for gid in complete[: self.prompts_per_step] for r in self.pending.pop(gid)]
            in_window = w.window[0] <= env.now <= w.window[1]
            for r in batch:
                d = self.version - r.policy_version
                if not admitted(d, self.s):
                    self._dropped([r])
                    continue
                self.trained_total += 1
                if r.lease_id in w.stats.bad_leases:
                    self.bad_trained += 1
                if in_window:
                    self.trained += 1
                    self.staleness[d] += 1
                    self._book(r, "trained")
            step = cfg.step_s * math.exp(w.rng.gauss(0.0, cfg.step_noise))
            t1 = env.now
            yield env.timeout(step)
            self.busy_s += self._clip(t1, env.now)
            self.steps += 1
            pending = [r.seq for group in self.pending.values() for r in group]
            self.consumed = min(pending) - 1 if pending else self.cursor
            w.stats.book("steps", env.now, 1.0)
            self.steps_in_window += int(in_window)
            self.version += 1
            w.core.t_train_s = step  # LearnerLink.on_fetch: the trainer's step_time_s
            if self.version - self.published >= self.kappa:
                self.published = self.version
                env.process(self._publish(self.version))

    def _publish(self, version: int) -> Gen:
        yield self.w.env.timeout(self.w.scenario.learner.publish_s)
        yield from self.w.publish(version)
