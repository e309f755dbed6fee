"""Leases whose submission waits for its check: they do not expire meanwhile (issue 35).

A submission that arrived before its lease's deadline is judged as of its arrival. The
coordinator marks the lease when the submission's envelope is opened (:meth:`VerifyingLeases.
waiting`, around the wait for an intake worker and the checks) and clears the mark with the
verdict; :meth:`coordinator.leases.LeaseManager.expire_due` skips a lease :meth:`holds`. The
fencing epoch is then checked against the arrival: the lease is still active when the verdict
is recorded, so the checks of :func:`coordinator.pipeline.recheck` pass as they would have at
the arrival. A node that stops answering still loses its lease at the deadline: nothing of it is
queued. A mark counts only for the lease's holder and only if it arrived by the deadline.

Soft state: a restarted coordinator has no queue, so no marks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from coordinator.records import LeaseRecord


@dataclass
class _Mark:
    node_key: bytes
    #: the earliest arrival of a submission still in verification (clock seconds)
    arrived_at: float
    #: submissions for the lease in verification now
    count: int
    #: its expiry was put off at least once (counted once in ``VerifyingLeases.held``)
    held: bool = False


class VerifyingLeases:
    """``lease_id`` -> the submissions of it waiting for verification (``enabled`` False: none
    is ever held, the expiry of before issue 35)."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._marks: dict[str, _Mark] = {}
        #: leases whose expiry was put off because a submission was in verification (/status)
        self.held = 0

    def __len__(self) -> int:
        return len(self._marks)

    def arrive(self, lease_id: str, node_key: bytes, at: float) -> None:
        """A submission for ``lease_id`` from ``node_key`` arrived at ``at``."""
        mark = self._marks.get(lease_id)
        if mark is None:
            self._marks[lease_id] = _Mark(node_key, at, 1)
        elif mark.node_key == node_key:
            mark.count += 1
            mark.arrived_at = min(mark.arrived_at, at)
        # a submission from another node for this lease marks nothing (it will be refused)

    def done(self, lease_id: str, node_key: bytes) -> None:
        """The submission's verdict is recorded (or it was dropped): one mark fewer."""
        mark = self._marks.get(lease_id)
        if mark is None or mark.node_key != node_key:
            return
        mark.count -= 1
        if mark.count <= 0:
            del self._marks[lease_id]

    @contextmanager
    def waiting(self, lease_id: str, node_key: bytes, at: float) -> Iterator[None]:
        """Mark the lease for the duration of the block (its submission's verification)."""
        self.arrive(lease_id, node_key, at)
        try:
            yield
        finally:
            self.done(lease_id, node_key)

    def holds(self, lease: LeaseRecord) -> bool:
        """Whether ``lease``'s expiry waits: a submission of its holder that arrived by its
        deadline is in verification."""
        if not self.enabled:
            return False
        mark = self._marks.get(lease.lease_id)
        if mark is None or mark.node_key != lease.node_key or mark.arrived_at > lease.deadline:
            return False
        if not mark.held:
            mark.held = True
            self.held += 1
        return True
