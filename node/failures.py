"""Generation failures that repeat: back off, say why, and stop taking leases.

A failure that is deterministic (a prompt longer than the model's positions, a dtype the device
cannot run, a broken model directory) fails every lease the same way. Without this, the node
would take a lease, fail, release it and ask for the next one at once, hundreds of times a minute,
while the operator sees nothing. :class:`FailureTracker` gives:

* a back-off between failed leases that grows with every consecutive failure and is reset only by
  a generation that succeeds (not by the coordinator answering, which it does every time);
* the last failure's text (the node's status line, ``statistics()``, and the reason of the lease
  release, which the coordinator shows in ``/status`` ``node_problems`` and ``swarm inspect``);
* :attr:`gave_up` after ``limit`` identical failures in a row (same exception type and message):
  the node then stops taking leases (it stays up: heartbeats, adverts and chunk serving go on, so
  the swarm still sees it and why) until it is restarted.
"""

from __future__ import annotations

import random

from node.status import Backoff

__all__ = ["FailureTracker"]


class FailureTracker:
    """Counts consecutive generation failures (see the module docstring)."""

    def __init__(
        self,
        limit: int,
        initial_s: float,
        maximum_s: float,
        rng: random.Random | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.backoff = Backoff(initial_s, maximum_s, rng)
        #: text of the last failure (None: the last generation succeeded)
        self.last: str | None = None
        #: how many failures in a row had exactly that text
        self.repeats = 0

    def record(self, reason: str) -> float:
        """Count a failure; returns how long to wait before the next lease."""
        self.repeats = self.repeats + 1 if reason == self.last else 1
        self.last = reason
        return self.backoff.next_delay()

    def reset(self) -> None:
        """A generation succeeded."""
        self.last = None
        self.repeats = 0
        self.backoff.reset()

    @property
    def gave_up(self) -> bool:
        """``limit`` identical failures in a row: stop taking leases."""
        return self.last is not None and self.repeats >= self.limit

    @property
    def problem(self) -> str | None:
        """One line for the status: the last failure and how often it repeated."""
        if self.last is None:
            return None
        if self.gave_up:
            return f"stopped taking leases after {self.repeats} identical failures: {self.last}"
        return f"{self.last} ({self.repeats}x in a row)"
