"""Durable coordinator state in SQLite (WAL journal, ``synchronous=FULL``).

One file holds everything a restarted coordinator needs: nodes, leases, prompt states, accepted
rollouts, verdicts (so a re-sent submission gets the same answer), strikes, bans, published versions
and a key/value ``meta`` table (prompt cursor, fencing epoch counter, spot-check secret).

All writes of one operation run in one ``BEGIN IMMEDIATE`` transaction (:meth:`Store.transaction`,
re-entrant) and are committed before the caller acknowledges anything. ``sqlite3`` errors are
translated to :class:`~coordinator.errors.StoreError` in :meth:`Store._guard`, the one boundary.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator.errors import StoreError
from coordinator.records import (
    ACK,
    LEASE_COLS,
    NODE_COLS,
    NODE_MUTABLE,
    ROLLOUT_COLS,
    LeaseRecord,
    NodeRecord,
    RolloutRow,
    TrustRow,
    Verdict,
    lease_from_row,
    node_from_row,
    rollout_from_row,
)
from coordinator.schema import MIGRATIONS, SCHEMA

__all__ = [
    "ACK", "LeaseRecord", "NodeRecord", "RolloutRow", "Store", "TrustRow",
    "Verdict",
]  # fmt: skip

TRUST_SQL = (
    "SELECT clean_checks, suspect, flagged_at, label_changed_at, clean_leases FROM trust"
    " WHERE node_key = ?"
)


class Store:
    """The coordinator's SQLite database. Thread-safe (one connection behind a lock)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._depth = 0
        #: the newest published versions, newest first, as last read (None: read again). Every
        #: heartbeat and lease request reads them; only :meth:`put_version` changes them, and
        #: a rolled-back transaction forgets them. This connection is the only writer of the
        #: versions table (the coordinator's; the audit CLI and benches only read the file).
        self._recent: tuple[int, tuple[int, ...]] | None = None  # (n asked, the versions)
        with self._guard("open"):
            if str(path) != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False, timeout=10.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(SCHEMA)
            for table, column, decl in MIGRATIONS:
                have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def close(self) -> None:
        with self._guard("close"):
            self._conn.close()

    # --- the one boundary where sqlite3 errors become StoreError ---------------------------------
    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(
                f"{op} failed on {self.path}: {exc}; check the disk and file permissions"
            ) from exc

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` (re-entrant: only the outermost level commits)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            with self._guard("begin"):
                self._conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self._recent = None  # it may hold a version this transaction wrote
                with self._guard("rollback"):
                    self._conn.execute("ROLLBACK")
                raise
            self._depth = 0
            try:
                with self._guard("commit"):
                    self._conn.execute("COMMIT")
            except StoreError:
                # SQLite may leave the transaction open when COMMIT fails (BUSY, IOERR, FULL):
                # roll it back, or this connection would read writes that never became durable
                # (a re-sent submission told "ack") and fail every later BEGIN.
                self._recent = None
                if self._conn.in_transaction:
                    with self._guard("rollback"):
                        self._conn.execute("ROLLBACK")
                raise

    # --- generic access for the modules that own their own tables (trust, audits, receipts) ----
    def ensure_schema(self, script: str) -> None:
        """Create a module's tables and indices if missing (``CREATE ... IF NOT EXISTS``)."""
        with self._lock, self._guard("schema"):
            self._conn.executescript(script)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run one write statement (inside the caller's transaction if any); rows changed."""
        with self.transaction():
            return int(self._exec(sql, args).rowcount)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read statement."""
        return self._all(sql, args)

    def _exec(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self._lock, self._guard(sql.split(None, 1)[0].lower()):
            return self._conn.execute(sql, args)

    def _many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._lock, self._guard(sql.split(None, 1)[0].lower()):
            self._conn.executemany(sql, rows)

    def _all(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._guard("select"):
            return list(self._conn.execute(sql, args).fetchall())

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the connection lock across several reads (a consistent view: every write of
        this process takes the same lock)."""
        with self._lock:
            yield

    def trust_row(self, node_key: bytes) -> TrustRow | None:
        """The node's row of the ``trust`` table (:mod:`coordinator.trust`), or None."""
        rows = self._all(TRUST_SQL, (node_key,))
        if not rows:
            return None
        c, s, f, ch, n = rows[0]
        return (int(c), bool(s), f, ch, int(n))

    # --- meta ------------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        rows = self._all("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction():
            self._exec("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def next_counter(self, key: str, start: int = 0) -> int:
        """Increment and return an integer counter (e.g. the fencing epoch)."""
        with self.transaction():
            value = int(self.get_meta(key) or start) + 1
            self.set_meta(key, str(value))
            return value

    def secret(self, key: str = "spot_check_secret") -> bytes:
        """A random 32-byte secret created on first use and kept across restarts."""
        with self.transaction():
            value = self.get_meta(key)
            if value is None:
                value = secrets.token_hex(32)
                self.set_meta(key, value)
        return bytes.fromhex(value)

    # --- nodes -----------------------------------------------------------------------------------
    def upsert_node(self, node: NodeRecord) -> None:
        with self.transaction():
            self._exec(
                "INSERT INTO nodes (node_key, fingerprint, advert, registered_at, last_seen,"
                " tokens_per_s, rollouts_per_s, price_per_hour, backend, dtype, leases_completed,"
                " leases_expired, draining) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT (node_key) DO UPDATE SET fingerprint=excluded.fingerprint,"
                " advert=excluded.advert, last_seen=excluded.last_seen,"
                " tokens_per_s=excluded.tokens_per_s, rollouts_per_s=excluded.rollouts_per_s,"
                " price_per_hour=excluded.price_per_hour, backend=excluded.backend,"
                " dtype=excluded.dtype, leases_completed=excluded.leases_completed,"
                " leases_expired=excluded.leases_expired, draining=excluded.draining",
                (
                    node.node_key, node.fingerprint, node.advert, node.registered_at,
                    node.last_seen, node.tokens_per_s, node.rollouts_per_s, node.price_per_hour,
                    node.backend, node.dtype, node.leases_completed, node.leases_expired,
                    int(node.draining),
                ),
            )  # fmt: skip

    def get_node(self, node_key: bytes) -> NodeRecord | None:
        rows = self._all(f"SELECT {NODE_COLS} FROM nodes WHERE node_key = ?", (node_key,))
        return node_from_row(rows[0]) if rows else None

    def update_node(self, node_key: bytes, **fields: Any) -> None:
        """Set some columns of a node row (``draining=True``, ``last_seen=…``, ...)."""
        bad = set(fields) - NODE_MUTABLE
        if bad:
            raise ValueError(f"update_node: unknown or immutable columns {sorted(bad)}")
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction():
            self._exec(f"UPDATE nodes SET {sets} WHERE node_key = ?", [*fields.values(), node_key])

    def bump_node(self, node_key: bytes, column: str) -> None:
        """Increment ``leases_completed`` or ``leases_expired``."""
        if column not in ("leases_completed", "leases_expired"):
            raise ValueError(f"bump_node: {column!r} is not a counter")
        with self.transaction():
            self._exec(f"UPDATE nodes SET {column} = {column} + 1 WHERE node_key = ?", (node_key,))

    def nodes(self) -> list[NodeRecord]:
        return [
            node_from_row(r) for r in self._all(f"SELECT {NODE_COLS} FROM nodes ORDER BY node_key")
        ]

    def touch_nodes(self, seen: Iterable[tuple[bytes, float]]) -> None:
        """Raise ``last_seen`` of many nodes in one transaction (never lowers it)."""
        with self.transaction():
            self._many(
                "UPDATE nodes SET last_seen = MAX(last_seen, ?) WHERE node_key = ?",
                [(at, key) for key, at in seen],
            )

    def live_nodes(self, seen_after: float, now: float) -> list[NodeRecord]:
        """Nodes heard from at or after ``seen_after`` with no ban in force at ``now``, ordered by
        key, without their adverts (the capacity planner's input: one query, no blobs)."""
        cols = NODE_COLS.replace("advert", "NULL")
        sql = (
            f"SELECT {cols} FROM nodes WHERE last_seen >= ?"
            " AND node_key NOT IN (SELECT node_key FROM bans WHERE banned_until > ?)"
            " ORDER BY node_key"
        )
        return [node_from_row(r) for r in self._all(sql, (seen_after, now))]

    def node_count(self) -> int:
        return int(self._all("SELECT COUNT(*) FROM nodes")[0][0])

    def planner_rows(
        self, seen_after: float, now: float
    ) -> list[tuple[bytes, float | None, float | None, float | None, int, int]]:
        """What the capacity planner reads of each live node (:meth:`live_nodes`' rule), as bare
        rows: ``(node_key, price_per_hour, tokens_per_s, rollouts_per_s, leases_completed,
        leases_expired)`` — no record objects, no adverts (a re-plan reads all 10,000)."""
        sql = (
            "SELECT node_key, price_per_hour, tokens_per_s, rollouts_per_s, leases_completed,"
            " leases_expired FROM nodes WHERE last_seen >= ?"
            " AND node_key NOT IN (SELECT node_key FROM bans WHERE banned_until > ?)"
        )
        return [
            (bytes(k), p, t, r, int(c), int(e))
            for k, p, t, r, c, e in self._all(sql, (seen_after, now))
        ]

    def live_node_count(self, seen_after: float, now: float) -> int:
        """How many nodes :meth:`live_nodes` would return (a count, no rows: the status reads it
        every tick)."""
        sql = (
            "SELECT COUNT(*) FROM nodes WHERE last_seen >= ?"
            " AND node_key NOT IN (SELECT node_key FROM bans WHERE banned_until > ?)"
        )
        return int(self._all(sql, (seen_after, now))[0][0])

    def banned_registered(self, now: float) -> list[bytes]:
        """Keys of registered nodes with a ban in force at ``now``, by key."""
        sql = (
            "SELECT node_key FROM nodes WHERE node_key IN"
            " (SELECT node_key FROM bans WHERE banned_until > ?) ORDER BY node_key"
        )
        return [bytes(r[0]) for r in self._all(sql, (now,))]

    def node_page(self, offset: int, limit: int) -> list[NodeRecord]:
        """Registered nodes ``offset`` .. ``offset + limit`` in fingerprint order (the dashboard's
        paged node table), adverts included."""
        sql = f"SELECT {NODE_COLS} FROM nodes ORDER BY fingerprint LIMIT ? OFFSET ?"
        return [node_from_row(r) for r in self._all(sql, (max(0, limit), max(0, offset)))]

    def evictable_node(self, seen_before: float, now: float) -> bytes | None:
        """The longest-silent node last seen before ``seen_before`` that holds no active lease
        and has no ban in force at ``now`` (forgetting it loses nothing still needed)."""
        rows = self._all(
            "SELECT node_key FROM nodes WHERE last_seen < ?"
            " AND node_key NOT IN (SELECT node_key FROM leases WHERE state = 'active')"
            " AND node_key NOT IN (SELECT node_key FROM bans WHERE banned_until > ?)"
            " ORDER BY last_seen, node_key LIMIT 1",
            (seen_before, now),
        )
        return bytes(rows[0][0]) if rows else None

    def delete_node(self, node_key: bytes) -> None:
        """Forget a node row (its strikes, bans and past leases and rollouts stay)."""
        with self.transaction():
            self._exec("DELETE FROM nodes WHERE node_key = ?", (node_key,))

    # --- leases and prompts ----------------------------------------------------------------------
    def insert_lease(self, lease: LeaseRecord) -> None:
        with self.transaction():
            self._exec(
                f"INSERT INTO leases ({LEASE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    lease.lease_id, lease.node_key, lease.epoch, lease.version,
                    json.dumps(list(lease.prompts)), lease.group_size, lease.max_new_tokens,
                    lease.issued_at, lease.deadline, lease.state, lease.closed_at, lease.tokens,
                    lease.samples, lease.backend, lease.dtype,
                ),
            )  # fmt: skip
            self._many(
                "INSERT INTO prompts (prompt_index, state, lease_id) VALUES (?, 'leased', ?)"
                " ON CONFLICT (prompt_index) DO UPDATE SET state='leased',"
                " lease_id=excluded.lease_id",
                [(p, lease.lease_id) for p in lease.prompts],
            )

    def get_lease(self, lease_id: str) -> LeaseRecord | None:
        rows = self._all(f"SELECT {LEASE_COLS} FROM leases WHERE lease_id = ?", (lease_id,))
        return lease_from_row(rows[0]) if rows else None

    def leases(self, state: str | None = None) -> list[LeaseRecord]:
        if state is None:
            rows = self._all(f"SELECT {LEASE_COLS} FROM leases ORDER BY epoch")
        else:
            sql = f"SELECT {LEASE_COLS} FROM leases WHERE state = ? ORDER BY epoch"
            rows = self._all(sql, (state,))
        return [lease_from_row(r) for r in rows]

    def lease_counts(self) -> dict[str, int]:
        """``{state: number of leases}`` (one aggregate query, however long the history)."""
        rows = self._all("SELECT state, COUNT(*) FROM leases GROUP BY state")
        return {str(state): int(n) for state, n in rows}

    def active_lease_count(self, node_key: bytes) -> int:
        sql = "SELECT COUNT(*) FROM leases WHERE state = 'active' AND node_key = ?"
        return int(self._all(sql, (node_key,))[0][0])

    def due_leases(self, now: float) -> list[LeaseRecord]:
        sql = (
            f"SELECT {LEASE_COLS} FROM leases WHERE state = 'active' AND deadline <= ?"
            " ORDER BY epoch"
        )
        return [lease_from_row(r) for r in self._all(sql, (now,))]

    def next_deadline(self) -> float | None:
        """The earliest deadline of an active lease (None: none is active)."""
        value = self._all("SELECT MIN(deadline) FROM leases WHERE state = 'active'")[0][0]
        return None if value is None else float(value)

    def close_lease(self, lease_id: str, state: str, now: float) -> None:
        with self.transaction():
            self._exec(
                "UPDATE leases SET state = ?, closed_at = ? WHERE lease_id = ?",
                (state, now, lease_id),
            )

    def add_lease_progress(self, lease_id: str, tokens: int, samples: int) -> None:
        with self.transaction():
            self._exec(
                "UPDATE leases SET tokens = tokens + ?, samples = samples + ? WHERE lease_id = ?",
                (tokens, samples, lease_id),
            )

    def prompt_states(self, indices: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``{prompt_index: (state, holder lease_id)}`` for those of ``indices`` ever issued."""
        if not indices:
            return {}
        marks = ",".join("?" * len(indices))
        sql = f"SELECT prompt_index, state, lease_id FROM prompts WHERE prompt_index IN ({marks})"
        return {int(i): (str(s), str(lid)) for i, s, lid in self._all(sql, list(indices))}

    def requeue_prompts(self, indices: Sequence[int]) -> None:
        """Mark prompts (not yet done) pending: the next lease picks them up first."""
        with self.transaction():
            self._many(
                "UPDATE prompts SET state = 'pending' WHERE prompt_index = ? AND state != 'done'",
                [(i,) for i in indices],
            )

    def own_audit_copies(self, node_key: bytes, indices: Sequence[int]) -> list[int]:
        """Those of ``indices`` that are audit copies of ``node_key``'s own work."""
        if not indices:
            return []
        marks = ",".join("?" * len(indices))
        sql = f"SELECT prompt_index FROM audits WHERE source_node = ? AND prompt_index IN ({marks})"
        return [int(r[0]) for r in self._all(sql, [node_key, *indices])]

    def audit_originals(self, indices: Sequence[int]) -> dict[int, int]:
        """``{audit copy index: original prompt index}`` for the audit copies among ``indices``."""
        audit = [i for i in indices if i < 0]
        if not audit:
            return {}
        marks = ",".join("?" * len(audit))
        sql = f"SELECT prompt_index, original FROM audits WHERE prompt_index IN ({marks})"
        return {int(a): int(o) for a, o in self._all(sql, audit)}

    def pending_prompts(self, limit: int, for_node: bytes | None = None) -> list[int]:
        """Lowest pending prompt indices (audit copies, whose indices are negative, first);
        ``for_node`` never gets an audit copy of its own work."""
        sql = (
            "SELECT prompt_index FROM prompts WHERE state = 'pending' AND prompt_index NOT IN"
            " (SELECT prompt_index FROM audits WHERE source_node = ?)"
            " ORDER BY prompt_index LIMIT ?"
        )
        return [int(r[0]) for r in self._all(sql, (for_node or b"", limit))]

    def mark_prompts_done(self, indices: Sequence[int], lease_id: str) -> None:
        with self.transaction():
            self._many(
                "UPDATE prompts SET state = 'done', done_by = ? WHERE prompt_index = ?",
                [(lease_id, i) for i in indices],
            )

    # --- rollouts and verdicts -------------------------------------------------------------------
    def insert_rollouts(self, rows: Sequence[RolloutRow]) -> int:
        """Insert accepted samples; a (lease, prompt, sample) already present is skipped.

        Returns how many rows were new."""
        new = 0
        with self.transaction():
            for r in rows:
                cur = self._exec(
                    "INSERT OR IGNORE INTO rollouts (lease_id, prompt_index, sample_index,"
                    " node_key, version, prompt_id, prompt_tokens, completion_tokens, logprobs,"
                    " finish_reason, reward, exact, accepted_at, group_size)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        r.lease_id, r.prompt_index, r.sample_index, r.node_key, r.version,
                        r.prompt_id, r.prompt_tokens, r.completion_tokens, r.logprobs,
                        r.finish_reason, r.reward, int(r.exact), r.accepted_at, r.group_size,
                    ),
                )  # fmt: skip
                new += cur.rowcount
        return new

    def rollouts_after(
        self, after_seq: int, limit: int, min_version: int | None = None
    ) -> list[RolloutRow]:
        """Accepted samples with ``seq > after_seq`` (and ``version >= min_version``) in arrival
        order (at most ``limit``)."""
        if min_version is None:
            sql = f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE seq > ? ORDER BY seq LIMIT ?"
            return [rollout_from_row(r) for r in self._all(sql, (after_seq, limit))]
        sql = (
            f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE seq > ? AND version >= ? "
            "ORDER BY seq LIMIT ?"
        )
        return [rollout_from_row(r) for r in self._all(sql, (after_seq, min_version, limit))]

    def waiting_versions(self, after_seq: int, min_version: int, limit: int) -> list[int]:
        """Versions of the first ``limit`` accepted rollouts with ``seq > after_seq`` and version
        ``>= min_version``, in arrival order (the learner's queue)."""
        sql = "SELECT version FROM rollouts WHERE seq > ? AND version >= ? ORDER BY seq LIMIT ?"
        return [int(v) for (v,) in self._all(sql, (after_seq, min_version, limit))]

    def in_flight(self, min_version: int) -> list[tuple[int, int, int, float, float | None, bytes]]:
        """The active leases at version ``>= min_version``: ``(version, prompts still held, group
        size, issued_at, holder's tokens_per_s, holder's key)`` each, in the order they were
        issued."""
        sql = (
            "SELECT l.version, COUNT(*), l.group_size, l.issued_at, n.tokens_per_s, l.node_key "
            "FROM prompts p "
            "JOIN leases l ON l.lease_id = p.lease_id "
            "LEFT JOIN nodes n ON n.node_key = l.node_key "
            "WHERE p.state = 'leased' AND l.state = 'active' AND l.version >= ? "
            "GROUP BY l.lease_id ORDER BY l.epoch"
        )
        return [
            (int(v), int(k), int(g), float(t), None if tps is None else float(tps), bytes(key))
            for v, k, g, t, tps, key in self._all(sql, (min_version,))
        ]

    def max_rollout_seq(self) -> int:
        """Highest ``seq`` stored (0 when there is none)."""
        return int(self._all("SELECT COALESCE(MAX(seq), 0) FROM rollouts")[0][0])

    def rollout_count(self) -> int:
        """Rollouts ever accepted and still counted: the stored ones plus those pruned after
        the learner consumed them (:mod:`coordinator.retention`); a banned node's withdrawn
        rollouts are gone from both. Rollouts acknowledged with their re-score pending (held
        out of the feed, :mod:`coordinator.held`) count too: the count does not tell which
        leases are checked."""
        stored = int(self._all("SELECT COUNT(*) FROM rollouts")[0][0])
        held = 0
        if self._all("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'held_rollouts'"):
            held = int(self._all("SELECT COUNT(*) FROM held_rollouts")[0][0])
        return stored + held + int(self.get_meta("rollouts_pruned") or 0)

    def prune_rollouts(self, through_seq: int, accepted_before: float, limit: int) -> int:
        """Delete up to ``limit`` rollouts with ``seq <= through_seq`` accepted before
        ``accepted_before`` (oldest first), counting them in ``meta.rollouts_pruned``; one
        transaction. Returns how many were deleted."""
        with self.transaction():
            cur = self._exec(
                "DELETE FROM rollouts WHERE seq IN (SELECT seq FROM rollouts WHERE seq <= ?"
                " AND accepted_at < ? ORDER BY seq LIMIT ?)",
                (through_seq, accepted_before, max(0, limit)),
            )
            gone = int(cur.rowcount)
            if gone:
                total = int(self.get_meta("rollouts_pruned") or 0) + gone
                self.set_meta("rollouts_pruned", str(total))
        return gone

    def get_verdict(self, lease_id: str, digest: bytes) -> Verdict | None:
        sql = (
            "SELECT code, detail, accepted, duplicates FROM verdicts WHERE lease_id=? AND digest=?"
        )
        rows = self._all(sql, (lease_id, digest))
        if not rows:
            return None
        code, detail, accepted, duplicates = rows[0]
        return Verdict(str(code), str(detail), int(accepted), int(duplicates))

    def verdict_count(self, lease_id: str) -> int:
        return int(self._all("SELECT COUNT(*) FROM verdicts WHERE lease_id = ?", (lease_id,))[0][0])

    def put_verdict(self, lease_id: str, digest: bytes, verdict: Verdict, now: float) -> None:
        with self.transaction():
            self._exec(
                "INSERT OR IGNORE INTO verdicts (lease_id, digest, code, detail, accepted,"
                " duplicates, at) VALUES (?,?,?,?,?,?,?)",
                (
                    lease_id, digest, verdict.code, verdict.detail, verdict.accepted,
                    verdict.duplicates, now,
                ),
            )  # fmt: skip

    # --- strikes and bans ------------------------------------------------------------------------
    def add_strike(self, node_key: bytes, reason: str, detail: str, now: float) -> None:
        with self.transaction():
            self._exec(
                "INSERT INTO strikes (node_key, reason, detail, at) VALUES (?,?,?,?)",
                (node_key, reason, detail, now),
            )

    def live_strikes(self, node_key: bytes, since: float) -> list[str]:
        """Reasons of the node's strikes not yet consumed by a ban and newer than ``since``."""
        sql = "SELECT reason FROM strikes WHERE node_key=? AND consumed=0 AND at>=? ORDER BY id"
        return [str(r[0]) for r in self._all(sql, (node_key, since))]

    def strike_counts(self, node_key: bytes) -> dict[str, int]:
        sql = "SELECT reason, COUNT(*) FROM strikes WHERE node_key=? GROUP BY reason"
        return {str(r): int(n) for r, n in self._all(sql, (node_key,))}

    def has_record(self, node_key: bytes) -> bool:
        """Any strike or ban ever recorded for ``node_key`` (one indexed lookup each)."""
        sql = (
            "SELECT EXISTS (SELECT 1 FROM strikes WHERE node_key=?)"
            " OR EXISTS (SELECT 1 FROM bans WHERE node_key=?)"
        )
        return bool(self._all(sql, (node_key, node_key))[0][0])

    def consume_strikes(self, node_key: bytes) -> None:
        with self.transaction():
            self._exec("UPDATE strikes SET consumed=1 WHERE node_key=?", (node_key,))

    def get_ban(self, node_key: bytes) -> tuple[int, float, str] | None:
        """``(bans so far, banned_until, reason)`` or None."""
        sql = "SELECT bans, banned_until, reason FROM bans WHERE node_key=?"
        rows = self._all(sql, (node_key,))
        return (int(rows[0][0]), float(rows[0][1]), str(rows[0][2])) if rows else None

    def banned_keys(self, now: float) -> set[bytes]:
        """Keys with a ban in force at ``now`` (one query for the whole swarm)."""
        rows = self._all("SELECT node_key FROM bans WHERE banned_until > ?", (now,))
        return {bytes(r[0]) for r in rows}

    def strike_summaries(self) -> dict[bytes, tuple[int, str, str, float]]:
        """Per node with strikes: ``(strikes ever, latest reason, its detail, its time)`` (one
        query for the whole swarm; SQLite takes the bare columns from the row of ``MAX(at)``)."""
        sql = "SELECT node_key, COUNT(*), reason, detail, MAX(at) FROM strikes GROUP BY node_key"
        return {bytes(k): (int(n), str(r), str(d), float(at)) for k, n, r, d, at in self._all(sql)}

    def bans(self) -> dict[bytes, tuple[int, float, str]]:
        """Every node with a ban on record: ``(bans so far, banned_until, reason)``."""
        rows = self._all("SELECT node_key, bans, banned_until, reason FROM bans")
        return {bytes(k): (int(n), float(u), str(r)) for k, n, u, r in rows}

    def put_ban(self, node_key: bytes, bans: int, until: float, reason: str) -> None:
        with self.transaction():
            self._exec(
                "INSERT OR REPLACE INTO bans (node_key, bans, banned_until, reason)"
                " VALUES (?,?,?,?)",
                (node_key, bans, until, reason),
            )

    # --- published versions ----------------------------------------------------------------------
    def put_version(self, version: int, manifest: bytes, created_at: float) -> None:
        with self.transaction():
            self._recent = None
            self._exec(
                "INSERT INTO versions (version, manifest, created_at) VALUES (?,?,?)",
                (version, manifest, created_at),
            )

    def get_version(self, version: int) -> bytes | None:
        rows = self._all("SELECT manifest FROM versions WHERE version=?", (version,))
        return bytes(rows[0][0]) if rows else None

    def latest_version(self) -> int | None:
        value = self._all("SELECT MAX(version) FROM versions")[0][0]
        return None if value is None else int(value)

    def recent_versions(self, n: int) -> tuple[int, ...]:
        """The ``n`` newest published versions, newest first (an index walk, not the history;
        kept in memory between versions)."""
        n = max(0, n)
        with self._lock:
            if self._recent is None or self._recent[0] < n:
                sql = "SELECT version FROM versions ORDER BY version DESC LIMIT ?"
                self._recent = (n, tuple(int(r[0]) for r in self._all(sql, (n,))))
            return self._recent[1][:n]

    def versions(self) -> list[int]:
        return [int(r[0]) for r in self._all("SELECT version FROM versions ORDER BY version")]
