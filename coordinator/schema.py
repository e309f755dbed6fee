"""The coordinator database's tables (:class:`coordinator.store.Store` creates them on open).

The tables the store's own methods read and write; :mod:`coordinator.trust`,
:mod:`coordinator.audits` and :mod:`coordinator.receipts` create their own
(:meth:`coordinator.store.Store.ensure_schema`). :data:`MIGRATIONS` adds the columns that came
after the first release to an older database.
"""

from __future__ import annotations

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    node_key BLOB PRIMARY KEY, fingerprint TEXT NOT NULL, advert BLOB, registered_at REAL NOT NULL,
    last_seen REAL NOT NULL, tokens_per_s REAL, rollouts_per_s REAL, price_per_hour REAL,
    backend TEXT NOT NULL DEFAULT '', dtype TEXT NOT NULL DEFAULT '',
    leases_completed INTEGER NOT NULL DEFAULT 0, leases_expired INTEGER NOT NULL DEFAULT 0,
    draining INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, node_key BLOB NOT NULL, epoch INTEGER NOT NULL UNIQUE,
    version INTEGER NOT NULL, prompts TEXT NOT NULL, group_size INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL, issued_at REAL NOT NULL, deadline REAL NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('active', 'completed', 'expired', 'released')),
    closed_at REAL, tokens INTEGER NOT NULL DEFAULT 0, samples INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS nodes_by_fingerprint ON nodes (fingerprint);
CREATE INDEX IF NOT EXISTS leases_by_state ON leases (state, deadline);
CREATE INDEX IF NOT EXISTS leases_by_node ON leases (node_key, state);
CREATE TABLE IF NOT EXISTS prompts (
    prompt_index INTEGER PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('leased', 'pending', 'done')),
    lease_id TEXT NOT NULL, done_by TEXT);
CREATE INDEX IF NOT EXISTS prompts_by_state ON prompts (state, prompt_index);
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, lease_id TEXT NOT NULL, prompt_index INTEGER NOT NULL,
    sample_index INTEGER NOT NULL, node_key BLOB NOT NULL, version INTEGER NOT NULL,
    prompt_id TEXT NOT NULL, prompt_tokens BLOB NOT NULL, completion_tokens BLOB NOT NULL,
    logprobs BLOB NOT NULL, finish_reason TEXT NOT NULL, reward REAL NOT NULL,
    exact INTEGER NOT NULL, accepted_at REAL NOT NULL, group_size INTEGER NOT NULL,
    UNIQUE (lease_id, prompt_index, sample_index));
CREATE TABLE IF NOT EXISTS verdicts (
    lease_id TEXT NOT NULL, digest BLOB NOT NULL, code TEXT NOT NULL, detail TEXT NOT NULL,
    accepted INTEGER NOT NULL, duplicates INTEGER NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (lease_id, digest));
CREATE TABLE IF NOT EXISTS strikes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, node_key BLOB NOT NULL, reason TEXT NOT NULL,
    detail TEXT NOT NULL, at REAL NOT NULL, consumed INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS strikes_by_node ON strikes (node_key, consumed, at);
CREATE TABLE IF NOT EXISTS bans (
    node_key BLOB PRIMARY KEY, bans INTEGER NOT NULL, banned_until REAL NOT NULL,
    reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, manifest BLOB NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS audits (
    prompt_index INTEGER PRIMARY KEY, original INTEGER NOT NULL, source_lease TEXT NOT NULL,
    source_node BLOB NOT NULL, version INTEGER NOT NULL, mean REAL NOT NULL,
    created_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS audits_by_node ON audits (source_node);
"""

#: Columns added after the first release: (table, column, declaration) for older databases.
MIGRATIONS = (
    ("leases", "backend", "TEXT NOT NULL DEFAULT ''"),
    ("leases", "dtype", "TEXT NOT NULL DEFAULT ''"),
)
