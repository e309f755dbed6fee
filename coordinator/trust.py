"""What a node is held to: its check rate as a function of its history (DESIGN.md §7, check 7).

Every node has a *check rate*, the share of its leases whose samples are re-scored (all of them:
a checked lease is re-scored in full). It depends on ``h``, the node's **clean leases**: leases
accepted since it registered, changed its registration, was struck or released from suspicion:

    rate(h) = clamp(new_node_check_rate / (1 + h / P), spot_check_fraction, 1),
    P = 1 / ε,   ε = intake.target_forged_share (0.01: P = 100)

* a **new** identity starts at ``new_node_check_rate`` (1.0: probation at full checks) and earns
  a lower rate only with accepted work: the floor ``f = spot_check_fraction`` after
  ``h_f = P · (1/f − 1)`` clean leases (1,900 at f = 0.05), at a cost of about
  ``P · ln(1 + h_f / P)`` checks (300);
* why ``1/(1 + h/P)``: a cheater that forges from its ``h``-th lease on is caught on each forged
  lease with probability ``rate(h) ≥ 1/(1 + h/P)``, so it gets ``(1 − rate)/rate ≤ h/P`` forged
  leases accepted on average before its first detection, against ``h`` honest ones: a forged
  share of at most ``1/(1 + P) < ε`` among its accepted leases, wherever it starts; forging
  each lease with probability ``p`` gives at most ``ε`` too (:mod:`coordinator.detection`
  computes each strategy; docs/reliability.md "Detection power");
* a node the operator **vouches** for (``intake.vouched_nodes``) starts at ``h = h_f``, the floor
  (:func:`vouched_state`, at registration), until it has a strike, ban or flag on record;
* a **suspect** — struck, banned or flagged by the reward audit — is checked on every lease
  (``intake.suspect_full_check``) until it passes ``intake.suspect_release_checks`` checks in a
  row; it then starts again from ``h = 0``. A strike resets ``h`` to 0.

The node cannot read any of this (:data:`coordinator.node_view.OPERATOR_ONLY_FIELDS`).
:meth:`Trust.obligation` is the typed answer a verification budget needs (issue 35): the rate a
node is held to now, and what its probation still costs in checks.

The state is one row per node in the ``trust`` table, so a restarted coordinator keeps every
node's rate; a node key without a row is new, or a suspect if it has a strike or ban on record
from before this table existed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from coordinator.config import IntakeSection
from coordinator.store import Store, TrustRow

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS trust (
    node_key BLOB PRIMARY KEY, clean_checks INTEGER NOT NULL DEFAULT 0,
    suspect INTEGER NOT NULL DEFAULT 0, flagged_at REAL, flag_detail TEXT NOT NULL DEFAULT '',
    label_changed_at REAL, clean_leases INTEGER NOT NULL DEFAULT 0);
"""

TrustLevel = Literal["suspect", "new", "trusted"]

#: :meth:`Trust.leases_to_floor` when the floor is 0 (the rate never reaches it).
UNBOUNDED = 10**9


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
    #: accepted leases since the node was new, struck, relabelled or released (``h``)
    clean_leases: int = 0


@dataclass(frozen=True)
class Obligation:
    """What a node is held to now (the typed view a verification budget queries)."""

    #: share of its leases re-scored (1.0: every lease)
    rate: float
    #: struck, banned or flagged and not released: every lease checked
    suspect: bool
    #: accepted leases since it was new, struck, relabelled or released
    clean_leases: int
    #: clean leases still needed before its rate reaches the floor (0: at the floor)
    leases_to_floor: int
    #: expected checks those leases cost (Σ rate over them): its remaining probation
    checks_to_floor: float


def trust_state(row: TrustRow | None, has_record: bool) -> TrustState:
    """A node's state from its ``trust`` row; without one it is new, or a suspect when it has a
    strike or ban on record (``has_record``) from before the table existed."""
    if row is None:
        return TrustState(0, has_record, None, None)
    clean, suspect, flagged, changed, leases = row
    return TrustState(clean, suspect, flagged, changed, leases)


