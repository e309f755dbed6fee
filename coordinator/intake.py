"""Verification of rollout submissions (DESIGN.md §7), cheapest check first.

Checks 1–2 (frame size, schema, envelope signature, replay window, known and unbanned node) happen
before a submission reaches this module (codec, :func:`protocol.envelope.open_envelope`,
:meth:`coordinator.core.Coordinator.open`). This module runs checks 3–7 as small functions, each
raising :class:`~coordinator.errors.IntakeRejection` with a protocol reason code, in this order
(docs/protocol.md §12 is the normative list):

3. :func:`check_labels`      the submission's backend and dtype are those the node registered
                             (recorded in the lease): a submission never chooses its own checks
   :func:`check_groups`      group belongs to the lease, is complete (G samples), no duplicates,
                             and the submission answers every prompt of the lease
4. :func:`check_version`     claimed policy version is the lease's, and within S of the current;
   :func:`check_seeds`       every sample names the seed the lease assigns it
5. :func:`check_sample`      token ids in vocabulary, length within limits, log-probs <= 0,
                             termination legitimate (a token of the lease's stop set last iff
                             "eos"/"stop", length == max_new_tokens iff "length")
6. :func:`score_rewards`     reward recomputed by the task verifier from the decoded completion
                             (the wire has no reward field at all: a node cannot even claim one)
7. :meth:`Intake.spot_check` every sample of a checked lease re-scored at the claimed version
                             (:class:`LogprobVerifier`) against the tolerance the coordinator
                             calibrated for that version; the sampling statistic, and every token
                             replayed from its seed (``sampling_mismatch``), whatever the
                             backend. A suspect node is checked on every lease.

A lease is spot-checked when ``HMAC(secret, lease_id) < rate``, the node's adaptive check rate
(:mod:`coordinator.trust`): unpredictable for a node, which does not know the secret. What was
checked, with its figures, is written into :class:`CheckReport` for the receipt log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter

from coordinator.errors import IntakeRejection
from coordinator.logprobs import LogprobVerifier, VerifierUnavailable
from coordinator.problems import Problem, Task
from coordinator.store import LeaseRecord
from policy.model import Tokenizer
from policy.sampling import prompt_seed, sample_seed
from protocol.errors import ReasonCode
from protocol.messages import RolloutSubmission, Sample
from protocol.packed import logprobs_array, pack_tokens, tokens_array

log = logging.getLogger(__name__)

#: ``asyncio.to_thread``-like: ``await offload(fn, *args)`` returns ``fn(*args)``.
Offload = Callable[..., Awaitable[Any]]

#: A behaviour log-prob may exceed 0 by float32 rounding only.
LOGPROB_EPS = 1e-4


@dataclass(frozen=True)
class PromptSlot:
    """One prompt of the lease as the coordinator issued it."""

    index: int
    problem: Problem
    token_ids: tuple[int, ...]
    #: place of the prompt in the lease (seeds are derived from it)
    position: int = 0


@dataclass
class CheckReport:
    """What the intake checked on one submission (filled in as the checks run; receipts)."""

    #: the node's check rate when the submission arrived (1.0 for a suspect)
    rate: float = 0.0
    #: every sample re-scored (suspect)
    full: bool = False
    #: the spot check ran (False: not drawn, or no verifier)
    spot_checked: bool = False
    #: True/False: the spot check passed/failed; None: not run or skipped
    passed: bool | None = None
    #: the spot check's figures (statistic -> value), and ``skipped`` when weights were missing
    figures: dict[str, float] = field(default_factory=dict)
    #: the check that refused the submission ("" when accepted)
    failed: str = ""
    #: drawn for check 7, which runs after the ack (the rows are held until it passes)
    deferred: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "rate": round(self.rate, 6),
            "full": self.full,
            "spot_checked": self.spot_checked,
            "passed": self.passed,
            "figures": {k: _finite_round(v) for k, v in sorted(self.figures.items())},
            "failed": self.failed,
            **({"deferred": True} if self.deferred else {}),
        }


def _finite_round(v: float) -> float | str:
    return round(v, 6) if math.isfinite(v) else str(v)


@dataclass(frozen=True)
class IntakeContext:
    """What the checks need to know besides the submission itself."""

    node_key: bytes
    lease: LeaseRecord
    #: prompt_id -> slot, for every prompt of the lease.
    slots: dict[str, PromptSlot]
    #: Prompt indices of the lease nobody has completed yet (results still accepted).
    open_prompts: frozenset[int]
    known_versions: frozenset[int]
    current_version: int | None
    staleness_bound: int
    vocab_size: int
    eos_token_id: int
    #: the lease's stop set (what the lease carried: the model's EOS ids plus configured extras)
    stop_token_ids: frozenset[int]
    #: the node is a suspect (struck or flagged, not yet released): every sample re-scored
    suspect: bool = False
    #: what the node is held to (its registration when the lease was issued)
    backend: str = "hf"
    dtype: str = "float32"
    #: the node's adaptive spot-check rate (share of its leases re-scored)
    check_rate: float = 0.0
    #: the lease's sampling seed (:meth:`coordinator.leases.LeaseManager.seed_of`)
    lease_seed: int = 0
    #: filled in by the intake as the checks run
    report: CheckReport = field(default_factory=CheckReport)
    #: check 7 runs after the ack (:meth:`Intake.rescore`): a drawn lease is only marked
    defer_check: bool = False


@dataclass(frozen=True)
class AcceptedSample:
    """A sample that passed every check, with the coordinator's reward."""

    prompt_index: int
    prompt_id: str
    sample_index: int
    prompt_tokens: tuple[int, ...]
    completion_tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float
    exact: bool
    seed: int = 0
    #: the packed bytes of ``prompt_tokens``, ``completion_tokens`` and ``logprobs`` when known
    #: (the sample's own wire bytes: the stored row takes them as they are, not re-packed)
    packed: tuple[bytes, bytes, bytes] | None = None


