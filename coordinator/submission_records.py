"""The submission pipeline's reads and its one write, over the store.

:class:`SubmissionRecords` owns what the pipeline (:class:`coordinator.submissions.SubmissionDesk`)
reads and writes and nothing else:

* :meth:`~SubmissionRecords.load`: everything the screen and the checks read, in one read
  (:class:`~coordinator.records.SubmissionContext`);
* :meth:`~SubmissionRecords.reload` and :meth:`~SubmissionRecords.audit_inputs`: inside the write
  transaction, what may have changed while the checks awaited and what the acceptance rules
  read (the audit copies' sources and pairs, the audited nodes' trust);
  :meth:`~SubmissionRecords.load_standing`: what a strike decision reads;
* :meth:`~SubmissionRecords.record`: the decision (:class:`coordinator.outcome.Accepted`,
  :class:`~coordinator.outcome.Refused` or, for a held lease whose check passed,
  :class:`~coordinator.outcome.Released`, computed by pure functions) written in one
  transaction. An acceptance with ``hold`` keeps its rows in :class:`coordinator.held.
  HeldRollouts` (out of the feed) until its check ends.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from coordinator.audits import AuditBook, RewardAudits
from coordinator.held import HeldRollouts
from coordinator.ledger import Ledger
from coordinator.outcome import Accepted, Refused, Released
from coordinator.receipts import ReceiptLog
from coordinator.records import SubmissionContext
from coordinator.reputation import Standing, record_strike
from coordinator.store import Store
from coordinator.trust import PUT_SQL, TrustState, put_args, trust_state
from protocol.identity import fingerprint_of

__all__ = ["SubmissionContext", "SubmissionRecords", "withdraw_unconsumed"]

log = logging.getLogger(__name__)


class SubmissionRecords:
    """Reads for and writes of the submission pipeline (module docstring)."""

    def __init__(
        self, store: Store, *, receipts: ReceiptLog, ledger: Ledger, audits: RewardAudits
    ) -> None:
        self.store = store
        self.receipts = receipts
        self.ledger = ledger
        self.audits = audits
        #: rollouts of acknowledged leases whose re-score has not finished (out of the feed)
        self.held = HeldRollouts(store)

    # --- reads -----------------------------------------------------------------------------------
    def load(self, node_key: bytes, lease_id: str, digest: bytes) -> SubmissionContext:
        """What the checks of one submission need (:class:`SubmissionContext`), read under the
        connection lock (a consistent view: every write of this process takes the same lock)."""
        store = self.store
        with store.locked():
            lease = store.get_lease(lease_id)
            prompts = lease.prompts if lease is not None else ()
            trust = store.trust_row(node_key)
            return SubmissionContext(
                node=store.get_node(node_key),
                ban=store.get_ban(node_key),
                lease=lease,
                verdict=store.get_verdict(lease_id, digest),
                verdicts=store.verdict_count(lease_id),
                prompt_states=store.prompt_states(prompts),
                versions=tuple(store.versions()),
                trust=trust,
                has_record=False if trust is not None else store.has_record(node_key),
                originals=self.audits.originals(prompts),
            )

    def reload(self, ctx: SubmissionContext, digest: bytes) -> SubmissionContext:
        """``ctx`` with what the write step re-checks and records read again (the sender's row
        and trust, the lease, the verdict for ``digest``, the prompt states); the rest (ban,
        versions, verdict count, audit map: what the screen and the checks used) is kept. Call
        inside the write transaction."""
        if ctx.lease is None:
            raise ValueError("reload_submission: the context has no lease to re-read")
        store = self.store
        with store.locked():
            key, lease_id = ctx.lease.node_key, ctx.lease.lease_id
            lease = store.get_lease(lease_id)
            trust = store.trust_row(key)
            return dataclasses.replace(
                ctx,
                node=store.get_node(key),
                lease=lease,
                verdict=store.get_verdict(lease_id, digest),
                prompt_states=store.prompt_states(lease.prompts if lease is not None else ()),
                trust=trust,
                has_record=False if trust is not None else store.has_record(key),
            )

    def audit_inputs(
        self, node_key: bytes, prompts: Sequence[int]
    ) -> tuple[AuditBook, dict[bytes, TrustState]]:
        """What the acceptance rules read for the reward audit (inside the write transaction):
        the :class:`AuditBook` of a lease with ``prompts``, and the trust of the nodes whose
        originals its audit copies repeat (a flag changes it). Nothing for a lease without
        audit copies."""
        book = self.audits.book(node_key, prompts)
        others = {n: self.trust(n) for n, _, _ in book.sources.values() if n != node_key}
        return book, others

    def trust(self, node_key: bytes) -> TrustState:
        """A node's trust state (:func:`coordinator.trust.trust_state` of its row)."""
        row = self.store.trust_row(node_key)
        return trust_state(row, row is None and self.store.has_record(node_key))

    def load_standing(self, node_key: bytes) -> tuple[Standing, TrustState]:
        """What a strike decision reads (inside the write transaction): the sender's ban row and
        live strikes, and its trust."""
        with self.store.locked():
            standing = Standing(
                self.store.get_ban(node_key), tuple(self.store.live_strikes(node_key, -math.inf))
            )
            return standing, self.trust(node_key)

    # --- the one write ---------------------------------------------------------------------------
    def record(self, outcome: Accepted | Refused | Released) -> None:
        """Write a decision in one transaction."""
        with self.store.transaction():
            if isinstance(outcome, Accepted):
                self._accepted(outcome)
            elif isinstance(outcome, Released):
                self._released(outcome)
            else:
                self._refused(outcome)

    def _accepted(self, o: Accepted) -> None:
        store, lease, p = self.store, o.lease, o.progress
        first_seq = store.max_rollout_seq() + 1
        if o.hold is not None:  # out of the feed until its check passes
            self.held.hold(o.hold, o.rows, o.seeds)
        else:
            store.insert_rollouts(o.rows)
        store.mark_prompts_done(p.prompts, lease.lease_id)
        store.add_lease_progress(lease.lease_id, p.tokens, p.samples)
        if p.completes:
            store.close_lease(lease.lease_id, "completed", o.now)
            store.bump_node(lease.node_key, "leases_completed")
            if p.throughput is not None:
                tps, rps = p.throughput
                store.update_node(lease.node_key, tokens_per_s=tps, rollouts_per_s=rps)
        store.put_verdict(lease.lease_id, o.digest, o.verdict, o.now)
        store.execute(PUT_SQL, put_args(o.node_key, o.trust))
        if o.forgive:  # trust recovered: earlier strikes lapse
            store.execute(
                "UPDATE strikes SET consumed = 1 WHERE node_key = ? AND consumed = 0", (o.node_key,)
            )
        self.audits.record(
            o.audit, lease_id=lease.lease_id, node_key=o.node_key, version=o.version, now=o.now
        )
        last_seq = store.max_rollout_seq()  # one transaction: seqs are contiguous
        if o.hold is None:  # a held lease's one verdict receipt is written when its check ends
            seqs = (first_seq, last_seq)
            self.ledger.verdict(lease, o.digest, o.verdict, o.report, seqs, o.now, node=o.node)
        for key, state, detail in o.flagged:
            store.execute(PUT_SQL, put_args(key, state, detail))
            self.receipts.append("flag", {"node": fingerprint_of(key), "detail": detail}, o.now)

    def _released(self, o: Released) -> None:
        """A held lease's check passed: its rows join the feed (new seqs) and the check counts."""
        seqs = self.held.release(o.held.lease_id)
        self.store.execute(PUT_SQL, put_args(o.held.node_key, o.trust))
        self.ledger.verdict(o.lease, o.held.digest, o.verdict, o.report, seqs, o.now)

    def _refused(self, o: Refused) -> None:
        store = self.store
        if o.held:  # the failed check of an acknowledged lease: the ack stored becomes this
            store.execute(
                "UPDATE verdicts SET code = ?, detail = ?, accepted = 0, duplicates = 0, at = ?"
                " WHERE lease_id = ? AND digest = ?",
                (o.verdict.code, o.verdict.detail, o.now, o.ref, o.digest),
            )
            self.held.drop(o.ref)
        if o.lease is not None:  # lease-bound: remember the verdict for re-sends
            store.put_verdict(o.ref, o.digest, o.verdict, o.now)
            self.ledger.verdict(o.lease, o.digest, o.verdict, o.report, None, o.now)
        if o.strike is not None:
            record_strike(store, o.node_key, o.strike, o.now)
        if o.trust is not None:
            store.execute(PUT_SQL, put_args(o.node_key, o.trust))
        if o.withdraw:
            withdraw_unconsumed(store, self.receipts, o.node_key, o.now)
            self.held.drop_node(o.node_key)  # nothing of a banned node reaches the feed


