"""The prompts of a lease as the coordinator issues them (task problem + rendered tokens).

:class:`PromptSlots` turns a lease's prompt indices into :class:`~coordinator.intake.PromptSlot`
values: an audit copy (a negative index, :mod:`coordinator.audits`) asks its original prompt, so
the slots take the ``{audit index: original}`` map, which the caller loads (the submission
pipeline reads it in its one snapshot) or :meth:`PromptSlots.of` reads itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.audits import RewardAudits
from coordinator.intake import PromptSlot
from coordinator.problems import Task
from coordinator.records import LeaseRecord
from policy.prompts import PromptRenderer


class PromptSlots:
    """Renders the prompts of a lease (the task's problems through the prompt template)."""

    def __init__(self, task: Task, prompts: PromptRenderer, audits: RewardAudits) -> None:
        self.task = task
        self.prompts = prompts
        self.audits = audits

    def of(self, lease: LeaseRecord) -> dict[str, PromptSlot]:
        """prompt_id -> slot for every prompt of ``lease`` (reads the audit copies' originals)."""
        return self.render(lease, self.audits.originals(lease.prompts))

    def render(self, lease: LeaseRecord, originals: Mapping[int, int]) -> dict[str, PromptSlot]:
        """prompt_id -> slot, given ``{audit index: original index}`` (no store access)."""
        slots = {}
        for position, index in enumerate(lease.prompts):
            problem = self.task.problem(originals.get(index, index))
            ids = tuple(self.prompts.render(problem.prompt))
            slots[problem.prompt_id] = PromptSlot(index, problem, ids, position)
        return slots