def _reject(code: ReasonCode, detail: str) -> IntakeRejection:
    return IntakeRejection(code, detail)


# --- check 3 ----------------------------------------------------------------------------------
def check_labels(sub: RolloutSubmission, ctx: IntakeContext) -> None:
    """The backend and dtype a submission names are the node's registered ones: they choose the
    tolerance and the re-scoring dtype, so a node may not pick them per submission."""
    if sub.backend != ctx.backend or sub.dtype != ctx.dtype:
        raise _reject(
            ReasonCode.REGISTRATION_MISMATCH,
            f"the submission says {sub.backend}/{sub.dtype}, this node registered "
            f"{ctx.backend}/{ctx.dtype}; register again to change backend or dtype",
        )


def check_groups(sub: RolloutSubmission, ctx: IntakeContext) -> None:
    seen: set[str] = set()
    for group in sub.groups:
        if group.prompt_id not in ctx.slots:
            raise _reject(
                ReasonCode.INCOMPLETE_GROUP,
                f"prompt {group.prompt_id!r} is not part of lease {ctx.lease.lease_id}",
            )
        if group.prompt_id in seen:
            raise _reject(ReasonCode.INCOMPLETE_GROUP, f"prompt {group.prompt_id!r} appears twice")
        seen.add(group.prompt_id)
        if len(group.samples) != ctx.lease.group_size:
            raise _reject(
                ReasonCode.INCOMPLETE_GROUP,
                f"prompt {group.prompt_id!r}: {len(group.samples)} samples, the lease asks for "
                f"{ctx.lease.group_size} (send whole groups only)",
            )
    if len(seen) != len(ctx.slots):
        # A node answers the whole lease: dropping the prompts it finds hard (and keeping the
        # easy ones) would bias what the learner sees.
        raise _reject(
            ReasonCode.INCOMPLETE_GROUP,
            f"the submission answers {len(seen)} of the {len(ctx.slots)} prompts of lease "
            f"{ctx.lease.lease_id}; send every prompt of the lease",
        )


# --- check 4 ----------------------------------------------------------------------------------
def check_version(sub: RolloutSubmission, ctx: IntakeContext) -> None:
    v = sub.policy_version
    if v != ctx.lease.version:
        # The whole lease is sampled on the version it named (always a published one): claiming
        # another, older or newer, is never an honest node's doing (strike).
        raise _reject(
            ReasonCode.VERSION_MISMATCH,
            f"lease {ctx.lease.lease_id} is for policy version {ctx.lease.version}, "
            f"the submission claims {v}",
        )
    if v not in ctx.known_versions or ctx.current_version is None:
        raise _reject(ReasonCode.UNKNOWN_VERSION, f"policy version {v} was never published")
    lag = ctx.current_version - v
    if lag > ctx.staleness_bound:
        raise _reject(
            ReasonCode.TOO_STALE,
            f"policy version {v} is {lag} behind {ctx.current_version} (limit S="
            f"{ctx.staleness_bound}); load the latest checkpoint",
        )