def withdraw_unconsumed(store: Store, receipts: ReceiptLog, node_key: bytes, now: float) -> int:
    """A banned node's accepted rollouts the trainer has not consumed (seq above the cursor
    of its last report) are withdrawn: deleted before the trainer fetches them, their prompts
    re-queued for other nodes, a ``withdrawn`` receipt written. What it already consumed
    stays trained on (the receipt counts it). Call inside a transaction; returns the
    rollouts withdrawn."""
    cursor = int(store.get_meta("learner_cursor") or 0)
    prompts = [
        int(r[0])
        for r in store.query(
            "SELECT DISTINCT prompt_index FROM rollouts WHERE node_key = ? AND seq > ?",
            (node_key, cursor),
        )
    ]
    gone = store.execute("DELETE FROM rollouts WHERE node_key = ? AND seq > ?", (node_key, cursor))
    for index in prompts:  # done by the banned node: to be done again by another
        store.execute(
            "UPDATE prompts SET state = 'pending', done_by = NULL WHERE prompt_index = ?",
            (index,),
        )
    consumed = store.query(
        "SELECT COUNT(*) FROM rollouts WHERE node_key = ? AND seq <= ?", (node_key, cursor)
    )[0][0]
    receipts.append(
        "withdrawn",
        {"node": fingerprint_of(node_key), "rollouts": gone, "prompts": len(prompts),
         "consumed_before": int(consumed), "cursor": cursor},
        now,
    )  # fmt: skip
    log.warning(
        "withdrew %d unconsumed rollouts (%d prompts re-queued) of banned node %s; %d were "
        "consumed already", gone, len(prompts), fingerprint_of(node_key), consumed,
    )  # fmt: skip
    return gone
