"""The learner's shared counters, as plain objects the recipe creates and hands to its parts.

:class:`~trainer.recipe.Trainer` builds one of each and passes them to the collaborators that
read or advance them (:class:`~trainer.step.LearnerStep`, :class:`~trainer.resume.CheckpointStore`,
:class:`~trainer.publishing.Publications`):

- :class:`LearnerProgress` — steps, versions, the KL-adaptive factor, rollbacks, publication
  figures: what a checkpoint saves and a step record reports.
- :class:`PendingRollouts` — rollouts fetched but not yet trained on (groups waiting for their
  last sample), what was dropped before training, and the resumable cursor.
- :class:`StepTiming` — T_train and its variability (moving averages of the step time).

They hold data and tiny derived figures only; who changes what is said where it is changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.batch import Rollout


@dataclass
class LearnerProgress:
    """Where the learner is; a checkpoint saves and restores it."""

    #: optimizer steps (learner steps) done
    step: int = 0
    #: version of the current weights
    version: int = 0
    #: last version handed to a publisher (None: nothing published yet)
    published_version: int | None = None
    #: learning-rate factor (× lr) of the KL-adaptive schedule (``target_step_kl``; 1 when off)
    lr_factor: float = 1.0
    #: learner steps undone because they moved the policy more than ``max_step_kl``
    rollbacks: int = 0
    #: seconds the last publication took (weights copied -> the publisher returned)
    publish_s: float | None = None
    #: publications deferred because the previous one was still in flight
    publish_deferred: int = 0


@dataclass
class PendingRollouts:
    """Rollouts between the feed and a step: the recipe's batching fills it, the step drains its
    drop counters, a checkpoint saves its :attr:`cursor`."""

    #: highest rollout ``seq`` fetched; see :attr:`cursor` for the resumable one
    fetched: int = 0
    #: fetched rollouts waiting for their group to complete, by group id
    groups: dict[str, list[Rollout]] = field(default_factory=dict)
    #: rollouts dropped as too stale before a step saw them, not yet reported
    dropped_at_fetch: int = 0
    #: rewards of the rollouts of uniform-reward groups left out (``filter_groups``), not yet
    #: reported: the step's reward figures cover what it consumed, not only what it trained on
    uniform_rewards: list[float] = field(default_factory=list)

    @property
    def cursor(self) -> int:
        """Resumable cursor: every rollout with ``seq ≤ cursor`` was trained on or dropped."""
        pending = [r.seq for g in self.groups.values() for r in g]
        return min(pending) - 1 if pending else self.fetched


@dataclass
class StepTiming:
    """T_train: exponential moving averages (weight 0.2 per step) of the step time and its
    square, and of the rollouts consumed per step."""

    #: T_train, seconds
    t_train_s: float | None = None
    #: running mean of the squared step time (same weight): T_train's variability
    t_train_sq: float | None = None
    #: rollouts consumed per step (trained + left out as uniform): B as the coordinator's
    #: capacity plan needs it when ``filter_groups`` is on
    consumed: float | None = None

    def add_step(self, seconds: float) -> None:
        """Fold one step's duration into both averages."""
        self.t_train_s = seconds if self.t_train_s is None else 0.8 * self.t_train_s + 0.2 * seconds
        sq = seconds * seconds
        self.t_train_sq = sq if self.t_train_sq is None else 0.8 * self.t_train_sq + 0.2 * sq

    def add_consumed(self, rollouts: int) -> None:
        """Fold one step's consumed rollouts into their average."""
        last = self.consumed
        self.consumed = rollouts if last is None else 0.8 * last + 0.2 * rollouts

    @property
    def t_train_cv(self) -> float | None:
        """Coefficient of variation of the step time (running, weight 0.2): on a shared machine
        a step takes 0.3–0.8 s where T_train is 0.5, and a learner whose steps vary outruns its
        rollouts after the short ones (docs/capacity.md, the fluid model)."""
        if self.t_train_s is None or self.t_train_sq is None or self.t_train_s <= 0:
            return None
        var = max(0.0, self.t_train_sq - self.t_train_s * self.t_train_s)
        return math.sqrt(var) / self.t_train_s