def accepted_state(state: TrustState, *, checked: bool, release_checks: int) -> TrustState:
    """``state`` after one of the node's leases is accepted (``checked``: after a passed check):
    one more clean lease (and clean check); a suspect that passed ``release_checks`` checks in a
    row is released and starts again from ``h = 0``."""
    clean = state.clean_checks + int(checked)
    leases = state.clean_leases + 1
    suspect = state.suspect
    if suspect and checked and clean >= release_checks:
        suspect, clean, leases = False, 0, 0
    return TrustState(clean, suspect, state.flagged_at, state.label_changed_at, leases)


def struck_state(state: TrustState) -> TrustState:
    """``state`` after a strike (or ban): a suspect again, clean history lost."""
    return TrustState(0, True, state.flagged_at, state.label_changed_at, 0)


def flagged_state(state: TrustState, now: float) -> TrustState:
    """``state`` after a reward-audit flag at ``now``: a suspect, clean history lost."""
    return TrustState(0, True, now, state.label_changed_at, 0)


def relabelled_state(state: TrustState, now: float) -> TrustState:
    """``state`` after the node registered another backend/dtype at ``now``: its clean history
    no longer applies (a suspect stays one)."""
    return TrustState(0, state.suspect, state.flagged_at, now, 0)


def vouched_state(state: TrustState, floor_leases: int) -> TrustState | None:
    """``state`` of a node the operator vouches for (``intake.vouched_nodes``) with its probation
    waived: ``h`` raised to ``floor_leases`` (the clean leases at which the rate reaches the
    floor). None when nothing changes: already there, or a suspect or a flagged node, which earns
    its rate back like any other (so does one struck or banned before: the caller does not
    vouch for it)."""
    if state.suspect or state.flagged_at is not None or state.clean_leases >= floor_leases:
        return None
    return TrustState(state.clean_checks, False, None, state.label_changed_at, max(0, floor_leases))


def leases_to_floor(config: IntakeSection, clean_leases: int = 0) -> int:
    """Clean leases after ``clean_leases`` until the rate reaches the floor."""
    if config.new_node_check_rate <= config.spot_check_fraction:
        return 0
    if config.spot_check_fraction <= 0:  # no floor: the rate only approaches 0
        return UNBOUNDED
    patience = 1.0 / config.target_forged_share  # P, as Trust.patience
    h_f = patience * (config.new_node_check_rate / config.spot_check_fraction - 1.0)
    return max(0, math.ceil(h_f) - clean_leases)


#: Write one node's trust row (``flag_detail`` kept unless a new one is given).
PUT_SQL = (
    "INSERT INTO trust (node_key, clean_checks, suspect, flagged_at, flag_detail,"
    " label_changed_at, clean_leases) VALUES (?,?,?,?,?,?,?) ON CONFLICT (node_key)"
    " DO UPDATE SET clean_checks=excluded.clean_checks, suspect=excluded.suspect,"
    " flagged_at=excluded.flagged_at, label_changed_at=excluded.label_changed_at,"
    " clean_leases=excluded.clean_leases,"
    " flag_detail=CASE WHEN excluded.flag_detail != '' THEN excluded.flag_detail"
    " ELSE trust.flag_detail END"
)


def put_args(node_key: bytes, state: TrustState, detail: str = "") -> tuple[object, ...]:
    """The arguments of :data:`PUT_SQL` for ``state``."""
    return (
        node_key, state.clean_checks, int(state.suspect), state.flagged_at, detail,
        state.label_changed_at, state.clean_leases,
    )  # fmt: skip


