"""The submission pipeline's pure steps (coordinator.pipeline), without SQLite or a Coordinator.

Each test builds the one-read :class:`SubmissionContext` by hand, as ``Store.load_submission``
would fill it, and asks what the pipeline answers: the screen before any check, the context the
intake checks read, the re-check inside the write transaction and the decision. Time is an
argument (no clock), so a ban's end is tested at the exact second. Checks 3–6 then run on the
built context through a real :class:`Intake` (no verifier, so no model; no store either).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.admission import admission_refusal
from coordinator.audits import AuditBook, AuditPair
from coordinator.config import IntakeSection, ReputationSection, RewardAuditSection
from coordinator.errors import IntakeRejection, Rejection
from coordinator.intake import (
    LOGPROB_EPS,
    AcceptedSample,
    CheckReport,
    Intake,
    IntakeContext,
    PromptSlot,
    check_sample,
    expected_seed,
)
from coordinator.leases import newest_servable
from coordinator.outcome import Accepted, AcceptRules, _row, accepted
from coordinator.outcome import refused as refused_outcome
from coordinator.pipeline import (
    MAX_VERDICTS_PER_LEASE,
    Proceed,
    Refusal,
    Replay,
    decide,
    intake_context,
    recheck,
    screen,
    trust_of,
)
from coordinator.records import ACK, LeaseRecord, NodeRecord, SubmissionContext, Verdict
from coordinator.reputation import Ban, Standing, StrikeDecision, ban_in_force
from coordinator.tasks import ReverseTask
from coordinator.trust import TrustState, leases_to_floor
from policy.model import CharTokenizer
from protocol.errors import ReasonCode, SchemaViolation
from protocol.messages import (
    GroupResult,
    RolloutSubmission,
    Sample,
    Timings,
    pack_logprobs,
    pack_tokens,
    unpack_tokens,
)

TOK = CharTokenizer()
TASK = ReverseTask()
NODE = b"n" * 32
OTHER = b"o" * 32
NOW = 1_000_000.0
G = 2
LEASE_SEED = 12345


def lease(state: str = "active", prompts: tuple[int, ...] = (0, 1), **kw: object) -> LeaseRecord:
    base = LeaseRecord(
        lease_id="L00000007-abc",
        node_key=NODE,
        epoch=7,
        version=3,
        prompts=prompts,
        group_size=G,
        max_new_tokens=4,
        issued_at=NOW - 10,
        deadline=NOW + 20,
        state=state,
        backend="hf",
        dtype="float32",
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def node(**kw: object) -> NodeRecord:
    base = NodeRecord(NODE, "fp", None, NOW - 100, NOW - 1, backend="vllm", dtype="bfloat16")
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def context(**kw: object) -> SubmissionContext:
    """What the store would load for a registered node holding an active lease of 2 prompts."""
    the_lease = kw.pop("lease", lease())
    assert the_lease is None or isinstance(the_lease, LeaseRecord)
    prompts = the_lease.prompts if the_lease else ()
    base = SubmissionContext(
        node=node(),
        ban=None,
        lease=the_lease,
        verdict=None,
        verdicts=0,
        prompt_states={p: ("leased", "L00000007-abc") for p in prompts},
        versions=(1, 2, 3),
        trust=None,
        has_record=False,
        originals={},
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def slots(the_lease: LeaseRecord) -> dict[str, PromptSlot]:
    out = {}
    for position, index in enumerate(the_lease.prompts):
        problem = TASK.problem(index)
        out[problem.prompt_id] = PromptSlot(
            index, problem, tuple(TOK.encode_prompt(problem.prompt)), position
        )
    return out


def submission(the_lease: LeaseRecord, *, epoch: int | None = None) -> RolloutSubmission:
    """Correct answers (reversed prompt + EOS) for every prompt of the lease."""
    groups = []
    for position, slot in enumerate(slots(the_lease).values()):
        answer = [*reversed(list(slot.token_ids)[1:-1]), TOK.eos_token_id]
        samples = [
            Sample(
                token_ids=pack_tokens(answer),
                logprobs=pack_logprobs([-0.5] * len(answer)),
                finish_reason="eos",
                seed=expected_seed(LEASE_SEED, position, j),
            )
            for j in range(G)
        ]
        groups.append(GroupResult(prompt_id=slot.problem.prompt_id, samples=samples))
    return RolloutSubmission(
        lease_id=the_lease.lease_id,
        epoch=the_lease.epoch if epoch is None else epoch,
        policy_version=the_lease.version,
        backend="hf",
        dtype="float32",
        groups=groups,
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )


def refused(answer: Replay | Refusal | Proceed) -> Refusal:
    assert isinstance(answer, Refusal), answer
    return answer


# --- screen: answers before any check of the rollouts -----------------------------------------
def test_an_unregistered_sender_is_refused_unstored() -> None:
    out = refused(screen(context(node=None), NODE, submission(lease()), NOW))
    assert out.rejection.code is ReasonCode.UNKNOWN_NODE
    assert out.lease is None  # not lease-bound: no verdict stored under the digest


def test_a_ban_holds_until_its_end_on_the_injected_time() -> None:
    ban = (2, NOW + 30.0, "3 strikes, mostly logprob_mismatch")
    out = refused(screen(context(ban=ban), NODE, submission(lease()), NOW))
    assert out.rejection.code is ReasonCode.BANNED
    assert out.rejection.retry_after_s == pytest.approx(30.0)  # same clock value, no arithmetic
    assert "ban #2" in out.rejection.detail
    # at its end the same loaded row no longer refuses: only ``now`` changed
    assert isinstance(screen(context(ban=ban), NODE, submission(lease()), NOW + 30.0), Proceed)


@pytest.mark.parametrize(
    ("the_lease", "sender", "epoch", "code"),
    [
        (None, NODE, 7, ReasonCode.UNKNOWN_LEASE),
        (lease(), OTHER, 7, ReasonCode.WRONG_NODE),
        (lease(), NODE, 6, ReasonCode.STALE_EPOCH),
        (lease(state="released"), NODE, 7, ReasonCode.LEASE_EXPIRED),
    ],
)
def test_only_the_holder_at_its_epoch_may_submit(
    the_lease: LeaseRecord | None, sender: bytes, epoch: int, code: ReasonCode
) -> None:
    ctx = context(lease=the_lease, node=node(node_key=sender))
    out = refused(screen(ctx, sender, submission(lease(), epoch=epoch), NOW))
    assert out.rejection.code is code
    assert out.lease is None


def test_the_same_bytes_get_the_stored_verdict() -> None:
    stored = Verdict(ACK, "4 samples of 2 prompts accepted; 0 groups were already completed", 4)
    out = screen(context(verdict=stored), NODE, submission(lease()), NOW)
    assert out == Replay("L00000007-abc", stored)


def test_a_flood_of_variants_is_refused_unstored_with_a_strike() -> None:
    ctx = context(verdicts=MAX_VERDICTS_PER_LEASE)
    out = refused(screen(ctx, NODE, submission(lease()), NOW))
    assert out.rejection.code is ReasonCode.DUPLICATE and out.rejection.strike
    assert out.lease is None
    below = context(verdicts=MAX_VERDICTS_PER_LEASE - 1)
    assert isinstance(screen(below, NODE, submission(lease()), NOW), Proceed)


def test_a_lease_with_nothing_open_is_closed_with_the_right_code() -> None:
    done = {0: ("done", "L00000007-abc"), 1: ("done", "L00000009-xyz")}
    complete = refused(screen(context(prompt_states=done), NODE, submission(lease()), NOW))
    assert complete.rejection.code is ReasonCode.DUPLICATE
    assert complete.lease == lease()  # lease-bound: the verdict is stored and receipted

    expired = lease(state="expired")
    fenced = {0: ("done", "L00000007-abc"), 1: ("leased", "L00000009-xyz")}
    ctx = context(lease=expired, prompt_states=fenced)
    assert refused(screen(ctx, NODE, submission(expired), NOW)).rejection.code is (
        ReasonCode.STALE_EPOCH
    )
    ctx = context(lease=expired, prompt_states=done)
    assert refused(screen(ctx, NODE, submission(expired), NOW)).rejection.code is (
        ReasonCode.LEASE_EXPIRED
    )


def test_an_expired_lease_keeps_the_prompts_it_still_holds_open() -> None:
    expired = lease(state="expired")
    states = {0: ("pending", "L00000007-abc"), 1: ("leased", "L00000009-xyz")}
    out = screen(context(lease=expired, prompt_states=states), NODE, submission(expired), NOW)
    assert out == Proceed(expired, frozenset({0}))


# --- what the checks read ---------------------------------------------------------------------
def context_for_checks(ctx: SubmissionContext, proceed: Proceed) -> IntakeContext:
    return intake_context(
        ctx, NODE, proceed, slots(proceed.lease), staleness_bound=2,
        vocab_size=TOK.vocab_size, eos_token_id=TOK.eos_token_id,
        stop_token_ids=frozenset({TOK.eos_token_id}), suspect=False, check_rate=0.25,
        lease_seed=LEASE_SEED,
    )  # fmt: skip


def test_the_checks_hold_the_node_to_its_lease_registration() -> None:
    ctx = context()
    proceed = screen(ctx, NODE, submission(lease()), NOW)
    assert isinstance(proceed, Proceed)
    check = context_for_checks(ctx, proceed)
    assert (check.backend, check.dtype) == ("hf", "float32")
    assert check.current_version == 3 and check.known_versions == {1, 2, 3}
    # a lease from before registrations were recorded: the node's current one applies
    old = lease(backend="", dtype="")
    check = context_for_checks(context(lease=old), Proceed(old, frozenset({0, 1})))
    assert (check.backend, check.dtype) == ("vllm", "bfloat16")


def test_checks_3_to_6_run_on_the_built_context_without_a_store() -> None:
    ctx = context()
    proceed = screen(ctx, NODE, submission(lease()), NOW)
    assert isinstance(proceed, Proceed)
    intake = Intake(TASK, TOK, verifier=None, secret=b"s" * 32)
    intake.offload = _inline
    accepted = asyncio.run(intake.verify(submission(lease()), context_for_checks(ctx, proceed)))
    assert len(accepted) == 2 * G and all(a.reward == 1.0 for a in accepted)
    # the version check reads the loaded versions: v3 is 3 behind v6 (S = 2)
    stale = context(versions=(1, 2, 3, 4, 5, 6))
    with pytest.raises(IntakeRejection) as err:
        asyncio.run(intake.verify(submission(lease()), context_for_checks(stale, proceed)))
    assert err.value.code is ReasonCode.TOO_STALE


def test_a_submission_is_scored_in_one_hop_and_its_rows_keep_the_wire_bytes() -> None:
    """Reward scoring leaves the event loop once per submission, not once per group (a hop
    cost more than scoring a small group); the accepted samples carry the submission's own
    packed bytes, which the stored rows take as they are."""
    ctx = context()
    sub = submission(lease())
    proceed = screen(ctx, NODE, sub, NOW)
    assert isinstance(proceed, Proceed)
    intake = Intake(TASK, TOK, verifier=None, secret=b"s" * 32)
    hops: list[str] = []

    async def counting(fn: Callable[..., Any], *args: Any) -> Any:
        hops.append(fn.__name__)
        return fn(*args)

    intake.offload = counting
    got = asyncio.run(intake.verify(sub, context_for_checks(ctx, proceed)))
    assert len(sub.groups) == 2 and len(got) == 2 * G
    assert hops == ["score_groups"]
    wire = {
        (g.prompt_id, j): (x.token_ids, x.logprobs)
        for g in sub.groups
        for j, x in enumerate(g.samples)
    }
    for a in got:
        assert a.packed is not None
        assert a.packed[0] == pack_tokens(a.prompt_tokens)
        assert a.packed[1:] == wire[(a.prompt_id, a.sample_index)]
        assert unpack_tokens(a.packed[1]) == a.completion_tokens
        row = _row(lease(), NODE, sub, a, NOW)  # the stored row: the wire bytes as they are
        assert (row.prompt_tokens, row.completion_tokens, row.logprobs) == a.packed
        assert row.completion_tokens is wire[(a.prompt_id, a.sample_index)][0]


def _check_sample_reference(
    tokens: list[int], logprobs: list[float], finish: str, vocab: int, limit: int,
    stops: frozenset[int],
) -> str | None:  # fmt: skip
    """Check 5 as the per-token Python loops wrote it before it ran on numpy views: the
    reason code of the first failure, None when the sample passes."""
    if len(tokens) != len(logprobs):
        return "schema"
    if next((t for t in tokens if t >= vocab), None) is not None:
        return "token_out_of_vocab"
    if len(tokens) > limit:
        return "length_exceeded"
    if any(x > LOGPROB_EPS for x in logprobs):
        return "logprob_mismatch"
    body = tokens[:-1] if finish in ("eos", "stop") else tokens
    if next((i for i, t in enumerate(body) if t in stops), None) is not None:
        return "bad_termination"
    if finish in ("eos", "stop") and (not tokens or tokens[-1] not in stops):
        return "bad_termination"
    if finish == "length" and len(tokens) != limit:
        return "bad_termination"
    return None


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOK.vocab_size + 2), max_size=6),
    logprobs=st.lists(
        st.one_of(
            st.floats(-30.0, 0.0, width=32),
            st.sampled_from([LOGPROB_EPS, 2 * LOGPROB_EPS, 1e-5, 0.5, -0.0]),
        ),
        max_size=6,
    ),
    finish=st.sampled_from(["eos", "stop", "length"]),
    same_length=st.booleans(),
)
def test_check_sample_agrees_with_the_per_token_loops(
    tokens: list[int], logprobs: list[float], finish: str, same_length: bool
) -> None:
    """The numpy check 5 refuses exactly what the Python loops refused, with the same code,
    and returns the same token ids and log-probs (float32 values, as Python floats)."""
    if same_length:
        logprobs = (logprobs + [-1.0] * len(tokens))[: len(tokens)]
    ctx = context()
    proceed = screen(ctx, NODE, submission(lease()), NOW)
    assert isinstance(proceed, Proceed)
    check = context_for_checks(ctx, proceed)  # max_new_tokens 4, stop set {EOS}
    try:
        sample = Sample(
            token_ids=pack_tokens(tokens), logprobs=pack_logprobs(logprobs),
            finish_reason=finish, seed=0,  # type: ignore[arg-type]
        )  # fmt: skip
    except SchemaViolation:  # refused at decode (token/log-prob counts): never reaches check 5
        assert len(tokens) != len(logprobs)
        return
    f32 = [float(x) for x in np.asarray(logprobs, dtype=np.float32)]
    want = _check_sample_reference(
        tokens, f32, finish, TOK.vocab_size, check.lease.max_new_tokens, check.stop_token_ids
    )
    try:
        got_tokens, got_logprobs = check_sample(sample, check, "here")
    except IntakeRejection as exc:
        assert exc.code.value == want
        return
    assert want is None
    assert got_tokens == tokens and got_logprobs == f32
    assert all(type(t) is int for t in got_tokens) and all(type(x) is float for x in got_logprobs)


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs the reward scoring inline (no thread: nothing here blocks for long)."""
    return fn(*args)


