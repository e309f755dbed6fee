"""Rollouts of a checked lease held out of the trainer's feed until their check passes (issue 34).

The ack of a submission does not wait for its statistical re-score (the log-prob spot check,
check 7): a lease drawn for one is acknowledged exactly as an unchecked one, in the same
transaction and with the same verdict, but its accepted samples go to ``held_rollouts`` instead
of ``rollouts``, so :meth:`coordinator.feed.RolloutFeed.fetch` does not see them. The check runs
after the ack (:meth:`coordinator.submissions.SubmissionDesk.settle`); then, in one transaction:

* passed (or skipped: no weights to score with): the rows move into ``rollouts`` (new ``seq``
  numbers, so a trainer cursor that moved on meanwhile still reaches them), the clean check
  counts for the node's trust;
* failed: the held rows are deleted, their prompts re-queued, the lease's stored verdict becomes
  the refusal and the node is struck or banned, as a refusal in the ack was before.

Both tables are durable: a coordinator restarted between an ack and its check finds the lease in
``held_leases`` and checks it again (:meth:`SubmissionDesk.settle_stored`); rows move or go once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.records import RolloutRow
from coordinator.store import Store

__all__ = ["HeldLease", "HeldRollouts"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS held_leases (
    lease_id TEXT PRIMARY KEY, node_key BLOB NOT NULL, digest BLOB NOT NULL,
    version INTEGER NOT NULL, backend TEXT NOT NULL, dtype TEXT NOT NULL,
    suspect INTEGER NOT NULL, rate REAL NOT NULL, held_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS held_rollouts (
    lease_id TEXT NOT NULL, prompt_index INTEGER NOT NULL, sample_index INTEGER NOT NULL,
    node_key BLOB NOT NULL, version INTEGER NOT NULL, prompt_id TEXT NOT NULL,
    prompt_tokens BLOB NOT NULL, completion_tokens BLOB NOT NULL, logprobs BLOB NOT NULL,
    finish_reason TEXT NOT NULL, reward REAL NOT NULL, exact INTEGER NOT NULL,
    accepted_at REAL NOT NULL, group_size INTEGER NOT NULL, seed INTEGER NOT NULL,
    PRIMARY KEY (lease_id, prompt_index, sample_index));
CREATE INDEX IF NOT EXISTS held_rollouts_by_node ON held_rollouts (node_key);
"""

_COLS = (
    "lease_id, prompt_index, sample_index, node_key, version, prompt_id, prompt_tokens,"
    " completion_tokens, logprobs, finish_reason, reward, exact, accepted_at, group_size"
)


@dataclass(frozen=True)
class HeldLease:
    """A lease acknowledged with its check still to run."""

    lease_id: str
    node_key: bytes
    #: the digest its verdict is stored under
    digest: bytes
    version: int
    #: what the node is held to (its registration, from the lease)
    backend: str
    dtype: str
    #: a suspect's lease (every lease checked), and the node's check rate at the ack
    suspect: bool
    rate: float
    held_at: float