class Trust:
    """Per-node check rates; every change is committed with the caller's transaction."""

    def __init__(self, store: Store, config: IntakeSection) -> None:
        self.store = store
        self.config = config
        store.ensure_schema(SCHEMA)
        columns = {row[1] for row in store.query("PRAGMA table_info(trust)")}
        if "clean_leases" not in columns:  # a state database from before issue 34
            store.execute("ALTER TABLE trust ADD COLUMN clean_leases INTEGER NOT NULL DEFAULT 0")

    def state(self, node_key: bytes) -> TrustState:
        row = self.store.trust_row(node_key)
        return trust_state(row, row is None and self.store.has_record(node_key))

    @property
    def patience(self) -> float:
        """``P = 1 / ε``: clean leases over which the rate falls to half its start."""
        return 1.0 / self.config.target_forged_share

    def rate_after(self, clean_leases: int) -> float:
        """``rate(h)`` of a node that is not a suspect (see the module docstring)."""
        cfg = self.config
        decayed = cfg.new_node_check_rate / (1.0 + clean_leases / self.patience)
        return float(min(1.0, max(cfg.spot_check_fraction, decayed)))

    def rate_of(self, state: TrustState) -> float:
        """Share of a node's leases re-scored (1.0 for a suspect under full checks)."""
        if state.suspect and self.config.suspect_full_check:
            return 1.0
        return self.rate_after(state.clean_leases)

    def leases_to_floor(self, clean_leases: int = 0) -> int:
        """Clean leases after ``clean_leases`` until the rate reaches the floor."""
        return leases_to_floor(self.config, clean_leases)

    def obligation(self, node_key: bytes) -> Obligation:
        """What ``node_key`` is held to now (:class:`Obligation`)."""
        s = self.state(node_key)
        suspect = s.suspect and self.config.suspect_full_check
        left = self.leases_to_floor(s.clean_leases)
        h = s.clean_leases
        checks = sum(self.rate_after(h + i) for i in range(min(left, 100_000)))
        return Obligation(self.rate_of(s), suspect, h, left, checks)

    def level_of(self, state: TrustState) -> TrustLevel:
        if state.suspect:
            return "suspect"
        return "trusted" if self.rate_of(state) <= self.config.spot_check_fraction else "new"

    def is_suspect(self, node_key: bytes) -> bool:
        return self.state(node_key).suspect and self.config.suspect_full_check

    def rate(self, node_key: bytes) -> float:
        return self.rate_of(self.state(node_key))

    def _put(self, node_key: bytes, state: TrustState, detail: str | None = None) -> None:
        self.store.execute(PUT_SQL, put_args(node_key, state, detail or ""))

    def accepted(
        self, node_key: bytes, *, checked: bool, state: TrustState | None = None
    ) -> TrustState:
        """A lease of the node was accepted (``checked``: after a passed check): one more clean
        lease (and clean check); a suspect that passed ``suspect_release_checks`` checks in a
        row is released and starts again from ``h = 0``. ``state``: the node's current state
        when the caller has just read it (inside the same transaction); else it is read."""
        s = self.state(node_key) if state is None else state
        new = accepted_state(s, checked=checked, release_checks=self.config.suspect_release_checks)
        if s.suspect and not new.suspect:
            log.info("node %s released from full checks after %d", node_key.hex()[:16],
                     s.clean_checks + int(checked))  # fmt: skip
        self._put(node_key, new)
        return new

    def struck(self, node_key: bytes) -> None:
        """A strike (or ban): a suspect again, clean history lost."""
        self._put(node_key, struck_state(self.state(node_key)))

    def flag(self, node_key: bytes, detail: str, now: float) -> None:
        """Flagged by the reward audit: checked in full like a struck node (no strike: the
        audit is statistical, the full checks then find what is wrong, if anything)."""
        self._put(node_key, flagged_state(self.state(node_key), now), detail)

    def all_states(self) -> dict[bytes, TrustState]:
        """Every node with a trust row (one query; nodes without one are new)."""
        rows = self.store.query(
            "SELECT node_key, clean_checks, suspect, flagged_at, label_changed_at, clean_leases"
            " FROM trust"
        )
        return {bytes(k): TrustState(int(c), bool(s), f, ch, int(n)) for k, c, s, f, ch, n in rows}