# --- check 4b ---------------------------------------------------------------------------------
def check_seeds(sub: RolloutSubmission, ctx: IntakeContext) -> None:
    """Every sample names the seed the lease assigns it (the spot check replays those seeds)."""
    for group in sub.groups:
        position = ctx.slots[group.prompt_id].position
        for j, sample in enumerate(group.samples):
            if sample.seed != expected_seed(ctx.lease_seed, position, j):
                # The detail never names the expected seed: derive it (docs/protocol.md §11).
                raise _reject(
                    ReasonCode.SAMPLING_MISMATCH,
                    f"prompt {group.prompt_id!r} sample {j}: seed {sample.seed} is not the one "
                    "the lease assigns (samples are drawn from the lease's seeds, not chosen)",
                )


def expected_seed(lease_seed: int, position: int, sample_index: int) -> int:
    """The seed the lease assigns to sample ``sample_index`` of its ``position``-th prompt
    (the node derives it the same way: :func:`node.rollouts.lease_requests`)."""
    return sample_seed(prompt_seed(lease_seed, position), sample_index)


# --- check 5 ----------------------------------------------------------------------------------
def check_sample(sample: Sample, ctx: IntakeContext, where: str) -> tuple[list[int], list[float]]:
    """Returns the unpacked ``(token_ids, logprobs)`` of a sample that passes.

    The checks run on numpy views of the packed bytes (a 2,048-token sample was ~1 ms of
    Python loops per check); log-probs are compared as float64, as the Python floats they
    unpack to."""
    toks = tokens_array(sample.token_ids)
    lps = logprobs_array(sample.logprobs)
    if toks.size != lps.size:
        raise _reject(ReasonCode.SCHEMA, f"{where}: {toks.size} tokens, {lps.size} logprobs")
    if toks.size and int(toks.max()) >= ctx.vocab_size:
        bad = int(toks[int(np.argmax(toks >= ctx.vocab_size))])  # the first one
        raise _reject(
            ReasonCode.TOKEN_OUT_OF_VOCAB, f"{where}: token id {bad} >= vocab {ctx.vocab_size}"
        )
    limit = ctx.lease.max_new_tokens
    if toks.size > limit:
        raise _reject(ReasonCode.LENGTH_EXCEEDED, f"{where}: {toks.size} tokens > {limit}")
    wide = lps.astype(np.float64)
    if not bool(np.isfinite(wide).all()):
        raise _reject(ReasonCode.NOT_FINITE, f"{where}: log-prob is NaN or infinite")
    if bool((wide > LOGPROB_EPS).any()):
        raise _reject(ReasonCode.LOGPROB_MISMATCH, f"{where}: positive log-prob")
    check_termination(toks, sample.finish_reason, ctx, limit, where)
    return toks.tolist(), wide.tolist()


def check_termination(
    tokens: Sequence[int] | npt.NDArray[np.integer], finish: str, ctx: IntakeContext, limit: int,
    where: str,
) -> None:  # fmt: skip
    """ "eos"/"stop" (either label: the node's word for which kind of stop token it was is not
    checked) iff a token of the lease's stop set is last, and none before it; "length": exactly
    ``limit`` tokens, none in the stop set. A stop token at position ``limit`` is a stop: the
    sample is "eos"/"stop", not "length" (docs/protocol.md §12.2 check 10)."""
    arr = np.asarray(tokens, dtype=np.int64)
    n = int(arr.size)
    is_stop = np.isin(arr, np.fromiter(ctx.stop_token_ids, dtype=np.int64))
    body = n - 1 if finish in ("eos", "stop") and n else n
    hits = np.flatnonzero(is_stop[:body])
    early = int(hits[0]) if hits.size else None
    if early is not None and early == n - 1:  # finish "length", a stop token last
        raise _reject(
            ReasonCode.BAD_TERMINATION,
            f"{where}: finish 'length' but the last token (id {int(arr[-1])}) is in the lease's "
            "stop set: a sample that ends on a stop token is 'eos' or 'stop', also at "
            "max_new_tokens",
        )
    if early is not None:
        raise _reject(
            ReasonCode.BAD_TERMINATION,
            f"{where}: token {early} (id {int(arr[early])}) is in the lease's stop set but "
            f"{n - 1 - early} token(s) follow it: a sample ends at its first stop token",
        )
    if finish in ("eos", "stop") and (not n or not bool(is_stop[-1])):
        raise _reject(
            ReasonCode.BAD_TERMINATION,
            f"{where}: finish {finish!r} but the last token is not in the lease's stop set",
        )
    if finish == "length" and n != limit:
        raise _reject(ReasonCode.BAD_TERMINATION, f"{where}: finish 'length' at {n} of {limit}")