def test_a_node_with_a_record_but_no_trust_row_is_a_suspect() -> None:
    assert trust_of(context(has_record=True)).suspect
    assert not trust_of(context()).suspect
    row = (3, False, None, None, 40)
    assert trust_of(context(trust=row)).clean_leases == 40


# --- inside the write transaction -------------------------------------------------------------
def test_the_recheck_keeps_only_prompts_still_open() -> None:
    sub = submission(lease())
    states = {0: ("done", "L00000009-xyz"), 1: ("leased", "L00000007-abc")}
    assert recheck(context(prompt_states=states), NODE, sub, [0, 1]) == Proceed(
        lease(), frozenset({1})
    )
    # both completed elsewhere meanwhile: closed as a duplicate, lease-bound
    done = {0: ("done", "L00000009-xyz"), 1: ("done", "L00000009-xyz")}
    out = refused(recheck(context(prompt_states=done), NODE, sub, [0, 1]))
    assert out.rejection.code is ReasonCode.DUPLICATE and out.lease == lease()


def test_the_recheck_answers_a_race_won_by_the_same_bytes_and_a_release() -> None:
    sub = submission(lease())
    won = Verdict(ACK, "accepted", 4)
    assert recheck(context(verdict=won), NODE, sub, [0, 1]) == Replay("L00000007-abc", won)
    released = context(lease=lease(state="released"))
    out = refused(recheck(released, NODE, sub, [0, 1]))
    assert out.rejection.code is ReasonCode.LEASE_EXPIRED and out.lease is None


