"""What the coordinator writes down about verification: verdict receipts, the learner's
consumption, and verification compute against the learner's (for ``/status``).

:class:`Ledger` sits between :class:`~coordinator.core.Coordinator` and the hash-chained
:class:`~coordinator.receipts.ReceiptLog`: the core hands it each lease-bound verdict with the
:class:`~coordinator.intake.CheckReport` of the checks that ran, and the trainer's reports (step,
rollout cursor, step time); it turns them into receipt entries and keeps the compute figures.
"""

from __future__ import annotations

from typing import Any

from coordinator.intake import CheckReport
from coordinator.receipts import ReceiptLog
from coordinator.store import LeaseRecord, NodeRecord, Store, Verdict
from protocol.identity import fingerprint_of

#: meta keys: the last learner step reported and its rollout cursor (every rollout with
#: ``seq <= cursor`` consumed: trained on or dropped as stale)
LEARNER_STEP, LEARNER_CURSOR = "learner_step", "learner_cursor"

__all__ = ["Ledger"]


class Ledger:
    """Receipts of verdicts and learner steps; verification and learner compute."""

    def __init__(self, store: Store, receipts: ReceiptLog, verifier: Any = None) -> None:
        self.store = store
        self.receipts = receipts
        #: the spot-check verifier (its ``compute_s`` / ``checks`` counters), or None
        self.verifier = verifier
        #: the learner's compute reported since this process started (Σ step_time_s), seconds
        self.trainer_compute_s = 0.0

    def verdict(
        self,
        lease: LeaseRecord,
        digest: bytes,
        verdict: Verdict,
        report: CheckReport,
        seqs: tuple[int, int] | None,
        now: float,
        *,
        node: NodeRecord | None = None,
    ) -> None:
        """The receipt of a lease-bound verdict (call inside the verdict's transaction).
        ``node``: the lease holder's record when the caller has it (read only for a lease from
        before registrations were recorded in leases, and only when not given)."""
        if lease.backend:
            held = f"{lease.backend}/{lease.dtype}"
        else:  # a lease from before registrations were recorded in leases
            if node is None:
                node = self.store.get_node(lease.node_key)
            held = f"{node.backend}/{node.dtype}" if node else "?"
        self.receipts.append(
            "verdict",
            {
                "lease": lease.lease_id,
                "epoch": lease.epoch,
                "node": fingerprint_of(lease.node_key),
                "version": lease.version,
                "held_to": held,
                "digest": digest.hex(),
                "verdict": verdict.code,
                "detail": verdict.detail,
                "checks": report.as_dict(),
                "seqs": list(seqs) if seqs is not None else None,
            },
            now,
        )

    def learner_report(self, step: int, cursor: int, step_time_s: float, now: float) -> None:
        """The trainer's report with a fetch: a new learner ``step`` consumed every rollout up to
        ``cursor`` (trained on or dropped as stale) — a ``consumed`` receipt, attributing the
        rollouts to the first step whose report covers them; its ``step_time_s`` adds to the
        learner compute the verification fraction is measured against."""
        last_step = int(self.store.get_meta(LEARNER_STEP) or 0)
        if step <= last_step:
            return
        last_cursor = int(self.store.get_meta(LEARNER_CURSOR) or 0)
        with self.store.transaction():
            if cursor > last_cursor:
                self.receipts.append(
                    "consumed", {"step": step, "seqs": [last_cursor + 1, cursor]}, now
                )
                self.store.set_meta(LEARNER_CURSOR, str(cursor))
            self.store.set_meta(LEARNER_STEP, str(step))
        if step_time_s > 0:  # this process's count, like the verifier's
            steps = step - last_step if last_step else 1
            self.trainer_compute_s += step_time_s * min(steps, 1000)

    def status(self) -> dict[str, Any]:
        """Verification compute against the learner's, and the receipt log's head."""
        spent = float(getattr(self.verifier, "compute_s", 0.0))
        head, _ = self.receipts.head()
        sealed, _ = self.receipts.last_sealed()
        frac = spent / self.trainer_compute_s if self.trainer_compute_s > 0 else None
        return {
            "verification_compute_s": round(spent, 3),
            "verification_checks": int(getattr(self.verifier, "checks", 0)),
            "trainer_compute_s": round(self.trainer_compute_s, 3),
            "verification_compute_frac": round(frac, 4) if frac is not None else None,
            "receipts_head_seq": head,
            "receipts_sealed_seq": sealed,
        }
