"""Rollout submissions: load, check, decide, record (the coordinator's submission pipeline).

:class:`SubmissionDesk` owns the path of one submission and receives every collaborator it uses
in its constructor. :meth:`SubmissionDesk.submit` runs in one direction:

1. **load**: the lease book's upkeep (expire leases past their deadline), then everything the
   checks read in one read
   (:meth:`coordinator.submission_records.SubmissionRecords.load`);
2. **screen** (pure, :func:`coordinator.pipeline.screen`): sender admitted, lease held, a stored
   verdict for the same bytes, the per-lease verdict limit, prompts still open;
3. **check** (:meth:`coordinator.intake.Intake.verify`, checks 3–7) on an
   :class:`~coordinator.intake.IntakeContext` built from the loaded context;
4. **decide** (pure, :mod:`coordinator.outcome`) and **record**: one transaction re-reads what
   may have changed while the checks awaited (:meth:`SubmissionRecords.reload`), repeats the
   lease checks (:func:`coordinator.pipeline.recheck`), decides everything to record as one
   value (:func:`coordinator.outcome.accepted`: the accepted samples, the lease's progress,
   trust, forgiveness, the reward audit's work and flags, the verdict and its receipt; a
   refusal: :func:`coordinator.outcome.refused`: the verdict of a lease-bound one, the strike
   or ban, trust, a banned node's withdrawal) and writes it
   (:meth:`~coordinator.submission_records.SubmissionRecords.record`).

**The ack does not wait for the re-score** (issue 34: it told a node which of its leases were
checked by its latency). :meth:`SubmissionDesk.receive` runs steps 1–4 with check 7 deferred:
a lease drawn for the re-score is acknowledged exactly as an unchecked one (same verdict, same
transaction, same counters) with its rows held out of the trainer's feed
(:mod:`coordinator.held`), and returns the :class:`HeldCheck` to run;
:meth:`SubmissionDesk.settle` runs it: passed, the rows join the feed; failed, the stored ack
becomes the refusal, the held rows are dropped (prompts re-queued) and the node is struck or
banned. :meth:`SubmissionDesk.submit` is both in one call (the final verdict: in-process
callers); the node RPC answers with :meth:`~SubmissionDesk.receive`'s ack and settles in the
background. Held leases are durable: :meth:`SubmissionDesk.settle_stored` checks those a
restart left.

Verdicts are stored by (lease, digest of the submission): the same bytes sent again get the same
answer (:meth:`SubmissionDesk.replayed_submission`), and a lease stores at most
:data:`~coordinator.pipeline.MAX_VERDICTS_PER_LEASE` distinct ones.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace

from coordinator.config import IntakeSection, ReputationSection
from coordinator.errors import IntakeRejection
from coordinator.held import HeldLease
from coordinator.intake import AcceptedSample, CheckReport, Intake, IntakeMetrics
from coordinator.leases import LeaseManager
from coordinator.outcome import AcceptRules, accepted, refused, released
from coordinator.pipeline import (
    MAX_VERDICTS_PER_LEASE,
    Refusal,
    Replay,
    intake_context,
    recheck,
    screen,
    trust_of,
)
from coordinator.records import ACK, LeaseRecord, RolloutRow, SubmissionContext, Verdict
from coordinator.slots import PromptSlots
from coordinator.store import Store
from coordinator.submission_records import SubmissionRecords, withdraw_unconsumed
from coordinator.throughput import ThroughputBook
from coordinator.trust import TrustState
from protocol.codec import decode, encode
from protocol.envelope import verify_envelope
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import fingerprint_of
from protocol.messages import (
    Ack,
    Reject,
    RolloutSubmission,
    SignedEnvelope,
    unpack_logprobs,
    unpack_tokens,
)
from swarm.faults import fault_point

__all__ = ["MAX_VERDICTS_PER_LEASE", "HeldCheck", "SubmissionDesk", "withdraw_unconsumed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldCheck:
    """The re-score an acknowledged lease still owes (:meth:`SubmissionDesk.settle` runs it)."""

    lease_id: str
    #: the digest its (ack) verdict is stored under
    digest: bytes


class SubmissionDesk:
    """Verifies and records rollout submissions (module docstring)."""

    def __init__(
        self,
        config: IntakeSection,
        *,
        store: Store,
        records: SubmissionRecords,
        clock: Callable[[], float],
        leases: LeaseManager,
        slots: PromptSlots,
        intake: Intake,
        metrics: IntakeMetrics,
        check_rate: Callable[[TrustState], float],
        rules: AcceptRules,
        reputation: ReputationSection,
        throughput: ThroughputBook,
        staleness_bound: int,
        vocab_size: int,
        eos_token_id: int,
        stop_token_ids: frozenset[int],
        problems: MutableMapping[bytes, str],
    ) -> None:
        self.config = config
        self.store = store
        self.records = records
        self.clock = clock
        self.leases = leases
        self.slots = slots
        self.intake = intake
        self.metrics = metrics
        #: the share of a node's leases re-scored, given its trust (:meth:`Trust.rate_of`)
        self.check_rate = check_rate
        self.rules = rules
        self.reputation = reputation
        self.throughput = throughput
        self.staleness_bound = staleness_bound
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids
        #: what each node last said when it gave a lease back; an accepted submission clears it
        self.problems = problems

    async def submit(
        self, node_key: bytes, sub: RolloutSubmission, arrived_at: float | None = None
    ) -> Ack | Reject:
        """Verify and store a submission, its re-score included: the final verdict, durable
        before returning (:meth:`receive`, then :meth:`settle`). Same bytes → same verdict."""
        answer, held = await self.receive(node_key, sub, arrived_at)
        return answer if held is None else await self.settle(held)

    async def receive(
        self, node_key: bytes, sub: RolloutSubmission, arrived_at: float | None = None
    ) -> tuple[Ack | Reject, HeldCheck | None]:
        """The answer a node is sent: every check but the re-score, which a lease drawn for it
        owes (the :class:`HeldCheck`, to :meth:`settle`; its rows are held meanwhile); durable
        before returning. Same bytes → same answer. ``arrived_at``: when the submission arrived
        (default: when its checks end); the node's throughput is measured up to then, not up to
        the verdict, which a node that submits in the background does not wait for."""
        digest = hashlib.sha256(encode(sub)).digest()
        self.leases.expire_due()  # the lease book's upkeep: a lease past its deadline is expired
        ctx = self.records.load(node_key, sub.lease_id, digest)
        first = screen(ctx, node_key, sub, self.clock())
        if isinstance(first, Replay):
            return _message(first.ref, first.verdict), None
        if isinstance(first, Refusal):
            return self._refuse(node_key, first, digest, known=ctx.node is not None), None
        lease = first.lease
        trust = trust_of(ctx)
        check = intake_context(
            ctx, node_key, first, self.slots.render(lease, ctx.originals),
            staleness_bound=self.staleness_bound, vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id, stop_token_ids=self.stop_token_ids,
            suspect=trust.suspect and self.config.suspect_full_check,
            check_rate=self.check_rate(trust), lease_seed=self.leases.seed_of(lease.lease_id),
        )  # fmt: skip
        check = replace(check, defer_check=True)  # the ack does not wait for the re-score
        try:
            samples = await self.intake.verify(sub, check)
        except IntakeRejection as exc:
            check.report.failed = check.report.failed or exc.code.value
            refusal = Refusal(lease.lease_id, exc, lease)
            return self._refuse(node_key, refusal, digest, check.report, known=True), None
        fault_point("submit.before_commit")
        hold = None
        if check.report.deferred:
            hold = HeldLease(
                lease.lease_id, node_key, digest, sub.policy_version, check.backend,
                check.dtype, check.suspect, check.check_rate, self.clock(),
            )  # fmt: skip
        answer, held = self._accept(
            node_key, sub, digest, samples, check.report, ctx, hold, arrived_at
        )
        return answer, HeldCheck(lease.lease_id, digest) if held else None

    async def settle(self, held: HeldCheck) -> Ack | Reject:
        """Run the re-score an acknowledged lease owes and record its end: passed (or skipped:
        no weights), its held rows join the feed; failed, its stored ack becomes the refusal,
        the rows are dropped and the node struck or banned. Returns the lease's verdict now
        (a lease no longer held, settled already or withdrawn: its stored verdict)."""
        records = self.records
        lease_id = held.lease_id
        pending = records.held.get(lease_id)
        lease = self.store.get_lease(lease_id)
        if pending is None or lease is None:
            return self._stored(lease_id, held.digest)
        samples = [_sample(row, seed) for row, seed in records.held.rows(lease_id)]
        report = CheckReport(rate=1.0 if pending.suspect else pending.rate, full=True)
        try:
            await self.intake.rescore(
                pending.version, lease, pending.backend, pending.dtype, samples, report
            )
        except IntakeRejection as exc:
            report.failed = report.failed or exc.code.value
            return self._refuse_held(pending, lease, exc, report)
        now = self.clock()
        with self.store.transaction():
            if records.held.get(lease_id) is None:  # settled meanwhile (or withdrawn: banned)
                return self._stored(lease_id, held.digest)
            verdict = self.store.get_verdict(lease_id, pending.digest)
            assert verdict is not None  # stored with the ack, in the hold's transaction
            outcome = released(
                pending, lease, verdict, report, records.trust(pending.node_key), now=now,
                release_checks=self.config.suspect_release_checks,
            )  # fmt: skip
            records.record(outcome)
        return _message(lease_id, verdict)

    async def settle_stored(self) -> int:
        """Settle every held lease in the store (those a restart left between ack and check,
        or whose check failed to run); returns how many were settled."""
        done = 0
        for pending in self.records.held.pending():
            await self.settle(HeldCheck(pending.lease_id, pending.digest))
            done += 1
        return done

    def _refuse_held(
        self, held: HeldLease, lease: LeaseRecord, exc: IntakeRejection, report: CheckReport
    ) -> Ack | Reject:
        """The failed re-score of an acknowledged lease, recorded as a refusal in the ack was."""
        self.metrics.rejected.labels(reason=exc.code.value).inc()
        node_key = held.node_key
        with self.store.transaction():
            if self.records.held.get(held.lease_id) is None:
                return self._stored(held.lease_id, held.digest)
            standing = self.records.load_standing(node_key) if exc.strike else None
            outcome = refused(
                Refusal(lease.lease_id, exc, None), node_key, held.digest, report,
                standing=standing, now=self.clock(), reputation=self.reputation,
                ban_multiple=self.config.ban_multiple,
            )  # fmt: skip
            self.records.record(replace(outcome, held=True, lease=lease))
        log.info(
            "rejected %s from %s after its ack: %s", lease.lease_id, fingerprint_of(node_key), exc
        )
        return Reject(ref=lease.lease_id, code=exc.code, detail=exc.detail)

    def _stored(self, lease_id: str, digest: bytes) -> Ack | Reject:
        """The stored verdict of a settled lease's submission."""
        verdict = self.store.get_verdict(lease_id, digest)
        if verdict is None:
            raise ValueError(f"lease {lease_id} has no stored verdict to settle")
        return _message(lease_id, verdict)

    def _accept(
        self,
        node_key: bytes,
        sub: RolloutSubmission,
        digest: bytes,
        samples: list[AcceptedSample],
        report: CheckReport,
        loaded: SubmissionContext,
        hold: HeldLease | None = None,
        arrived_at: float | None = None,
    ) -> tuple[Ack | Reject, bool]:
        """Re-read what may have changed (under the write lock), decide, record: one
        transaction. Also returns whether the rows were held (``hold``: for the re-score)."""
        now = self.clock()
        arrived = now if arrived_at is None else min(arrived_at, now)
        with self.store.transaction():
            self.leases.expire_due()  # a release or an expiry may have landed meanwhile
            ctx = self.records.reload(loaded, digest)
            again = recheck(ctx, node_key, sub, [a.prompt_index for a in samples])
            if isinstance(again, Replay):  # an identical submission won the race
                return _message(again.ref, again.verdict), False
            if isinstance(again, Refusal):
                return self._refuse(node_key, again, digest, known=ctx.node is not None), False
            book, others = self.records.audit_inputs(node_key, again.lease.prompts)
            outcome = accepted(
                node_key=node_key, digest=digest, sub=sub, proceed=again, samples=samples,
                report=report, prompt_states=ctx.prompt_states, node=ctx.node,
                trust=trust_of(ctx), others=others, audit_book=book, now=now, rules=self.rules,
                hold=hold, arrived_at=arrived,
            )  # fmt: skip
            self.records.record(outcome)
        self._measure(sub, outcome.lease, arrived)  # soft state, once the verdict is durable
        fault_point("submit.after_commit")
        self.problems.pop(node_key, None)  # it works again
        self.metrics.accepted.inc(len(outcome.rows))
        return _message(outcome.lease.lease_id, outcome.verdict), hold is not None

    def _measure(self, sub: RolloutSubmission, lease: LeaseRecord, arrived: float) -> None:
        """Fold the lease into the node's figures, observed from its issue to the submission's
        arrival (the verification queue after it is the coordinator's, not the node's)."""
        t = sub.timings
        self.throughput.record(
            lease.node_key,
            samples=sum(len(g.samples) for g in sub.groups),  # what it generated
            version=lease.version,
            generate_s=t.generate_s,
            load_s=t.load_s,
            overhead_s=t.overhead_s,
            observed_s=arrived - lease.issued_at,
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
        """Decide and record a refusal in one transaction: the verdict of a lease-bound one
        (and its receipt), the strike or ban of a registered sender (``known``, on its standing
        read in the same transaction), its trust, a banned node's withdrawal, and a lease that
        can no longer be fulfilled closed."""
        exc, ref = refusal.rejection, refusal.ref
        self.metrics.rejected.labels(reason=exc.code.value).inc()
        with self.store.transaction():
            standing = self.records.load_standing(node_key) if exc.strike and known else None
            outcome = refused(
                refusal, node_key, digest, report, standing=standing, now=self.clock(),
                reputation=self.reputation, ban_multiple=self.config.ban_multiple,
            )  # fmt: skip
            self.records.record(outcome)
            if outcome.close_lease and refusal.lease is not None:  # its version only ages
                self.leases.close_unfulfillable(refusal.lease)
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


def _sample(row: RolloutRow, seed: int) -> AcceptedSample:
    return AcceptedSample(
        row.prompt_index, row.prompt_id, row.sample_index, tuple(unpack_tokens(row.prompt_tokens)),
        unpack_tokens(row.completion_tokens), unpack_logprobs(row.logprobs), row.finish_reason,
        row.reward, row.exact, seed,
    )  # fmt: skip


def _message(ref: str, verdict: Verdict) -> Ack | Reject:
    if verdict.code == ACK:
        return Ack(ref=ref, detail=verdict.detail)
    return Reject(ref=ref, code=ReasonCode(verdict.code), detail=verdict.detail)