def test_the_decision_counts_samples_prompts_and_skipped_groups() -> None:
    sub = submission(lease())
    out = decide(sub, [1, 1], tokens=8, samples=2)
    assert out.prompts == (1,) and out.tokens == 8
    assert out.verdict == Verdict(
        ACK, "2 samples of 1 prompts accepted; 1 groups were already completed elsewhere", 2, 1
    )


# --- heartbeats and lease requests: one read (LeaseDesk.load_sender), then pure rules ------------
def test_leases_name_the_newest_servable_version_of_the_loaded_ones() -> None:
    recent = (5, 4, 3)  # the S + 1 newest, newest first
    assert newest_servable(recent, None) == 5
    assert newest_servable(recent, {3, 4}.__contains__) == 4  # v5 not held yet
    assert newest_servable(recent, {1, 2}.__contains__) is None  # nothing within S is held
    assert newest_servable((), None) is None


def test_a_sender_is_admitted_on_the_loaded_rows_and_the_given_time() -> None:
    assert admission_refusal(NODE, node(), None, NOW) is None
    refusal = admission_refusal(NODE, None, None, NOW)
    assert refusal is not None and refusal.code is ReasonCode.UNKNOWN_NODE
    ban = ban_in_force((1, NOW + 5.0, "why"), NOW)
    refusal = admission_refusal(NODE, node(), ban, NOW)
    assert refusal is not None and refusal.code is ReasonCode.BANNED
    assert ban_in_force((1, NOW + 5.0, "why"), NOW + 5.0) is None  # over at its end