# --- check 6 ----------------------------------------------------------------------------------
def score_rewards(
    task: Task, tokenizer: Tokenizer, slot: PromptSlot, samples: Sequence[tuple[list[int], str]]
) -> list[tuple[float, bool]]:
    """``(reward, exact)`` per sample, from the decoded completion text (blocking: math-verify)."""
    out = []
    for tokens, finish in samples:
        text = tokenizer.decode(list(tokens))
        finished = finish in ("eos", "stop")
        reward = float(task.reward(slot.problem, text, finished))
        exact = bool(task.exact(slot.problem, text, finished)) if reward > 0 else False
        out.append((reward, exact))
    return out


def score_groups(
    task: Task,
    tokenizer: Tokenizer,
    groups: Sequence[tuple[PromptSlot, Sequence[tuple[list[int], str]]]],
) -> list[list[tuple[float, bool]]]:
    """:func:`score_rewards` of each ``(slot, samples)`` group, in order (blocking)."""
    return [score_rewards(task, tokenizer, slot, samples) for slot, samples in groups]


def severity(value: float, limit: float) -> float:
    """How many times its limit a failed check's figure is: ``value / limit``; for a count with
    limit 0 (replay misses), ``value / (limit + 1)``; inf for a non-finite figure."""
    if not math.isfinite(value):
        return math.inf
    return abs(value) / (abs(limit) if limit > 0 else abs(limit) + 1.0)


