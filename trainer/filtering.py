"""Informative groups only (``TrainerConfig.filter_groups``; docs/trainer.md).

A group whose ``G`` samples all got the same reward has advantage 0 for every sample
(:func:`trainer.loss.group_advantages`): the policy term ignores it, and it only adds entropy
bonus and the noise of its weights to the update. DAPO's *dynamic sampling* (Yu et al. 2025,
arXiv 2503.14476; verl's ``filter_groups``) leaves such groups out and samples more prompts until
the batch is full of informative ones. In the swarm the rollouts keep coming whatever the learner
does with them, so "sampling more" means taking more complete groups from the queue: the learner
consumes more rollouts per step, and fewer of them grow too stale waiting.

:class:`GroupFilter` is one step's choice, bounded: it looks at no more than ``max_batches``
batches' worth of complete groups, and when they hold fewer than ``batch_prompts`` informative
groups the step trains on the informative ones, filled with uniform groups up to ``min_groups``
(a minibatch each), so a task the policy has solved (every group uniform) does not starve the
learner. ``bench/staleness.py`` (the ``vcpo-filter`` option) makes the same choice on prompts it
samples itself.

``filter_drop = "solved"`` leaves out only the groups every sample of which got the full reward;
a group stuck on one wrong answer (one partial reward for all) is kept and counted with the
informative ones: its advantages are 0 too, but the entropy bonus on its tokens is the one push
away from the wrong answer (without it, measured on reverse4, the default plateaued). In this
module "uniform" (the list :attr:`GroupFilter.uniform`) means "left out".
"""

from __future__ import annotations

from collections.abc import Sequence

#: the full reward of a task (rewards are in [0, 1]: coordinator.problems.Task)
FULL_REWARD = 1.0


def uniform_rewards(rewards: Sequence[float]) -> bool:
    """True when every sample of a group got the same reward: the group's advantages are then 0
    up to rounding of the group mean (< 1e-12 for rewards in [0, 1]), with or without std
    normalisation. Exact equality: rewards that differ at all give the policy term something."""
    return all(float(r) == float(rewards[0]) for r in rewards[1:])


def check_drop(drop: str) -> None:
    """Refuse a ``filter_drop`` that is neither ``"uniform"`` nor ``"solved"``."""
    if drop not in ("uniform", "solved"):
        raise ValueError(f"filter_drop must be 'uniform' or 'solved', not {drop!r}")


def left_out(rewards: Sequence[float], drop: str = "uniform") -> bool:
    """Whether a group is one to leave out: with ``drop="uniform"`` any group of one reward, with
    ``"solved"`` only a group whose samples all got :data:`FULL_REWARD` (``filter_drop``)."""
    check_drop(drop)
    if not uniform_rewards(rewards):
        return False
    return drop == "uniform" or float(rewards[0]) >= FULL_REWARD


class GroupFilter:
    """One learner step's selection of groups (module docstring). Offer complete groups oldest
    first until :attr:`done`; then :meth:`chosen` says which to train on and which to drop."""

    def __init__(
        self, batch_prompts: int, max_batches: int, min_groups: int, drop: str = "uniform"
    ) -> None:
        if batch_prompts < 1 or max_batches < 1 or not 1 <= min_groups <= batch_prompts:
            raise ValueError(
                f"GroupFilter: need batch_prompts ({batch_prompts}) >= 1, max_batches "
                f"({max_batches}) >= 1 and 1 <= min_groups ({min_groups}) <= batch_prompts"
            )
        check_drop(drop)
        self.drop = drop
        self.batch_prompts = batch_prompts
        self.budget = batch_prompts * max_batches
        self.min_groups = min_groups
        self.informative: list[str] = []
        self.uniform: list[str] = []

    @property
    def looked(self) -> int:
        """Complete groups offered so far."""
        return len(self.informative) + len(self.uniform)

    @property
    def full(self) -> bool:
        return len(self.informative) >= self.batch_prompts

    @property
    def done(self) -> bool:
        """A full batch of informative groups, or the step's budget of groups looked at."""
        return self.full or self.looked >= self.budget

    @property
    def missing(self) -> int:
        """Informative groups still wanted (what to fetch rollouts for)."""
        return max(0, self.batch_prompts - len(self.informative))

    def offer(self, group_id: str, rewards: Sequence[float]) -> None:
        """Offer one complete group (its samples' rewards)."""
        if self.done:
            raise RuntimeError("GroupFilter.offer after done")
        (self.uniform if left_out(rewards, self.drop) else self.informative).append(group_id)

    def chosen(self) -> tuple[list[str], list[str]]:
        """``(train, drop)``: the groups to train on (informative ones first, in the order
        offered, then the newest uniform ones that fill up to ``min_groups``) and the uniform
        groups left out."""
        train = self.informative[: self.batch_prompts]
        short = max(0, self.min_groups - len(train))
        cut = len(self.uniform) - min(short, len(self.uniform))
        return train + self.uniform[cut:], self.uniform[:cut]