# --- the decision as a value (coordinator.outcome): what one transaction records ---------------
RULES = AcceptRules(
    intake=IntakeSection(
        spot_check_fraction=0.05, new_node_check_rate=1.0, target_forged_share=1 / 3,
        suspect_release_checks=2,
    ),
    reward_audit=RewardAuditSection(fraction=0.0, min_pairs=2, alpha=0.5),
    throughput_ewma=0.5,
    audited=lambda index: False,
)  # fmt: skip
REP = ReputationSection(strikes_to_ban=3, ban_base_s=60.0, ban_max_s=1000.0)


def samples_of(the_lease: LeaseRecord) -> list[AcceptedSample]:
    """What checks 3–6 accept of the correct submission (run without a store)."""
    intake = Intake(TASK, TOK, verifier=None, secret=b"s" * 32)
    intake.offload = _inline
    proceed = Proceed(the_lease, frozenset(the_lease.prompts))
    ctx = context(lease=the_lease)
    return asyncio.run(intake.verify(submission(the_lease), context_for_checks(ctx, proceed)))


def accept(**kw: Any) -> Accepted:
    the_lease = kw.pop("lease", lease())
    args: dict[str, Any] = dict(
        node_key=NODE, digest=b"d" * 32, sub=submission(the_lease),
        proceed=Proceed(the_lease, frozenset(the_lease.prompts)), samples=samples_of(the_lease),
        report=CheckReport(), prompt_states=context(lease=the_lease).prompt_states, node=node(),
        trust=TrustState(0, False, None, None), others={}, audit_book=AuditBook(), now=NOW,
        rules=RULES,
    )  # fmt: skip
    args.update(kw)
    return accepted(**args)


