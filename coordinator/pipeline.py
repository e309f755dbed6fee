"""The submission pipeline's pure steps: what to answer, given what was loaded.

A submission crosses the coordinator in one direction
(:class:`coordinator.submissions.SubmissionDesk`)::

    decode + authenticate ─► load ──────► screen ─► checks 3–7 ──► decide ─► record
    (codec, Coordinator.open) (one read:   (here)    (coordinator.   (here)    (one
                              Store.load_            intake)                   transaction)
                              submission)

Everything here is a function of its arguments: a :class:`~coordinator.records.SubmissionContext`
(the one read), the submission, the injected time. No store access, no clock. :func:`screen`
answers before any check runs (sender not admitted, lease not held, a stored verdict to replay,
a verdict flood, nothing left open); :func:`intake_context` is what checks 3–7 read;
:func:`recheck` repeats the lease checks on what the write transaction re-read (a
release or an expiry may have landed while the checks ran) and :func:`decide` builds the verdict
of an accepted submission.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.admission import admission_refusal
from coordinator.errors import Rejection
from coordinator.intake import CheckReport, IntakeContext, PromptSlot
from coordinator.leases import holder_refusal, open_prompts_of, undone_prompts
from coordinator.records import ACK, LeaseRecord, SubmissionContext, Verdict
from coordinator.reputation import ban_in_force
from coordinator.trust import TrustState, trust_state
from protocol.errors import ReasonCode
from protocol.messages import RolloutSubmission

#: Distinct submissions (by digest) whose verdicts one lease stores; more are refused unstored.
MAX_VERDICTS_PER_LEASE = 8


@dataclass(frozen=True)
class Replay:
    """An identical submission was judged before: answer its stored verdict (nothing recorded)."""

    ref: str
    verdict: Verdict


@dataclass(frozen=True)
class Refusal:
    """Refuse with ``rejection``. ``lease`` set: lease-bound (the verdict is stored under the
    submission's digest and receipted); None: refused unstored."""

    ref: str
    rejection: Rejection
    lease: LeaseRecord | None = None


@dataclass(frozen=True)
class Proceed:
    """Run the checks: the sender holds ``lease``, whose ``open_prompts`` still take results."""

    lease: LeaseRecord
    open_prompts: frozenset[int]


@dataclass(frozen=True)
class Acceptance:
    """The decision on a submission that passed every check."""

    #: the lease's prompts accepted (sorted), and the tokens of their completions
    prompts: tuple[int, ...]
    tokens: int
    #: the verdict stored and answered
    verdict: Verdict


def screen(
    ctx: SubmissionContext, node_key: bytes, sub: RolloutSubmission, now: float
) -> Replay | Refusal | Proceed:
    """The answers that need no check of the rollouts, cheapest first: the sender is registered
    and not banned, it holds the lease at this epoch, these bytes have no stored verdict, the
    lease has room for another verdict, and some prompt of it is still open."""
    refusal = admission_refusal(node_key, ctx.node, ban_in_force(ctx.ban, now), now)
    if refusal is None:
        refusal = holder_refusal(ctx.lease, node_key, sub.lease_id, sub.epoch)
    if refusal is not None:
        return Refusal(sub.lease_id, refusal)
    lease = ctx.lease
    assert lease is not None
    if ctx.verdict is not None:
        return Replay(lease.lease_id, ctx.verdict)
    if ctx.verdicts >= MAX_VERDICTS_PER_LEASE:
        # An honest node sends one submission per lease (re-sends are the same bytes); a
        # stream of variants would otherwise add a stored verdict each. Refused unstored.
        flood = Rejection(
            ReasonCode.DUPLICATE,
            f"lease {lease.lease_id} already has {MAX_VERDICTS_PER_LEASE} different "
            "submissions; re-send the same bytes to learn a verdict",
            strike=True,
        )
        return Refusal(lease.lease_id, flood)
    open_prompts = open_prompts_of(lease, ctx.prompt_states)
    if not open_prompts:
        return closed(ctx, lease)
    return Proceed(lease, frozenset(open_prompts))


def closed(ctx: SubmissionContext, lease: LeaseRecord) -> Refusal:
    """No prompt of the lease is open any more: duplicate (completed lease), or, for an
    expired lease, stale_epoch (re-issued under a newer epoch) or lease_expired (done)."""
    if lease.state == "expired" and undone_prompts(lease, ctx.prompt_states)[1]:
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
    return Refusal(lease.lease_id, exc, lease)


def trust_of(ctx: SubmissionContext) -> TrustState:
    """The sender's trust state as loaded."""
    return trust_state(ctx.trust, ctx.has_record)


def intake_context(
    ctx: SubmissionContext,
    node_key: bytes,
    proceed: Proceed,
    slots: dict[str, PromptSlot],
    *,
    staleness_bound: int,
    vocab_size: int,
    eos_token_id: int,
    stop_token_ids: frozenset[int],
    suspect: bool,
    check_rate: float,
    lease_seed: int,
) -> IntakeContext:
    """What checks 3–7 read about this submission (a fresh :class:`CheckReport` to fill in).
    The node is held to the registration recorded in its lease (its current one for a lease
    from before those were recorded)."""
    lease, node = proceed.lease, ctx.node
    return IntakeContext(
        node_key=node_key,
        lease=lease,
        slots=slots,
        open_prompts=proceed.open_prompts,
        known_versions=frozenset(ctx.versions),
        current_version=ctx.latest_version,
        staleness_bound=staleness_bound,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        suspect=suspect,
        backend=lease.backend or (node.backend if node else ""),
        dtype=lease.dtype or (node.dtype if node else ""),
        check_rate=check_rate,
        lease_seed=lease_seed,
        report=CheckReport(),
    )


def recheck(
    ctx: SubmissionContext, node_key: bytes, sub: RolloutSubmission, accepted_prompts: Sequence[int]
) -> Replay | Refusal | Proceed:
    """The lease checks again on the context re-read in the write transaction: an identical
    submission may have won the race, the lease may have been released or expired, and prompts
    may have been completed elsewhere meanwhile. ``Proceed.open_prompts`` holds the prompts of
    ``accepted_prompts`` still open (never empty)."""
    if ctx.verdict is not None and ctx.lease is not None:
        return Replay(ctx.lease.lease_id, ctx.verdict)
    refusal = holder_refusal(ctx.lease, node_key, sub.lease_id, sub.epoch)
    if refusal is not None:
        return Refusal(sub.lease_id, refusal)
    lease = ctx.lease
    assert lease is not None
    still_open = open_prompts_of(lease, ctx.prompt_states) & set(accepted_prompts)
    if not still_open:
        return closed(ctx, lease)
    return Proceed(lease, frozenset(still_open))


def decide(sub: RolloutSubmission, prompts: Sequence[int], tokens: int, samples: int) -> Acceptance:
    """The verdict of a submission whose ``samples`` samples of ``prompts`` are accepted (the
    groups it sent for other prompts were completed elsewhere)."""
    done = tuple(sorted(set(prompts)))
    skipped = len(sub.groups) - len(done)
    verdict = Verdict(
        ACK, f"{samples} samples of {len(done)} prompts accepted; {skipped} groups "
        "were already completed elsewhere", samples, skipped,
    )  # fmt: skip
    return Acceptance(done, tokens, verdict)