class HeldRollouts:
    """The two tables of held leases and their rows (module docstring). Every write is meant
    to run inside the caller's transaction."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.ensure_schema(SCHEMA)

    def hold(self, lease: HeldLease, rows: tuple[RolloutRow, ...], seeds: tuple[int, ...]) -> None:
        """Keep ``rows`` (with each sample's seed, which the replay needs) out of the feed."""
        store = self.store
        store.execute(
            "INSERT OR IGNORE INTO held_leases (lease_id, node_key, digest, version, backend,"
            " dtype, suspect, rate, held_at) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                lease.lease_id, lease.node_key, lease.digest, lease.version, lease.backend,
                lease.dtype, int(lease.suspect), lease.rate, lease.held_at,
            ),
        )  # fmt: skip
        for r, seed in zip(rows, seeds, strict=True):  # as Store.insert_rollouts: row by row
            store.execute(
                f"INSERT OR IGNORE INTO held_rollouts ({_COLS}, seed)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    r.lease_id, r.prompt_index, r.sample_index, r.node_key, r.version,
                    r.prompt_id, r.prompt_tokens, r.completion_tokens, r.logprobs,
                    r.finish_reason, r.reward, int(r.exact), r.accepted_at, r.group_size, seed,
                ),
            )  # fmt: skip

    def get(self, lease_id: str) -> HeldLease | None:
        rows = self.store.query(
            "SELECT lease_id, node_key, digest, version, backend, dtype, suspect, rate, held_at"
            " FROM held_leases WHERE lease_id = ?",
            (lease_id,),
        )
        return _lease(rows[0]) if rows else None

    def pending(self) -> list[HeldLease]:
        """Every lease whose check has not finished, oldest first."""
        rows = self.store.query(
            "SELECT lease_id, node_key, digest, version, backend, dtype, suspect, rate, held_at"
            " FROM held_leases ORDER BY held_at, lease_id"
        )
        return [_lease(r) for r in rows]

    def rows(self, lease_id: str) -> list[tuple[RolloutRow, int]]:
        """The held rows of a lease with their seeds, in (prompt, sample) order."""
        out = []
        for r in self.store.query(
            f"SELECT {_COLS}, seed FROM held_rollouts WHERE lease_id = ?"
            " ORDER BY prompt_index, sample_index",
            (lease_id,),
        ):
            row = RolloutRow(
                str(r[0]), int(r[1]), int(r[2]), bytes(r[3]), int(r[4]), str(r[5]), bytes(r[6]),
                bytes(r[7]), bytes(r[8]), str(r[9]), float(r[10]), bool(r[11]), float(r[12]),
                int(r[13]),
            )  # fmt: skip
            out.append((row, int(r[14])))
        return out

    def count(self) -> int:
        """Held rows (acknowledged, not in the feed yet)."""
        return int(self.store.query("SELECT COUNT(*) FROM held_rollouts")[0][0])

    def release(self, lease_id: str) -> tuple[int, int] | None:
        """Move a lease's held rows into the feed (the order they were accepted in, new seqs);
        returns the first and last seq (None: nothing was held)."""
        store = self.store
        first = store.max_rollout_seq() + 1
        moved = store.execute(
            f"INSERT OR IGNORE INTO rollouts ({_COLS}) SELECT {_COLS} FROM held_rollouts"
            " WHERE lease_id = ? ORDER BY prompt_index, sample_index",
            (lease_id,),
        )
        self._forget(lease_id)
        return (first, store.max_rollout_seq()) if moved else None

    def drop(self, lease_id: str) -> list[int]:
        """Delete a lease's held rows and re-queue their prompts (done by nobody now); returns
        the prompts re-queued."""
        prompts = self._drop_where("lease_id = ?", (lease_id,))
        self._forget(lease_id)
        return prompts

    def drop_node(self, node_key: bytes) -> int:
        """A banned node's held rows: deleted, prompts re-queued; returns the rows deleted."""
        before = self.count()
        self._drop_where("node_key = ?", (node_key,))
        self.store.execute("DELETE FROM held_leases WHERE node_key = ?", (node_key,))
        return before - self.count()

    def _drop_where(self, where: str, args: tuple[object, ...]) -> list[int]:
        store = self.store
        prompts = [
            int(r[0])
            for r in store.query(
                f"SELECT DISTINCT prompt_index FROM held_rollouts WHERE {where}", args
            )
        ]
        store.execute(f"DELETE FROM held_rollouts WHERE {where}", args)
        for index in prompts:
            store.execute(
                "UPDATE prompts SET state = 'pending', done_by = NULL WHERE prompt_index = ?",
                (index,),
            )
        return prompts

    def _forget(self, lease_id: str) -> None:
        self.store.execute("DELETE FROM held_rollouts WHERE lease_id = ?", (lease_id,))
        self.store.execute("DELETE FROM held_leases WHERE lease_id = ?", (lease_id,))


def _lease(r: tuple[Any, ...]) -> HeldLease:
    return HeldLease(
        str(r[0]), bytes(r[1]), bytes(r[2]), int(r[3]), str(r[4]), str(r[5]), bool(r[6]),
        float(r[7]), float(r[8]),
    )  # fmt: skip