def test_an_acceptance_carries_rows_progress_and_the_completed_lease_s_throughput() -> None:
    out = accept(node=node(tokens_per_s=10.0, rollouts_per_s=None))
    assert [(r.prompt_index, r.sample_index) for r in out.rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.accepted_at == NOW and r.version == 3 for r in out.rows)
    p = out.progress
    assert p.prompts == (0, 1) and p.samples == 4 and p.completes
    # 4 samples of 4 tokens in the 10 s since issue: 1.6 tok/s, 0.4 rollouts/s; α = 0.5
    assert p.tokens == 16
    assert p.throughput == pytest.approx((0.5 * 10.0 + 0.5 * 1.6, 0.4))
    assert out.verdict.code == ACK and out.verdict.accepted == 4
    assert out.trust == TrustState(0, False, None, None, 1) and not out.forgive
    # prompt 1 completed elsewhere meanwhile: only prompt 0's group, the lease stays open
    # (prompt 1 is done, so it completes all the same); an expired lease never completes
    part = accept(proceed=Proceed(lease(), frozenset({0})))
    assert part.progress.prompts == (0,) and part.verdict.duplicates == 1
    late = accept(lease=lease(state="expired"))
    assert not late.progress.completes and late.progress.throughput is None


def test_acceptance_trust_release_and_forgiveness_follow_the_pure_rules() -> None:
    checked = CheckReport(spot_checked=True, passed=True)
    suspect = TrustState(1, True, None, None, 0)
    released = accept(trust=suspect, report=checked)  # 2 checks in a row: released, h = 0
    assert released.trust == TrustState(0, False, None, None, 0)
    # the floor after P·(1/f − 1) = 3·19 = 57 clean leases: its live strikes lapse there
    assert leases_to_floor(RULES.intake) == 57
    assert accept(trust=TrustState(0, False, None, None, 56)).forgive
    assert not accept(trust=TrustState(0, False, None, None, 57)).forgive


