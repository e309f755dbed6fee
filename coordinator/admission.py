"""Admission: a known node with no ban in force (check 2's last part), and new identities at
the rate the verification budget absorbs.

:func:`admission_refusal` is the pure rule over what was loaded (the node's row, its ban in
force); :class:`Admission` loads both and applies it for the coordinator's handlers. The
submission pipeline applies the same rule to its own one-read snapshot
(:mod:`coordinator.pipeline`). :class:`ProbationBucket` is the queue of new identities in
front of the verifiers (issue 35; :mod:`coordinator.verify_budget` feeds it the budget).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import Rejection
from coordinator.reputation import Ban, Reputation
from coordinator.store import NodeRecord, Store
from protocol.errors import ReasonCode
from protocol.identity import fingerprint_of


def admission_refusal(
    node_key: bytes, node: NodeRecord | None, ban: Ban | None, now: float
) -> Rejection | None:
    """Why ``node_key`` is refused (unregistered, or banned at ``now``); None: admitted."""
    if node is None:
        return Rejection(ReasonCode.UNKNOWN_NODE, f"{fingerprint_of(node_key)} must register first")
    if ban is not None:
        left = max(0.0, ban.until - now)
        return Rejection(
            ReasonCode.BANNED,
            f"banned for {left:.0f}s more (ban #{ban.count}: {ban.reason})",
            retry_after_s=left,
        )
    return None


class Admission:
    """Known, unbanned nodes only (reads the node row and the ban, both at the injected time)."""

    def __init__(self, store: Store, reputation: Reputation, clock: Callable[[], float]) -> None:
        self.store = store
        self.reputation = reputation
        self.clock = clock

    def admit(self, node_key: bytes) -> NodeRecord:
        """The node's record; a :class:`Rejection` if it is unknown or banned."""
        node = self.store.get_node(node_key)
        ban = None if node is None else self.reputation.banned(node_key, self.clock())
        refusal = admission_refusal(node_key, node, ban, self.clock())
        if refusal is not None:
            raise refusal
        assert node is not None
        return node


@dataclass(frozen=True)
class Place:
    """A refused newcomer's place in the admission queue."""

    #: its ticket (the order of first refusal: lower is served first)
    ticket: int
    #: the place lapses if the identity has not asked again by then (clock seconds)
    held_until: float


#: Bounds on the wait a refused newcomer is told (seconds).
MIN_WAIT_S = 1.0
MAX_WAIT_S = 600.0


class ProbationBucket:
    """Admits new identities at the rate the verification budget absorbs (issue 35), oldest first.

    The bucket holds *probation tokens*, one per new identity. The caller
    (:class:`coordinator.verify_budget.VerificationBudget`) says, at every registration of a new
    identity, how fast tokens accrue now (``per_s``: the spare budget over the cost of a
    newcomer's first check) and how many more newcomers the budget has room for at all
    (``room``); tokens accrue up to ``burst``. An identity is admitted when a token is there for
    it after one for each identity refused before it that still holds its place. A refused
    identity is told how long to wait for its token (or ``retry_s`` while there is no room) and
    keeps its place until ``retry_s`` past that time. Waiting places are bounded by
    ``max_waiting`` (beyond it a newcomer is refused without a place). An admitted node is never
    evicted: the bucket only answers registrations of identities it has not admitted.
    """

    def __init__(self, *, burst: int, retry_s: float, max_waiting: int) -> None:
        self.burst = float(burst)
        self.retry_s = retry_s
        self.max_waiting = max_waiting
        #: tokens available now (new identities that may be admitted); starts full
        self.level = float(burst)
        self._filled_at: float | None = None
        self._places: dict[bytes, Place] = {}
        self._by_ticket: dict[int, bytes] = {}
        self._tickets: list[int] = []  # tickets of the places held, ascending
        self._next = 0
        self._swept_at = -math.inf

    @property
    def waiting(self) -> int:
        """Refused identities that still hold a place."""
        return len(self._tickets)

    def position(self, key: bytes) -> int | None:
        """How many identities are ahead of ``key`` in the queue (None: it holds no place)."""
        place = self._places.get(key)
        return None if place is None else bisect.bisect_left(self._tickets, place.ticket)

    def take(self, key: bytes, now: float, *, per_s: float, room: float) -> float | None:
        """Admit ``key`` (None) or the seconds it should wait before asking again."""
        self._refill(now, per_s)
        self._sweep(now)
        place = self._places.get(key)
        ahead = bisect.bisect_left(self._tickets, place.ticket) if place else len(self._tickets)
        if ahead + 1 <= room and self.level >= ahead + 1:
            self.level -= 1.0
            if place is not None:
                self._drop(key, place)
            return None
        # no room: the budget must free up first (no rate to promise); else the token's wait
        no_rate = ahead + 1 > room or per_s <= 0
        wait = self.retry_s if no_rate else (ahead + 1 - self.level) / per_s
        wait = min(MAX_WAIT_S, max(MIN_WAIT_S, wait))
        if place is None and len(self._tickets) < self.max_waiting:
            place = Place(self._next, now)
            self._next += 1
            self._tickets.append(place.ticket)
            self._by_ticket[place.ticket] = key
        if place is not None:
            self._places[key] = Place(place.ticket, now + wait + self.retry_s)
        return wait

    def _refill(self, now: float, per_s: float) -> None:
        last = self._filled_at
        if last is not None and now > last and per_s > 0:
            self.level = min(self.burst, self.level + per_s * (now - last))
        self._filled_at = now if last is None else max(last, now)

    def _sweep(self, now: float) -> None:
        """Drop lapsed places: at the head of the queue on every call, everywhere at most once a
        second (a lapsed place further back delays only those behind it, and not for long)."""
        if now - self._swept_at >= 1.0:
            self._swept_at = now
            for key, place in [(k, p) for k, p in self._places.items() if p.held_until < now]:
                self._drop(key, place)
            return
        while self._tickets:
            key = self._by_ticket[self._tickets[0]]
            place = self._places[key]
            if place.held_until >= now:
                break
            self._drop(key, place)

    def _drop(self, key: bytes, place: Place) -> None:
        del self._places[key]
        del self._by_ticket[place.ticket]
        i = bisect.bisect_left(self._tickets, place.ticket)
        if i < len(self._tickets) and self._tickets[i] == place.ticket:
            del self._tickets[i]
