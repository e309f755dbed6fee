"""Strikes and bans with growing back-off (DESIGN.md §7), persisted in the store.

A failed check that is the node's fault (see :data:`coordinator.errors.NO_STRIKE` for the ones that
are not) adds a strike. ``strikes_to_ban`` live strikes ban the identity for
``ban_s = base · 2^(bans − 1)``, capped at ``ban_max_s``; the strikes are consumed, so the next ban
needs fresh ones and lasts twice as long. A strike stays live until a ban consumes it or the node
has earned back the floor check rate after it (:meth:`Reputation.forgive`, called when its clean
leases reach :meth:`coordinator.trust.Trust.leases_to_floor`): time alone never clears one, so a
patient cheater cannot wait strikes out (issue 34, finding 3: a 3,600 s window expired before the
third strike of a node forging once every ~80 leases). A check failed by at least
``intake.ban_multiple`` times its limit — far beyond any honest error — bans at once
(:meth:`Reputation.ban_now`).
While a ban is in force no strikes are recorded (the node is refused anyway). A node with any
strike or ban on record is a *suspect*: the intake re-scores every sample of every lease it
submits (``intake.suspect_full_check``), so nothing bad of it is accepted after its first detection.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass

from coordinator.config import ReputationSection
from coordinator.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ban:
    """A ban in force: ``count`` is how many bans the identity has had (this one included)."""

    until: float
    count: int
    reason: str


def ban_in_force(row: tuple[int, float, str] | None, now: float) -> Ban | None:
    """The ban of a ``bans`` row ``(bans so far, banned_until, reason)`` if in force at ``now``."""
    if row is None or row[1] <= now:
        return None
    return Ban(until=row[1], count=row[0], reason=row[2])


def ban_duration(count: int, base_s: float, max_s: float) -> float:
    """``base · 2^(count − 1)`` seconds, capped at ``max_s`` (count ≥ 1)."""
    if count < 1:
        raise ValueError("ban_duration: count must be >= 1")
    return min(max_s, base_s * 2.0 ** min(count - 1, 62))


@dataclass(frozen=True)
class Standing:
    """What a strike decision reads of a node, loaded in one read
    (:meth:`coordinator.submission_records.SubmissionRecords.load_standing`)."""

    #: the node's ``bans`` row ``(bans so far, banned_until, reason)``; None: never banned
    ban: tuple[int, float, str] | None
    #: reasons of its strikes not yet consumed by a ban or forgiven, oldest first
    live: tuple[str, ...]


@dataclass(frozen=True)
class StrikeDecision:
    """A strike to record and the ban it triggers (``ban`` None: a strike only). A ban consumes
    every live strike of the node, this one included."""

    reason: str
    detail: str
    ban: Ban | None


def decide_strike(
    standing: Standing,
    reason: str,
    detail: str,
    now: float,
    config: ReputationSection,
    *,
    at_once: bool = False,
) -> StrikeDecision | None:
    """The strike a failed check earns (pure). None under a ban in force (no strike recorded);
    ``strikes_to_ban`` live strikes (this one counted) ban for ``base · 2^(bans − 1)`` capped at
    ``ban_max_s``; ``at_once`` (a check failed far beyond any honest error) bans for
    ``ban_max_s`` at once."""
    if ban_in_force(standing.ban, now) is not None:
        return None
    count = (standing.ban[0] if standing.ban else 0) + 1
    if at_once:
        why = f"{reason} far beyond any honest error: {detail}"[:500]
        return StrikeDecision(reason, detail, Ban(now + config.ban_max_s, count, why))
    live = [*standing.live, reason]
    if len(live) < config.strikes_to_ban:
        return StrikeDecision(reason, detail, None)
    until = now + ban_duration(count, config.ban_base_s, config.ban_max_s)
    top = Counter(live).most_common(1)[0][0]
    return StrikeDecision(reason, detail, Ban(until, count, f"{len(live)} strikes, mostly {top}"))


def record_strike(store: Store, node_key: bytes, decision: StrikeDecision, now: float) -> None:
    """Write ``decision`` (call inside the transaction that read the standing it came from)."""
    with store.transaction():
        store.add_strike(node_key, decision.reason, decision.detail, now)
        ban = decision.ban
        if ban is not None:
            store.put_ban(node_key, ban.count, ban.until, ban.reason)
            store.consume_strikes(node_key)
    if ban is not None:
        log.warning(
            "node %s banned until %.0f (ban #%d: %s)", node_key.hex()[:16], ban.until, ban.count,
            ban.reason,
        )  # fmt: skip


class Reputation:
    """Records strikes and decides bans (:func:`decide_strike`); every change is committed
    before returning."""

    def __init__(self, store: Store, config: ReputationSection) -> None:
        self.store = store
        self.config = config

    def standing(self, node_key: bytes) -> Standing:
        """The node's ban row and live strikes (:class:`Standing`)."""
        return Standing(
            self.store.get_ban(node_key), tuple(self.store.live_strikes(node_key, -math.inf))
        )

    def strike(self, node_key: bytes, reason: str, detail: str, now: float) -> Ban | None:
        """Add a strike; returns the ban it triggered, if any.

        A node under a ban in force gets no further strikes: it is refused anyway, and its
        messages must not grow the strike table (at most ``strikes_to_ban`` rows per ban)."""
        return self._apply(node_key, reason, detail, now, at_once=False)

    def ban_now(self, node_key: bytes, reason: str, detail: str, now: float) -> Ban | None:
        """A strike that bans at once, for ``ban_max_s`` (a failed check far beyond any honest
        error); None if a ban is already in force."""
        return self._apply(node_key, reason, detail, now, at_once=True)

    def _apply(
        self, node_key: bytes, reason: str, detail: str, now: float, *, at_once: bool
    ) -> Ban | None:
        with self.store.transaction():
            standing = self.standing(node_key)
            decision = decide_strike(standing, reason, detail, now, self.config, at_once=at_once)
            if decision is None:
                return None
            record_strike(self.store, node_key, decision, now)
        return decision.ban

    def forgive(self, node_key: bytes) -> int:
        """The node earned the floor check rate back: its live strikes no longer count toward a
        ban (they stay on record). Returns how many were forgiven."""
        return self.store.execute(
            "UPDATE strikes SET consumed = 1 WHERE node_key = ? AND consumed = 0", (node_key,)
        )

    def banned(self, node_key: bytes, now: float) -> Ban | None:
        """The ban in force at ``now``, or None."""
        return ban_in_force(self.store.get_ban(node_key), now)

    def suspect(self, node_key: bytes) -> bool:
        """Has the node ever been struck or banned? (Its work is then checked in full.)"""
        return self.store.has_record(node_key)

    def strikes(self, node_key: bytes) -> dict[str, int]:
        """All strikes ever recorded for the node, per reason code."""
        return self.store.strike_counts(node_key)
