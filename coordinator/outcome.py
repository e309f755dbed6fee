"""The submission pipeline's decision as a value: everything one verdict records.

After the checks, the pipeline (:class:`coordinator.submissions.SubmissionDesk`) decides
with a pure function of what was loaded and the injected time, and hands the value to one
writer (:meth:`coordinator.submission_records.SubmissionRecords.record`), which records it in
one transaction::

    loaded context ─► accepted() ─► Accepted ──┐
    (+ checks' samples) (pure)      rows, lease progress, trust, forgiveness,
                                    audit work, flags, verdict + receipt
                                                ├─► SubmissionRecords.record (one transaction)
    loaded standing ─► refused() ─► Refused ───┤
    (ban row, live     (pure)       verdict + receipt (lease-bound), strike or ban,
     strikes, trust)                trust, withdrawal, lease closed if unfulfillable
                                                │
    held lease's check passed ─► released() ─► Released
                                    rows into the feed, the clean check's trust, receipt

A lease drawn for the re-score is acknowledged before it (``Accepted.hold``: its rows are held
out of the feed, :mod:`coordinator.held`); its check then ends in :func:`released` or in a
:func:`refused` whose ``Refused.held`` replaces the stored ack and drops the held rows.

No function here reads the store or a clock: the rules they apply are the pure ones of
:mod:`coordinator.reputation` (:func:`~coordinator.reputation.decide_strike`),
:mod:`coordinator.trust` (:func:`~coordinator.trust.accepted_state`, ...),
:mod:`coordinator.leases` (:func:`~coordinator.leases.measured_throughput`) and
:mod:`coordinator.audits` (:func:`~coordinator.audits.audit_work`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from coordinator.audits import AuditBook, AuditWork, audit_work
from coordinator.config import IntakeSection, ReputationSection, RewardAuditSection
from coordinator.errors import Rejection
from coordinator.held import HeldLease
from coordinator.intake import AcceptedSample, CheckReport
from coordinator.leases import measured_throughput, open_prompts_of
from coordinator.pipeline import Proceed, Refusal, decide
from coordinator.records import LeaseRecord, NodeRecord, RolloutRow, Verdict
from coordinator.reputation import Standing, StrikeDecision, decide_strike
from coordinator.trust import (
    TrustState,
    accepted_state,
    flagged_state,
    leases_to_floor,
    struck_state,
)
from protocol.errors import ReasonCode
from protocol.messages import RolloutSubmission, pack_logprobs, pack_tokens

__all__ = [
    "AcceptRules",
    "Accepted",
    "LeaseProgress",
    "Refused",
    "Released",
    "accepted",
    "refused",
    "released",
]


@dataclass(frozen=True)
class LeaseProgress:
    """What an acceptance does to its lease."""

    #: the lease's prompts marked done by it, and the tokens and samples added to its progress
    prompts: tuple[int, ...]
    tokens: int
    samples: int
    #: nothing of the lease is open any more: it is completed (the node's ``leases_completed``
    #: counts it)
    completes: bool
    #: the node's new running means ``(tokens_per_s, rollouts_per_s)`` when it completes
    throughput: tuple[float, float] | None


@dataclass(frozen=True)
class Accepted:
    """An accepted submission: everything its one transaction records, in order."""

    node_key: bytes
    digest: bytes
    #: the lease as re-read in the write transaction
    lease: LeaseRecord
    verdict: Verdict
    #: the policy version the samples were drawn at (the submission's)
    version: int
    rows: tuple[RolloutRow, ...]
    progress: LeaseProgress
    #: the sender's trust after this lease
    trust: TrustState
    #: its clean leases reached the floor: its live strikes lapse
    forgive: bool
    audit: AuditWork
    #: each audit flag's node, its trust after the flag and the flag's detail (after ``trust``)
    flagged: tuple[tuple[bytes, TrustState, str], ...]
    #: the checks' report and the sender's row (the verdict receipt's ``held_to``)
    report: CheckReport
    node: NodeRecord | None
    now: float
    #: drawn for the re-score, which runs after the ack: the rows are held out of the feed
    #: (with ``seeds``, each row's sample seed) until it passes; None: in the feed now
    hold: HeldLease | None = None
    seeds: tuple[int, ...] = ()


@dataclass(frozen=True)
class Released:
    """A held lease whose check passed (or was skipped): what its one transaction records."""

    held: HeldLease
    #: the lease and its stored (ack) verdict, for the receipt
    lease: LeaseRecord
    verdict: Verdict
    report: CheckReport
    #: the sender's trust after the clean check
    trust: TrustState
    now: float


@dataclass(frozen=True)
class Refused:
    """A refused submission: what its one transaction records."""

    node_key: bytes
    digest: bytes
    ref: str
    rejection: Rejection
    #: lease-bound (the verdict stored under the digest, and receipted); None: unstored
    lease: LeaseRecord | None
    report: CheckReport
    #: the strike (and ban) it earns; None: none (no strike, unknown sender, or banned already)
    strike: StrikeDecision | None
    #: the sender's trust after the strike; None: unchanged
    trust: TrustState | None
    #: the lease's version only ages (``too_stale``): close the lease now, prompts re-queued
    close_lease: bool
    now: float
    #: the failed check of a held lease: its stored ack becomes this refusal, its held rows go
    held: bool = False

    @property
    def verdict(self) -> Verdict:
        return Verdict(self.rejection.code.value, self.rejection.detail)

    @property
    def withdraw(self) -> bool:
        """Banned by this refusal: its unconsumed rollouts are withdrawn."""
        return self.strike is not None and self.strike.ban is not None


@dataclass(frozen=True)
class AcceptRules:
    """The configuration the acceptance rules read."""

    intake: IntakeSection
    reward_audit: RewardAuditSection
    #: weight of a new lease in the node's throughput means (``leases.throughput_ewma``)
    throughput_ewma: float
    #: is an original prompt re-issued as an audit copy (keyed: a pure function of its index)
    audited: Callable[[int], bool]


def refused(
    refusal: Refusal,
    node_key: bytes,
    digest: bytes,
    report: CheckReport | None,
    *,
    standing: tuple[Standing, TrustState] | None,
    now: float,
    reputation: ReputationSection,
    ban_multiple: float,
) -> Refused:
    """The record of a refusal. ``standing``: the sender's ban row, live strikes and trust,
    loaded when the refusal strikes a registered sender (None: no strike to decide)."""
    exc = refusal.rejection
    strike: StrikeDecision | None = None
    trust: TrustState | None = None
    if exc.strike and standing is not None:
        far = (report.figures.get("severity", 0.0) if report else 0.0) >= ban_multiple
        rep, state = standing
        strike = decide_strike(rep, exc.code.value, exc.detail, now, reputation, at_once=far)
        trust = struck_state(state)
    return Refused(
        node_key, digest, refusal.ref, exc, refusal.lease, report or CheckReport(), strike,
        trust, exc.code is ReasonCode.TOO_STALE and refusal.lease is not None, now,
    )  # fmt: skip


def accepted(
    *,
    node_key: bytes,
    digest: bytes,
    sub: RolloutSubmission,
    proceed: Proceed,
    samples: Sequence[AcceptedSample],
    report: CheckReport,
    prompt_states: Mapping[int, tuple[str, str]],
    node: NodeRecord | None,
    trust: TrustState,
    others: Mapping[bytes, TrustState],
    audit_book: AuditBook,
    now: float,
    rules: AcceptRules,
    hold: HeldLease | None = None,
    arrived_at: float | None = None,
) -> Accepted:
    """The record of an accepted submission whose lease checks passed again (``proceed``, on
    the ``prompt_states``, ``node`` and ``trust`` re-read in the write transaction): the
    samples of prompts still open, the lease's progress, the sender's trust, the reward audit's
    work and the flags it raises (``others``: the trust of the audited originals' nodes).
    ``hold``: the lease's re-score runs after the ack; its rows are held until then.
    ``arrived_at``: when the submission arrived (default ``now``): the node's throughput is
    measured from the lease's issue to then, its wait for the verifiers left out."""
    lease = proceed.lease
    kept = [a for a in samples if a.prompt_index in proceed.open_prompts]
    tokens = sum(len(a.completion_tokens) for a in kept)
    decision = decide(sub, [a.prompt_index for a in kept], tokens, len(kept))
    done = {p: ("done", lease.lease_id) for p in decision.prompts}
    completes = lease.state == "active" and not open_prompts_of(
        lease, {**prompt_states, **done}
    )  # fmt: skip
    throughput = None
    if completes:
        progressed = replace(lease, tokens=lease.tokens + tokens, samples=lease.samples + len(kept))
        arrived = now if arrived_at is None else arrived_at
        throughput = measured_throughput(progressed, node, arrived, rules.throughput_ewma)
    progress = LeaseProgress(decision.prompts, tokens, len(kept), completes, throughput)
    checked = bool(report.spot_checked and report.passed)
    release = rules.intake.suspect_release_checks
    after = accepted_state(trust, checked=checked, release_checks=release)
    forgive = after.clean_leases == leases_to_floor(rules.intake, 0) and not after.suspect
    rewards: dict[int, list[float]] = {}
    for a in kept:
        rewards.setdefault(a.prompt_index, []).append(a.reward)
    work = audit_work(
        audit_book, rules.reward_audit, rules.audited, node_key=node_key,
        version=sub.policy_version, rewards=rewards, now=now,
    )  # fmt: skip
    states = {**others, node_key: after}
    flagged = []
    for flag in work.flags:
        states[flag.node_key] = flagged_state(states.get(flag.node_key, _NEW), now)
        flagged.append((flag.node_key, states[flag.node_key], flag.detail))
    rows = tuple(_row(lease, node_key, sub, a, now) for a in kept)
    return Accepted(
        node_key, digest, lease, decision.verdict, sub.policy_version, rows, progress, after,
        forgive, work, tuple(flagged), report, node, now, hold,
        tuple(a.seed for a in kept) if hold is not None else (),
    )  # fmt: skip


def released(
    held: HeldLease,
    lease: LeaseRecord,
    verdict: Verdict,
    report: CheckReport,
    trust: TrustState,
    *,
    now: float,
    release_checks: int,
) -> Released:
    """The record of a held lease whose check passed: its rows released, and the check counted
    for ``trust`` (read in the write transaction) as :func:`~coordinator.trust.accepted_state`
    counts one with the ack (the lease itself was counted at the ack). A skipped check (no
    weights) releases the rows and counts nothing."""
    after = trust
    if report.spot_checked and report.passed:
        clean = trust.clean_checks + 1
        if trust.suspect and clean >= release_checks:  # released: starts again from h = 0
            after = TrustState(0, False, trust.flagged_at, trust.label_changed_at, 0)
        else:
            after = replace(trust, clean_checks=clean)
    return Released(held, lease, verdict, report, after, now)


#: the trust of a node with no row and no record (flagging it keeps nothing of it)
_NEW = TrustState(0, False, None, None)


def _row(
    lease: LeaseRecord, node_key: bytes, sub: RolloutSubmission, a: AcceptedSample, now: float
) -> RolloutRow:
    if a.packed is not None:  # the wire bytes, as pack_* would write them
        prompt, completion, logprobs = a.packed
    else:
        prompt, completion = pack_tokens(a.prompt_tokens), pack_tokens(a.completion_tokens)
        logprobs = pack_logprobs(a.logprobs)
    return RolloutRow(
        lease.lease_id, a.prompt_index, a.sample_index, node_key, sub.policy_version,
        a.prompt_id, prompt, completion, logprobs, a.finish_reason, a.reward, a.exact, now,
        lease.group_size,
    )  # fmt: skip
