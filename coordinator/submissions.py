"""Rollout submissions: load, check, decide, record (the coordinator's submission pipeline).

:class:`SubmissionDesk` owns the path of one submission and receives every collaborator it uses
in its constructor. :meth:`SubmissionDesk.submit` runs in one direction:

1. **load**: the lease book's upkeep (expire leases past their deadline), then everything the
   checks read in one read (:meth:`coordinator.store.Store.load_submission`);
2. **screen** (pure, :func:`coordinator.pipeline.screen`): sender admitted, lease held, a stored
   verdict for the same bytes, the per-lease verdict limit, prompts still open;
3. **check** (:meth:`coordinator.intake.Intake.verify`, checks 3–7) on an
   :class:`~coordinator.intake.IntakeContext` built from the loaded context;
4. **decide** and **record**: one transaction re-reads what may have changed while the checks
   awaited (:meth:`~coordinator.store.Store.reload_submission`), repeats the lease checks
   (:func:`coordinator.pipeline.recheck`) and records the accepted samples, the lease's
   progress, the node's throughput, trust, the verdict and its receipt; a refusal records the
   verdict (lease-bound ones), the strike or ban, trust and a banned node's withdrawal.

Verdicts are stored by (lease, digest of the submission): the same bytes sent again get the same
answer (:meth:`SubmissionDesk.replayed_submission`), and a lease stores at most
:data:`~coordinator.pipeline.MAX_VERDICTS_PER_LEASE` distinct ones.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, MutableMapping

from coordinator.audits import RewardAudits
from coordinator.config import IntakeSection
from coordinator.errors import IntakeRejection
from coordinator.intake import AcceptedSample, CheckReport, Intake, IntakeMetrics
from coordinator.leases import LeaseManager
from coordinator.ledger import Ledger
from coordinator.pipeline import (
    MAX_VERDICTS_PER_LEASE,
    Refusal,
    Replay,
    decide,
    intake_context,
    recheck,
    screen,
    trust_of,
)
from coordinator.receipts import ReceiptLog
from coordinator.reputation import Reputation
from coordinator.slots import PromptSlots
from coordinator.store import ACK, LeaseRecord, RolloutRow, Store, SubmissionContext, Verdict
from coordinator.throughput import ThroughputBook
from coordinator.trust import Trust
from protocol.codec import decode, encode
from protocol.envelope import verify_envelope
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import fingerprint_of
from protocol.messages import (
    Ack,
    Reject,
    RolloutSubmission,
    SignedEnvelope,
    pack_logprobs,
    pack_tokens,
)
from swarm.faults import fault_point

__all__ = ["MAX_VERDICTS_PER_LEASE", "SubmissionDesk", "withdraw_unconsumed"]

log = logging.getLogger(__name__)


class SubmissionDesk:
    """Verifies and records rollout submissions (module docstring)."""

    def __init__(
        self,
        config: IntakeSection,
        *,
        store: Store,
        clock: Callable[[], float],
        leases: LeaseManager,
        slots: PromptSlots,
        intake: Intake,
        metrics: IntakeMetrics,
        trust: Trust,
        reputation: Reputation,
        audits: RewardAudits,
        ledger: Ledger,
        receipts: ReceiptLog,
        throughput: ThroughputBook,
        staleness_bound: int,
        vocab_size: int,
        eos_token_id: int,
        stop_token_ids: frozenset[int],
        problems: MutableMapping[bytes, str],
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.leases = leases
        self.slots = slots
        self.intake = intake
        self.metrics = metrics
        self.trust = trust
        self.reputation = reputation
        self.audits = audits
        self.ledger = ledger
        self.receipts = receipts
        self.throughput = throughput
        self.staleness_bound = staleness_bound
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids
        #: what each node last said when it gave a lease back; an accepted submission clears it
        self.problems = problems

    async def submit(self, node_key: bytes, sub: RolloutSubmission) -> Ack | Reject:
        """Verify and store a submission; durable before returning. Same bytes → same verdict."""
        digest = hashlib.sha256(encode(sub)).digest()
        self.leases.expire_due()  # the lease book's upkeep: a lease past its deadline is expired
        ctx = self.store.load_submission(node_key, sub.lease_id, digest)
        first = screen(ctx, node_key, sub, self.clock())
        if isinstance(first, Replay):
            return _message(first.ref, first.verdict)
        if isinstance(first, Refusal):
            return self._refuse(node_key, first, digest, known=ctx.node is not None)
        lease = first.lease
        trust = trust_of(ctx)
        check = intake_context(
            ctx, node_key, first, self.slots.render(lease, ctx.originals),
            staleness_bound=self.staleness_bound, vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id, stop_token_ids=self.stop_token_ids,
            suspect=trust.suspect and self.config.suspect_full_check,
            check_rate=self.trust.rate_of(trust), lease_seed=self.leases.seed_of(lease.lease_id),
        )  # fmt: skip
        try:
            accepted = await self.intake.verify(sub, check)
        except IntakeRejection as exc:
            check.report.failed = check.report.failed or exc.code.value
            refusal = Refusal(lease.lease_id, exc, lease)
            refused = self._refuse(node_key, refusal, digest, check.report, known=True)
            if exc.code is ReasonCode.TOO_STALE:  # its version only ages: free the lease now
                self.leases.close_unfulfillable(lease)
            return refused
        fault_point("submit.before_commit")
        return self._record_accept(node_key, sub, digest, accepted, check.report, ctx)

    def _record_accept(
        self,
        node_key: bytes,
        sub: RolloutSubmission,
        digest: bytes,
        accepted: list[AcceptedSample],
        report: CheckReport,
        loaded: SubmissionContext,
    ) -> Ack | Reject:
        """Decide and record in one transaction (what may have changed re-read under the write
        lock: :meth:`Store.reload_submission`)."""
        now = self.clock()
        with self.store.transaction():
            self.leases.expire_due()  # a release or an expiry may have landed meanwhile
            ctx = self.store.reload_submission(loaded, digest)
            again = recheck(ctx, node_key, sub, [a.prompt_index for a in accepted])
            if isinstance(again, Replay):  # an identical submission won the race
                return _message(again.ref, again.verdict)
            if isinstance(again, Refusal):
                return self._refuse(node_key, again, digest, known=ctx.node is not None)
            lease = again.lease
            rows = [a for a in accepted if a.prompt_index in again.open_prompts]
            tokens = sum(len(a.completion_tokens) for a in rows)
            decision = decide(sub, [a.prompt_index for a in rows], tokens, len(rows))
            verdict = decision.verdict
            first_seq = self.store.max_rollout_seq() + 1
            self.store.insert_rollouts([_row(lease, node_key, sub, a, now) for a in rows])
            self.leases.record_result(lease, decision.prompts, tokens=tokens, samples=len(rows))
            self._measure(node_key, sub, lease, now)
            self.store.put_verdict(lease.lease_id, digest, verdict, now)
            checked = bool(report.spot_checked and report.passed)
            state = self.trust.accepted(node_key, checked=checked, state=trust_of(ctx))
            if state.clean_leases == self.trust.leases_to_floor(0) and not state.suspect:
                self.reputation.forgive(node_key)  # trust recovered: earlier strikes lapse
            rewards: dict[int, list[float]] = {}
            for a in rows:
                rewards.setdefault(a.prompt_index, []).append(a.reward)
            flags = self.audits.after_accept(
                lease_id=lease.lease_id, node_key=node_key, version=sub.policy_version,
                rewards=rewards, now=now,
            )  # fmt: skip
            last_seq = self.store.max_rollout_seq()  # one transaction: seqs are contiguous
            self.ledger.verdict(
                lease, digest, verdict, report, (first_seq, last_seq), now, node=ctx.node
            )
            for flag in flags:
                self.trust.flag(flag.node_key, flag.detail, now)
                self.receipts.append(
                    "flag", {"node": fingerprint_of(flag.node_key), "detail": flag.detail}, now
                )
        fault_point("submit.after_commit")
        self.problems.pop(node_key, None)  # it works again
        self.metrics.accepted.inc(len(rows))
        return _message(lease.lease_id, verdict)

    def _measure(
        self, node_key: bytes, sub: RolloutSubmission, lease: LeaseRecord, now: float
    ) -> None:
        t = sub.timings
        self.throughput.record(
            node_key,
            samples=sum(len(g.samples) for g in sub.groups),  # what it generated
            version=lease.version,
            generate_s=t.generate_s,
            load_s=t.load_s,
            overhead_s=t.overhead_s,
            observed_s=now - lease.issued_at,
        )

    def _refuse(
        self,
        node_key: bytes,
        refusal: Refusal,
        digest: bytes,
        report: CheckReport | None = None,
        *,
        known: bool,
    ) -> Reject:
        """Record a refusal in one transaction: the verdict of a lease-bound one (and its
        receipt), the strike or ban of a registered sender (``known``), its trust, and a banned
        node's withdrawal."""
        exc, ref, lease = refusal.rejection, refusal.ref, refusal.lease
        now = self.clock()
        self.metrics.rejected.labels(reason=exc.code.value).inc()
        with self.store.transaction():
            if lease is not None:  # lease-bound: remember the verdict for re-sends
                verdict = Verdict(exc.code.value, exc.detail)
                self.store.put_verdict(ref, digest, verdict, now)
                self.ledger.verdict(lease, digest, verdict, report or CheckReport(), None, now)
            if exc.strike and known:
                far = (report.figures.get("severity", 0.0) if report else 0.0) >= (
                    self.config.ban_multiple
                )
                if far:
                    ban = self.reputation.ban_now(node_key, exc.code.value, exc.detail, now)
                else:
                    ban = self.reputation.strike(node_key, exc.code.value, exc.detail, now)
                self.trust.struck(node_key)
                if ban is not None:
                    withdraw_unconsumed(self.store, self.receipts, node_key, now)
        log.info("rejected %s from %s: %s", ref, fingerprint_of(node_key), exc)
        return Reject(ref=ref, code=exc.code, detail=exc.detail, retry_after_s=exc.retry_after_s)

    def replayed_submission(self, env: SignedEnvelope) -> Ack | Reject | None:
        """The stored verdict for a submission envelope the replay guard refused (the same
        signed bytes sent again): re-sending a submission byte for byte returns its verdict,
        accepted or rejected, without counting anything twice. None: no verdict is stored (the
        caller answers ``replayed``)."""
        try:
            verify_envelope(env)
            sub = decode(env.payload, RolloutSubmission)
        except ProtocolError:
            return None
        lease = self.store.get_lease(sub.lease_id)
        if lease is None or lease.node_key != env.signer:
            return None
        stored = self.store.get_verdict(lease.lease_id, hashlib.sha256(encode(sub)).digest())
        return None if stored is None else _message(lease.lease_id, stored)


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


def _row(
    lease: LeaseRecord, node_key: bytes, sub: RolloutSubmission, a: AcceptedSample, now: float
) -> RolloutRow:
    return RolloutRow(
        lease.lease_id, a.prompt_index, a.sample_index, node_key, sub.policy_version,
        a.prompt_id, pack_tokens(a.prompt_tokens), pack_tokens(a.completion_tokens),
        pack_logprobs(a.logprobs), a.finish_reason, a.reward, a.exact, now, lease.group_size,
    )  # fmt: skip


def _message(ref: str, verdict: Verdict) -> Ack | Reject:
    if verdict.code == ACK:
        return Ack(ref=ref, detail=verdict.detail)
    return Reject(ref=ref, code=ReasonCode(verdict.code), detail=verdict.detail)