def test_an_audit_copy_pairs_with_its_original_and_the_sign_test_flags() -> None:
    """The audit step on loaded pairs (no store): the copy's group is paired with the original
    node's, both nodes are tested when their pairs reach min_pairs, and a flag makes the
    flagged node a suspect, keeping its relabel time."""
    copy = lease(prompts=(-1,))
    states = {-1: ("leased", copy.lease_id)}
    original = b"x" * 32
    earlier = AuditPair(-9, original, OTHER, 3, 3, 1.0, 0.0, NOW - 5)  # x above another once
    book = AuditBook({-1: (original, 3, 1.0)}, (earlier,), {})
    intake = Intake(TASK, TOK, verifier=None, secret=b"s" * 32)
    intake.offload = _inline
    ctx = context(lease=copy, prompt_states=states, originals={-1: 0})
    proceed = Proceed(copy, frozenset({-1}))
    got = asyncio.run(intake.verify(submission(copy), context_for_checks(ctx, proceed)))
    assert all(a.reward == 1.0 for a in got)
    others = {original: TrustState(4, False, None, NOW - 50, 9)}
    out = accept(
        lease=copy, proceed=proceed, samples=got, prompt_states=states, audit_book=book,
        others=others,
    )  # fmt: skip
    assert out.audit.pairs == (AuditPair(-1, original, NODE, 3, 3, 1.0, 1.0, NOW),)
    # x: d = +1 (earlier) and 0 (equal means: dropped): 1 pair < 2, not tested; NODE: 0 only
    assert out.audit.looks == () and out.flagged == ()
    book2 = AuditBook({-1: (original, 3, 1.0)}, (earlier, dataclasses.replace(
        earlier, prompt_index=-8, mean_b=0.5)), {})  # fmt: skip
    cheat = accept(
        lease=copy, proceed=proceed, samples=[dataclasses.replace(a, reward=0.0) for a in got],
        prompt_states=states, audit_book=book2, others=others,
    )  # fmt: skip
    # x: +1, +0.5, +1 -> k = 3 of n = 3, p = 1/8 <= alpha/2 = 0.25: flagged on its first look
    assert cheat.audit.looks == ((original, 1),)
    assert [f.node_key for f in cheat.audit.flags] == [original]
    assert cheat.flagged == ((original, TrustState(0, True, NOW, NOW - 50, 0),
                              cheat.audit.flags[0].detail),)  # fmt: skip


