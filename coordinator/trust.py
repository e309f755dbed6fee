"""Adaptive verification: how often each node's work is re-scored (DESIGN.md §7, check 7).

Every node has a *check rate*, the share of its leases whose samples the spot check re-scores:

* a **new** node (or one that changed its registered backend/dtype) starts at
  ``intake.new_node_check_rate`` (1.0: every lease);
* each passed spot check is *clean history*: the rate halves every
  ``intake.clean_checks_halflife`` passed checks, down to the floor ``intake.spot_check_fraction``:
  ``rate = max(floor, new · 2^(−clean / halflife))``;
* a **suspect** — a node struck, banned or flagged by the reward audit — is checked on every
  lease and every sample (``intake.suspect_full_check``) until it passes
  ``intake.suspect_release_checks`` full checks in a row; it then starts again as a new node.

A strike resets the clean history. The state is one row per node in the ``trust`` table, so a
restarted coordinator keeps every node's rate; a node key without a row is new, or a suspect if
it has a strike or ban on record from before this table existed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from coordinator.config import IntakeSection
from coordinator.store import Store

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS trust (
    node_key BLOB PRIMARY KEY, clean_checks INTEGER NOT NULL DEFAULT 0,
    suspect INTEGER NOT NULL DEFAULT 0, flagged_at REAL, flag_detail TEXT NOT NULL DEFAULT '',
    label_changed_at REAL);
"""

TrustLevel = Literal["suspect", "new", "trusted"]


@dataclass(frozen=True)
class TrustState:
    """One node's verification state."""

    #: passed spot checks since the node was new, struck or released
    clean_checks: int
    #: struck, banned or flagged and not yet released: every lease and sample re-scored
    suspect: bool
    #: flagged by the reward audit (time, Unix seconds); None = never
    flagged_at: float | None
    #: last change of its registered backend/dtype (Unix seconds); None = never changed
    label_changed_at: float | None


class Trust:
    """Per-node check rates; every change is committed with the caller's transaction."""

    def __init__(self, store: Store, config: IntakeSection) -> None:
        self.store = store
        self.config = config
        store.ensure_schema(SCHEMA)

    def state(self, node_key: bytes) -> TrustState:
        rows = self.store.query(
            "SELECT clean_checks, suspect, flagged_at, label_changed_at FROM trust"
            " WHERE node_key = ?",
            (node_key,),
        )
        if not rows:
            return TrustState(0, self.store.has_record(node_key), None, None)
        clean, suspect, flagged, changed = rows[0]
        return TrustState(int(clean), bool(suspect), flagged, changed)

    def rate_of(self, state: TrustState) -> float:
        """Share of a node's leases re-scored (1.0 for a suspect under full checks)."""
        cfg = self.config
        if state.suspect and cfg.suspect_full_check:
            return 1.0
        decayed = cfg.new_node_check_rate * 0.5 ** (state.clean_checks / cfg.clean_checks_halflife)
        return float(min(1.0, max(cfg.spot_check_fraction, decayed)))

    def level_of(self, state: TrustState) -> TrustLevel:
        if state.suspect:
            return "suspect"
        return "trusted" if self.rate_of(state) <= self.config.spot_check_fraction else "new"

    def is_suspect(self, node_key: bytes) -> bool:
        return self.state(node_key).suspect and self.config.suspect_full_check

    def rate(self, node_key: bytes) -> float:
        return self.rate_of(self.state(node_key))

    def _put(self, node_key: bytes, state: TrustState, detail: str | None = None) -> None:
        self.store.execute(
            "INSERT INTO trust (node_key, clean_checks, suspect, flagged_at, flag_detail,"
            " label_changed_at) VALUES (?,?,?,?,?,?) ON CONFLICT (node_key) DO UPDATE SET"
            " clean_checks=excluded.clean_checks, suspect=excluded.suspect,"
            " flagged_at=excluded.flagged_at, label_changed_at=excluded.label_changed_at,"
            " flag_detail=CASE WHEN excluded.flag_detail != '' THEN excluded.flag_detail"
            " ELSE trust.flag_detail END",
            (
                node_key, state.clean_checks, int(state.suspect), state.flagged_at,
                detail or "", state.label_changed_at,
            ),
        )  # fmt: skip

    def passed(self, node_key: bytes, *, full: bool) -> TrustState:
        """A spot check of the node passed: one more clean check; a suspect that passed
        ``suspect_release_checks`` full checks in a row is released (and starts as new)."""
        s = self.state(node_key)
        clean = s.clean_checks + 1
        suspect = s.suspect
        if suspect and full and clean >= self.config.suspect_release_checks:
            log.info("node %s released from full checks after %d", node_key.hex()[:16], clean)
            suspect, clean = False, 0
        new = TrustState(clean, suspect, s.flagged_at, s.label_changed_at)
        self._put(node_key, new)
        return new

    def struck(self, node_key: bytes) -> None:
        """A strike (or ban): a suspect again, clean history lost."""
        s = self.state(node_key)
        self._put(node_key, TrustState(0, True, s.flagged_at, s.label_changed_at))

    def flag(self, node_key: bytes, detail: str, now: float) -> None:
        """Flagged by the reward audit: checked in full like a struck node (no strike: the
        audit is statistical, the full checks then find what is wrong, if anything)."""
        s = self.state(node_key)
        self._put(node_key, TrustState(0, True, now, s.label_changed_at), detail)

    def relabelled(self, node_key: bytes, now: float) -> None:
        """The node registered another backend/dtype: its clean history no longer applies."""
        s = self.state(node_key)
        self._put(node_key, TrustState(0, s.suspect, s.flagged_at, now))

    def all_states(self) -> dict[bytes, TrustState]:
        """Every node with a trust row (one query; nodes without one are new)."""
        rows = self.store.query(
            "SELECT node_key, clean_checks, suspect, flagged_at, label_changed_at FROM trust"
        )
        return {bytes(k): TrustState(int(c), bool(s), f, ch) for k, c, s, f, ch in rows}
