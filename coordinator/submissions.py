"""Rollout submissions: verify, store, answer; the trainer's feed (a mixin of the coordinator).

:class:`SubmissionDesk` is a mixin of :class:`coordinator.core.Coordinator`, which sets the state
declared below in its ``__init__``. :meth:`SubmissionDesk.submit` runs the intake pipeline
(:mod:`coordinator.intake`, checks 3–7) on a submission for a lease the node holds, and commits
the accepted samples, the lease's progress, the node's throughput, the verdict and its receipt in
one transaction. Verdicts are stored by (lease, digest of the submission): the same bytes sent
again get the same answer (:meth:`SubmissionDesk.replayed_submission`), and a lease stores at most
:data:`MAX_VERDICTS_PER_LEASE` distinct ones. :meth:`SubmissionDesk.fetch_rollouts` is the
trainer's side: accepted rollouts in arrival order.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.audits import RewardAudits
from coordinator.config import CoordinatorConfig
from coordinator.errors import IntakeRejection, Rejection
from coordinator.intake import CheckReport, Intake, IntakeContext, IntakeMetrics, PromptSlot
from coordinator.leases import LeaseManager
from coordinator.ledger import Ledger
from coordinator.receipts import ReceiptLog
from coordinator.reputation import Reputation
from coordinator.store import ACK, LeaseRecord, NodeRecord, RolloutRow, Store, Verdict
from coordinator.throughput import ThroughputBook
from coordinator.trust import Trust
from policy.model import Tokenizer
from protocol.codec import decode, encode
from protocol.envelope import verify_envelope
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import fingerprint_of
from protocol.messages import (
    AcceptedRollout,
    Ack,
    Reject,
    RolloutBatch,
    RolloutSubmission,
    SignedEnvelope,
    pack_logprobs,
    pack_tokens,
)
from swarm.faults import fault_point

log = logging.getLogger(__name__)

#: Distinct submissions (by digest) whose verdicts one lease stores; more are refused unstored.
MAX_VERDICTS_PER_LEASE = 8


class SubmissionDesk:
    """Submissions and the trainer's feed, as a mixin of :class:`~coordinator.core.Coordinator`
    (which sets every attribute below in its ``__init__``)."""

    config: CoordinatorConfig
    store: Store
    tokenizer: Tokenizer
    stop_token_ids: tuple[int, ...]
    node_problems: dict[bytes, str]
    clock: Callable[[], float]
    leases: LeaseManager
    reputation: Reputation
    trust: Trust
    audits: RewardAudits
    receipts: ReceiptLog
    ledger: Ledger
    metrics: IntakeMetrics
    intake: Intake
    throughput: ThroughputBook

    if TYPE_CHECKING:  # defined by the coordinator (coordinator.core)

        def _admit(self, node_key: bytes) -> NodeRecord: ...

        def _slots(self, lease: LeaseRecord) -> dict[str, PromptSlot]: ...

    async def submit(self, node_key: bytes, sub: RolloutSubmission) -> Ack | Reject:
        """Verify and store a submission; durable before returning. Same bytes → same verdict."""
        digest = hashlib.sha256(encode(sub)).digest()
        try:
            self._admit(node_key)
            self.leases.expire_due()
            lease = self.leases.check_holder(node_key, sub.lease_id, sub.epoch)
        except Rejection as exc:
            return self._refuse(node_key, sub.lease_id, exc)
        stored = self.store.get_verdict(lease.lease_id, digest)
        if stored is not None:
            return _message(lease.lease_id, stored)
        if self.store.verdict_count(lease.lease_id) >= MAX_VERDICTS_PER_LEASE:
            # An honest node sends one submission per lease (re-sends are the same bytes); a
            # stream of variants would otherwise add a stored verdict each. Refused unstored.
            flood = Rejection(
                ReasonCode.DUPLICATE,
                f"lease {lease.lease_id} already has {MAX_VERDICTS_PER_LEASE} different "
                "submissions; re-send the same bytes to learn a verdict",
                strike=True,
            )
            return self._refuse(node_key, lease.lease_id, flood)
        open_prompts = self.leases.open_prompts(lease)
        if not open_prompts:
            return self._closed(node_key, lease, digest)
        ctx = self._context(node_key, lease, frozenset(open_prompts))
        try:
            accepted = await self.intake.verify(sub, ctx)
        except IntakeRejection as exc:
            ctx.report.failed = ctx.report.failed or exc.code.value
            refused = self._refuse(node_key, lease.lease_id, exc, digest, lease, ctx.report)
            if exc.code is ReasonCode.TOO_STALE:  # its version only ages: free the lease now
                self.leases.close_unfulfillable(lease)
            return refused
        fault_point("submit.before_commit")
        now = self.clock()
        with self.store.transaction():
            stored = self.store.get_verdict(lease.lease_id, digest)
            if stored is not None:  # an identical submission won the race
                return _message(lease.lease_id, stored)
            try:  # a release or an expiry may have landed while it was being verified
                self.leases.expire_due()
                lease = self.leases.check_holder(node_key, sub.lease_id, sub.epoch)
            except Rejection as exc:
                return self._refuse(node_key, sub.lease_id, exc)
            still_open = self.leases.open_prompts(lease)
            rows = [a for a in accepted if a.prompt_index in still_open]
            if not rows:
                return self._closed(node_key, lease, digest)
            first_seq = self.store.max_rollout_seq() + 1
            self.store.insert_rollouts(
                [
                    RolloutRow(
                        lease.lease_id,
                        a.prompt_index,
                        a.sample_index,
                        node_key,
                        sub.policy_version,
                        a.prompt_id,
                        pack_tokens(a.prompt_tokens),
                        pack_tokens(a.completion_tokens),
                        pack_logprobs(a.logprobs),
                        a.finish_reason,
                        a.reward,
                        a.exact,
                        now,
                        lease.group_size,
                    )
                    for a in rows
                ]
            )
            prompts = sorted({a.prompt_index for a in rows})
            tokens = sum(len(a.completion_tokens) for a in rows)
            self.leases.record_result(lease, prompts, tokens=tokens, samples=len(rows))
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
            skipped = len(sub.groups) - len(prompts)
            verdict = Verdict(
                ACK, f"{len(rows)} samples of {len(prompts)} prompts accepted; {skipped} groups "
                "were already completed elsewhere", len(rows), skipped,
            )  # fmt: skip
            self.store.put_verdict(lease.lease_id, digest, verdict, now)
            checked = bool(ctx.report.spot_checked and ctx.report.passed)
            state = self.trust.accepted(node_key, checked=checked)
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
            self.ledger.verdict(lease, digest, verdict, ctx.report, (first_seq, last_seq), now)
            for flag in flags:
                self.trust.flag(flag.node_key, flag.detail, now)
                self.receipts.append(
                    "flag", {"node": fingerprint_of(flag.node_key), "detail": flag.detail}, now
                )
        fault_point("submit.after_commit")
        self.node_problems.pop(node_key, None)  # it works again
        self.metrics.accepted.inc(len(rows))
        return _message(lease.lease_id, verdict)

    def _context(
        self, node_key: bytes, lease: LeaseRecord, open_prompts: frozenset[int]
    ) -> IntakeContext:
        current = self.store.latest_version()
        s = self.config.staleness_bound
        known = frozenset(self.store.versions())
        node = self.store.get_node(node_key)
        backend = lease.backend or (node.backend if node else "")
        dtype = lease.dtype or (node.dtype if node else "")
        trust = self.trust.state(node_key)
        suspect = trust.suspect and self.config.intake.suspect_full_check
        return IntakeContext(
            node_key=node_key,
            lease=lease,
            slots=self._slots(lease),
            open_prompts=open_prompts,
            known_versions=known,
            current_version=current,
            staleness_bound=s,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_id=self.tokenizer.eos_token_id,
            stop_token_ids=frozenset(self.stop_token_ids),
            suspect=suspect,
            backend=backend,
            dtype=dtype,
            check_rate=self.trust.rate_of(trust),
            lease_seed=self.leases.seed_of(lease.lease_id),
            report=CheckReport(),
        )

    def _closed(self, node_key: bytes, lease: LeaseRecord, digest: bytes) -> Reject:
        """No prompt of the lease is open any more: duplicate (completed lease), or, for an
        expired lease, stale_epoch (re-issued under a newer epoch) or lease_expired (done)."""
        if lease.state == "expired" and self.leases.fenced_prompts(lease):
            exc = Rejection(
                ReasonCode.STALE_EPOCH,
                f"lease {lease.lease_id} (epoch {lease.epoch}) expired and its prompts were "
                "re-issued under a newer epoch; request a new lease",
            )
        elif lease.state == "expired":
            exc = Rejection(
                ReasonCode.LEASE_EXPIRED,
                f"lease {lease.lease_id} expired and its prompts were completed by other leases",
            )
        else:
            exc = Rejection(ReasonCode.DUPLICATE, f"lease {lease.lease_id} is already complete")
        result = self._refuse(node_key, lease.lease_id, exc, digest, lease)
        assert isinstance(result, Reject)
        return result

    def _refuse(
        self,
        node_key: bytes,
        ref: str,
        exc: Rejection,
        digest: bytes | None = None,
        lease: LeaseRecord | None = None,
        report: CheckReport | None = None,
    ) -> Reject:
        now = self.clock()
        self.metrics.rejected.labels(reason=exc.code.value).inc()
        with self.store.transaction():
            if digest is not None:  # lease-bound: remember the verdict for re-sends
                verdict = Verdict(exc.code.value, exc.detail)
                self.store.put_verdict(ref, digest, verdict, now)
                if lease is not None:
                    self.ledger.verdict(lease, digest, verdict, report or CheckReport(), None, now)
            if exc.strike and self.store.get_node(node_key) is not None:
                far = (report.figures.get("severity", 0.0) if report else 0.0) >= (
                    self.config.intake.ban_multiple
                )
                if far:
                    ban = self.reputation.ban_now(node_key, exc.code.value, exc.detail, now)
                else:
                    ban = self.reputation.strike(node_key, exc.code.value, exc.detail, now)
                self.trust.struck(node_key)
                if ban is not None:
                    self._withdraw(node_key, now)
        log.info("rejected %s from %s: %s", ref, fingerprint_of(node_key), exc)
        return Reject(ref=ref, code=exc.code, detail=exc.detail, retry_after_s=exc.retry_after_s)

    def _withdraw(self, node_key: bytes, now: float) -> int:
        """A banned node's accepted rollouts the trainer has not consumed (seq above the cursor
        of its last report) are withdrawn: deleted before the trainer fetches them, their prompts
        re-queued for other nodes, a ``withdrawn`` receipt written. What it already consumed
        stays trained on (the receipt counts it). Call inside a transaction; returns the
        rollouts withdrawn."""
        cursor = int(self.store.get_meta("learner_cursor") or 0)
        prompts = [
            int(r[0])
            for r in self.store.query(
                "SELECT DISTINCT prompt_index FROM rollouts WHERE node_key = ? AND seq > ?",
                (node_key, cursor),
            )
        ]
        gone = self.store.execute(
            "DELETE FROM rollouts WHERE node_key = ? AND seq > ?", (node_key, cursor)
        )
        for index in prompts:  # done by the banned node: to be done again by another
            self.store.execute(
                "UPDATE prompts SET state = 'pending', done_by = NULL WHERE prompt_index = ?",
                (index,),
            )
        consumed = self.store.query(
            "SELECT COUNT(*) FROM rollouts WHERE node_key = ? AND seq <= ?", (node_key, cursor)
        )[0][0]
        self.receipts.append(
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

    def learner_report(self, step: int, cursor: int, step_time_s: float) -> None:
        """The trainer's figures with a fetch (:meth:`coordinator.ledger.Ledger.learner_report`)."""
        self.ledger.learner_report(step, cursor, step_time_s, self.clock())

    def fetch_rollouts(
        self, after_seq: int, max_rollouts: int, min_policy_version: int | None = None
    ) -> RolloutBatch:
        """Accepted rollouts with ``seq > after_seq`` in arrival order (the trainer's feed); with
        ``min_policy_version``, older ones are skipped in the query (a stale backlog costs the
        learner nothing: it never travels)."""
        rows = self.store.rollouts_after(after_seq, max_rollouts, min_policy_version)
        last = rows[-1].seq if rows else after_seq
        return RolloutBatch(
            rollouts=[
                AcceptedRollout(
                    seq=r.seq,
                    lease_id=r.lease_id,
                    prompt_id=r.prompt_id,
                    sample_index=r.sample_index,
                    group_size=r.group_size,
                    prompt_token_ids=r.prompt_tokens,
                    completion_token_ids=r.completion_tokens,
                    behaviour_logprobs=r.logprobs,
                    finish_reason=r.finish_reason,  # type: ignore[arg-type]
                    policy_version=r.version,
                    reward=r.reward,
                    node_fingerprint=fingerprint_of(r.node_key),
                )
                for r in rows
            ],
            last_seq=last,
        )


def _message(ref: str, verdict: Verdict) -> Ack | Reject:
    if verdict.code == ACK:
        return Ack(ref=ref, detail=verdict.detail)
    return Reject(ref=ref, code=ReasonCode(verdict.code), detail=verdict.detail)
