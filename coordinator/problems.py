"""What a task is: a :class:`Problem` (prompt + reference answer) and the :class:`Task` protocol.

Shared by the procedural tasks (:mod:`coordinator.tasks`) and the JSONL datasets
(:mod:`coordinator.datasets`), which import it from here rather than from each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Problem", "Task"]


@dataclass(frozen=True)
class Problem:
    """One prompt with what the verifier needs to score it."""

    #: Stable id (unique within a task + seed), e.g. ``"reverse3:000123"``.
    prompt_id: str
    #: Text the tokenizer turns into prompt tokens.
    prompt: str
    #: Reference answer (never sent to nodes).
    answer: str


class Task(Protocol):
    """A prompt source plus its verifier."""

    name: str

    def problem(self, index: int) -> Problem:
        """The ``index``-th prompt of this task (deterministic)."""
        ...

    def reward(self, problem: Problem, completion: str, finished: bool) -> float:
        """Reward in [0, 1] for ``completion``; ``finished`` means the model emitted EOS."""
        ...

    def exact(self, problem: Problem, completion: str, finished: bool) -> bool:
        """True when the answer is fully right (reported as the success rate)."""
        ...