def test_a_refusal_decides_the_strike_the_ban_and_trust_from_the_loaded_standing() -> None:
    rejection = Rejection(ReasonCode.BAD_TERMINATION, "finish 'length' below max", strike=True)
    refusal = Refusal("L00000007-abc", rejection, lease())
    trust = TrustState(5, False, None, NOW - 9, 30)
    one = refused_outcome(
        refusal, NODE, b"d" * 32, None, standing=(Standing(None, ()), trust), now=NOW,
        reputation=REP, ban_multiple=10.0,
    )  # fmt: skip
    assert one.strike == StrikeDecision("bad_termination", rejection.detail, None)
    assert one.trust == TrustState(0, True, None, NOW - 9, 0) and not one.withdraw
    assert one.verdict == Verdict("bad_termination", rejection.detail)
    assert one.lease == lease() and not one.close_lease
    third = refused_outcome(
        refusal, NODE, b"d" * 32, None,
        standing=(Standing((1, NOW - 1.0, "old"), ("schema", "bad_termination")), trust),
        now=NOW, reputation=REP, ban_multiple=10.0,
    )  # fmt: skip
    assert third.strike is not None and third.withdraw
    assert third.strike.ban == Ban(NOW + 120.0, 2, "3 strikes, mostly bad_termination")
    far = CheckReport(figures={"severity": 12.0})
    at_once = refused_outcome(
        refusal, NODE, b"d" * 32, far, standing=(Standing(None, ()), trust), now=NOW,
        reputation=REP, ban_multiple=10.0,
    )  # fmt: skip
    assert at_once.strike is not None and at_once.strike.ban is not None
    assert at_once.strike.ban.until == NOW + 1000.0
    banned = refused_outcome(  # under a ban in force: no strike recorded, still a suspect
        refusal, NODE, b"d" * 32, None,
        standing=(Standing((1, NOW + 5.0, "x"), ()), trust), now=NOW, reputation=REP,
        ban_multiple=10.0,
    )  # fmt: skip
    assert banned.strike is None and banned.trust is not None and banned.trust.suspect
    stale = Refusal("L00000007-abc", Rejection(ReasonCode.TOO_STALE, "v3 is 3 behind"), lease())
    closes = refused_outcome(
        stale, NODE, b"d" * 32, None, standing=None, now=NOW, reputation=REP, ban_multiple=10.0
    )
    assert closes.close_lease and closes.strike is None and closes.trust is None