# --- the pipeline -----------------------------------------------------------------------------
class IntakeMetrics:
    """Prometheus counters of the intake (registry injectable for tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.rejected = Counter(
            "swarm_intake_rejected", "Rejected submissions by reason", ["reason"], registry=reg
        )
        self.accepted = Counter("swarm_intake_accepted_samples", "Accepted samples", registry=reg)
        self.spot_checks = Counter(
            "swarm_intake_spot_checks", "Log-prob spot checks by result", ["result"], registry=reg
        )


class Intake:
    """Runs checks 3–7 on one submission; returns the accepted samples of the still-open prompts."""

    def __init__(
        self,
        task: Task,
        tokenizer: Tokenizer,
        *,
        verifier: LogprobVerifier | None,
        secret: bytes,
        metrics: IntakeMetrics | None = None,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.secret = secret
        self.metrics = metrics or IntakeMetrics()
        #: Runs blocking scoring (math-verify) off the event loop; injectable like the clock (the
        #: simulation runs it inline, so a submission completes without an event loop).
        self.offload: Offload = asyncio.to_thread

    def _u(self, label: str) -> float:
        mac = hmac.new(self.secret, label.encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") / 2.0**64

    def spot_checked(self, lease_id: str, rate: float) -> bool:
        """Is this lease's submission re-scored at check ``rate``? Keyed by a secret the node
        does not know."""
        return self.verifier is not None and self._u(f"spot:{lease_id}") < rate

    def drawn(self, ctx: IntakeContext) -> bool:
        """Is this submission's lease re-scored (check 7): a suspect's always, another's when
        drawn at its check rate (:meth:`spot_checked`); never without a verifier."""
        suspect = ctx.suspect and self.verifier is not None
        return suspect or self.spot_checked(ctx.lease.lease_id, ctx.check_rate)

    async def verify(self, sub: RolloutSubmission, ctx: IntakeContext) -> list[AcceptedSample]:
        """Checks 3–7; with ``ctx.defer_check``, a lease drawn for check 7 is not re-scored here
        (``ctx.report.deferred`` says so: its rows are held until :meth:`rescore`)."""
        report = ctx.report
        report.rate = 1.0 if ctx.suspect else ctx.check_rate
        check_labels(sub, ctx)
        check_groups(sub, ctx)
        check_version(sub, ctx)
        check_seeds(sub, ctx)
        Row = tuple[list[int], list[float], Sample]
        unpacked: list[list[Row]] = []
        for group in sub.groups:
            rows: list[Row] = []
            for j, sample in enumerate(group.samples):
                where = f"prompt {group.prompt_id!r} sample {j}"
                tokens, logprobs = check_sample(sample, ctx, where)
                rows.append((tokens, logprobs, sample))
            unpacked.append(rows)
        todo = [
            (ctx.slots[g.prompt_id], rows)
            for g, rows in zip(sub.groups, unpacked, strict=True)
            if ctx.slots[g.prompt_id].index in ctx.open_prompts
        ]
        accepted: list[AcceptedSample] = []
        groups = [
            (slot, [(tokens, x.finish_reason) for tokens, _, x in rows]) for slot, rows in todo
        ]
        # one hop off the event loop for the whole submission (a hop costs more than scoring a
        # small group of the embedded task)
        scored = await self.offload(score_groups, self.task, self.tokenizer, groups) if todo else []
        for (slot, group_rows), scores in zip(todo, scored, strict=True):
            prompt_packed = pack_tokens(slot.token_ids)
            for j, ((tokens, logprobs, sample), (reward, exact)) in enumerate(
                zip(group_rows, scores, strict=True)
            ):
                accepted.append(
                    AcceptedSample(
                        slot.index,
                        slot.problem.prompt_id,
                        j,
                        slot.token_ids,
                        tokens,
                        logprobs,
                        sample.finish_reason,
                        reward,
                        exact,
                        sample.seed,  # the lease's (check_seeds)
                        (prompt_packed, sample.token_ids, sample.logprobs),
                    )
                )
        if accepted and self.drawn(ctx):
            report.full = True  # a checked lease is re-scored in full (issue 34, finding 5)
            if ctx.defer_check:
                report.deferred = True
            else:
                await self.spot_check(sub, ctx, accepted)
        return accepted

    async def spot_check(
        self,
        sub: RolloutSubmission,
        ctx: IntakeContext,
        samples: Sequence[AcceptedSample],
    ) -> None:
        """Check 7: re-score every sample of the lease (one batched forward; a subset let a node
        forge a few samples per lease and be caught on a fraction of a percent of its leases):
        claimed log-probs, the sampling statistic and each token against its seeded uniform."""
        await self.rescore(
            sub.policy_version, ctx.lease, ctx.backend, ctx.dtype, samples, ctx.report
        )

    async def rescore(
        self,
        version: int,
        lease: LeaseRecord,
        backend: str,
        dtype: str,
        samples: Sequence[AcceptedSample],
        report: CheckReport,
    ) -> None:
        """Check 7 on ``samples`` of ``lease`` drawn at ``version``, held to ``backend``/``dtype``
        (the registration's, never a submission's labels); the figures go into ``report``;
        raises :class:`IntakeRejection` on a failure."""
        assert self.verifier is not None
        lease_id = lease.lease_id
        picked = [s for s in samples if s.completion_tokens]
        if not picked:
            return
        try:
            verdict = await self.verifier.check(
                version,
                [list(s.prompt_tokens) for s in picked],
                [s.completion_tokens for s in picked],
                [s.logprobs for s in picked],
                backend=backend,
                dtype=dtype,
                seeds=[s.seed for s in picked],
                steps=lease.max_new_tokens,
            )
        except VerifierUnavailable as exc:
            # The reference weights are not here (yet): the node is not at fault, so the lease is
            # not refused; the skip is counted and logged so an operator sees coverage drop.
            self.metrics.spot_checks.labels(result="skipped").inc()
            report.figures["skipped"] = 1.0
            log.warning("spot check of %s skipped: %s", lease_id, exc)
            return
        self.metrics.spot_checks.labels(result="pass" if verdict.ok else "fail").inc()
        report.spot_checked = True
        report.passed = verdict.ok
        report.figures.update(verdict.figures)
        if not verdict.ok:
            report.failed = verdict.metric
            report.figures["severity"] = severity(verdict.value, verdict.threshold)
            raise _reject(verdict.code, verdict.detail)
