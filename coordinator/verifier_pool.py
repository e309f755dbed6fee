"""Re-scores as jobs on one queue, taken by every verifier the coordinator has (issue 35).

Re-scoring is stateless given (version, samples, seeds): the coordinator keeps checks 1-6, the
verdict's consequences and the commit, and hands check 7 to whichever verifier asks first:

* its own process (``verification.local_verifier``): a task here takes one job at a time and
  runs it on the :class:`~coordinator.logprobs.InProcessLogprobVerifier`;
* verifier processes the operator runs (``swarm coordinator verifier``, on this machine or on
  others, one per GPU), signing with a key listed in ``verification.verifier_keys``. Each asks
  with ``rswarm/vtake`` (a long poll), re-scores, and answers ``rswarm/vdone``
  (:class:`VerifierHandlers`).

Every job is acknowledged by its verdict. A job taken and not answered within
``verification.job_timeout_s`` is given to the next verifier that asks, up to
``verification.job_attempts`` times; a verifier that answers ``unavailable`` (it cannot fetch the
version) or ``error`` (its re-score failed) is not given that job again. The first verdict from
any verifier the job was given to wins (the verdict is the same by construction, the calibration
aside); a later one is refused. A job nobody could finish raises :class:`VerificationTimeout` to
the caller: the node handlers re-score the lease later and its rows stay held meanwhile, so an
outage or a failing verifier never lets unchecked work through. Only when the coordinator's own
verifier said it cannot score the version (it does not hold the weights) does the caller get
:class:`~coordinator.logprobs.VerifierUnavailable` (the intake's "skipped", as before verifier
processes). A queued job waits for as long as some verifier is present (the queue is bounded by
the node handlers' pending re-scores); with none present for ``PRESENT_S`` it fails too.

Each verdict is metered into V under its verifier's name (:class:`~coordinator.verify_budget.
VerifierMeter`): the process's re-scoring seconds and tokens for a verifier process (its own
``compute_s``, not the round trip), the in-process counters for the coordinator's own. The
pool's ``compute_s`` / ``checks`` / ``tokens`` add up all of them (the ledger's verification
share).

Soft state: a restarted coordinator has no queue; the held leases are re-scored again at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

from coordinator.errors import Rejection
from coordinator.logprobs import LogprobVerdict, LogprobVerifier, VerifierUnavailable
from protocol import limits as L
from protocol.codec import decode, encode
from protocol.envelope import open_envelope
from protocol.errors import ReasonCode
from protocol.identity import fingerprint_of, parse_fingerprint, short_fingerprint
from protocol.limits import MAX_FLOAT
from protocol.messages import (
    Ack,
    SignedEnvelope,
    Standby,
    VerifyGroup,
    VerifyJob,
    VerifySample,
    VerifyTake,
    VerifyVerdict,
    pack_logprobs,
    pack_tokens,
    unpack_logprobs,
    unpack_tokens,
)
from protocol.schema import Dtype

log = logging.getLogger(__name__)

LOCAL = "local"
#: a verifier process that asked within this many seconds counts as present (the long poll is
#: at most 30 s, so a working verifier asks at least that often)
PRESENT_S = 60.0
#: the longest a verifier's ask is held open when no job is queued (VerifyTake.wait_s's bound)
MAX_TAKE_WAIT_S = 30.0


class VerificationTimeout(Exception):
    """No verifier finished the job in time (not the node's fault: re-score it later)."""


@dataclass(frozen=True)
class CheckArgs:
    """What :meth:`coordinator.logprobs.LogprobVerifier.check` takes."""

    version: int
    prompt_ids: list[list[int]]
    completions: list[list[int]]
    claimed_logprobs: list[list[float]]
    backend: str
    dtype: str
    seeds: list[int] | None
    steps: int | None

    async def run(self, verifier: LogprobVerifier) -> LogprobVerdict:
        return await verifier.check(
            self.version, self.prompt_ids, self.completions, self.claimed_logprobs,
            backend=self.backend, dtype=self.dtype, seeds=self.seeds, steps=self.steps,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompt_ids, self.completions, strict=True))


@dataclass
class _Job:
    job_id: str
    args: CheckArgs
    future: asyncio.Future[LogprobVerdict]
    #: times given out so far
    given: int = 0
    #: verifiers that said they cannot score it (unavailable, error), with what they said
    refused_by: dict[str, str] = field(default_factory=dict)
    #: those of them whose re-score failed (``error``), not that they lack the version
    failed_by: set[str] = field(default_factory=set)
    #: every verifier it was given to (any of them may answer it: the first verdict wins)
    takers: set[str] = field(default_factory=set)
    taker: str | None = None
    #: clock seconds by which its taker must answer
    deadline: float = 0.0


def job_message(job_id: str, args: CheckArgs, deadline: float) -> VerifyJob:
    """The wire form of a job: samples grouped by consecutive equal prompts."""
    groups: list[VerifyGroup] = []
    last: list[int] | None = None
    for i, (prompt, completion, claimed) in enumerate(
        zip(args.prompt_ids, args.completions, args.claimed_logprobs, strict=True)
    ):
        sample = VerifySample(
            token_ids=pack_tokens(completion),
            logprobs=pack_logprobs(claimed),
            seed=args.seeds[i] if args.seeds is not None else 0,
        )
        if last is not None and prompt == last and len(groups[-1].samples) < L.MAX_GROUP_SIZE:
            groups[-1].samples.append(sample)
        else:
            groups.append(VerifyGroup(prompt_token_ids=pack_tokens(prompt), samples=[sample]))
            last = prompt
    return VerifyJob(
        job_id=job_id, version=args.version, backend=args.backend,
        dtype=cast(Dtype, args.dtype),  # the registration's, a Dtype by the advert's schema
        steps=args.steps, replay=args.seeds is not None, groups=groups, deadline=deadline,
    )  # fmt: skip


def job_args(job: VerifyJob) -> CheckArgs:
    """The check a :class:`VerifyJob` asks for (the verifier process's side)."""
    prompts, completions, claimed, seeds = [], [], [], []
    for group in job.groups:
        prompt = unpack_tokens(group.prompt_token_ids)
        for s in group.samples:
            prompts.append(prompt)
            completions.append(unpack_tokens(s.token_ids))
            claimed.append(unpack_logprobs(s.logprobs))
            seeds.append(s.seed)
    return CheckArgs(
        job.version, prompts, completions, claimed, job.backend, job.dtype,
        seeds if job.replay else None, job.steps,
    )  # fmt: skip


def finite(x: float) -> float:
    """``x`` as the wire carries it: ±inf clamped to the largest finite float, NaN to the largest
    (a re-score's statistic is infinite when a claimed token lies outside top-k/top-p: the
    verdict must still travel)."""
    if math.isnan(x):
        return MAX_FLOAT
    return max(-MAX_FLOAT, min(MAX_FLOAT, x))


def verdict_message(
    job_id: str, verdict: LogprobVerdict, *, compute_s: float, tokens: int
) -> VerifyVerdict:
    name, keys = L.MAX_NAME_LEN, L.MAX_STATUS_KEYS
    figures = {k[:name]: finite(v) for k, v in list(verdict.figures.items())[:keys]}
    return VerifyVerdict(
        job_id=job_id, outcome="pass" if verdict.ok else "fail", metric=verdict.metric[:name],
        value=finite(verdict.value), threshold=finite(verdict.threshold),
        detail=verdict.detail[: L.MAX_TEXT_LEN], code=verdict.code, figures=figures,
        compute_s=max(0.0, finite(compute_s)), tokens=tokens,
    )  # fmt: skip


class VerifierPool:
    """The intake's verifier (:class:`~coordinator.logprobs.LogprobVerifier`): each check is a
    job on the queue (module docstring). ``local``: the coordinator's own verifier (None: only
    verifier processes); ``clock``: Unix seconds (job deadlines travel)."""

    def __init__(
        self,
        local: LogprobVerifier | None,
        *,
        job_timeout_s: float,
        attempts: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.local = local
        self.job_timeout_s = job_timeout_s
        self.attempts = max(1, attempts)
        self.clock = clock
        self._queue: deque[_Job] = deque()
        self._taken: dict[str, _Job] = {}
        #: every job not finished yet, by id (queued or taken)
        self._jobs: dict[str, _Job] = {}
        self._changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._prefix = f"{time.time_ns():x}"  # job ids unique across restarts
        #: verifier name -> clock time it last asked for a job
        self._seen: dict[str, float] = {}
        self._worker: asyncio.Task[None] | None = None
        self._meter: Any = None
        self._metered_local: Any = local
        #: re-scoring done by the verifier processes (the in-process one keeps its own)
        self.remote_compute_s = 0.0
        self.remote_checks = 0
        self.remote_tokens = 0
        #: jobs given again after their taker's deadline, and jobs that failed
        self.redelivered = 0
        self.timed_out = 0

    # --- what the ledger and the budget read -----------------------------------------------------
    @property
    def compute_s(self) -> float:
        return float(getattr(self.local, "compute_s", 0.0)) + self.remote_compute_s

    @property
    def checks(self) -> int:
        return int(getattr(self.local, "checks", 0)) + self.remote_checks

    @property
    def tokens(self) -> int:
        return int(getattr(self.local, "tokens", 0)) + self.remote_tokens

    def attach_meter(self, meter: Any, clock: Callable[[], float]) -> None:
        """Meter every verdict into ``meter`` (:class:`coordinator.verify_budget.VerifierMeter`)
        under its verifier's name; ``clock`` is the budget's."""
        from coordinator.verify_budget import MeteredVerifier

        self._meter, self._meter_clock = meter, clock
        if self.local is not None:
            self._metered_local = MeteredVerifier(self.local, meter, clock, name=LOCAL)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        present = [n for n in self._present(now) if n != LOCAL]
        return {
            "verify_jobs_queued": len(self._queue),
            "verify_jobs_taken": len(self._taken),
            "verify_jobs_redelivered": self.redelivered,
            "verify_jobs_timed_out": self.timed_out,
            "verifier_processes": len(present),
        }

    # --- the life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the coordinator's own verifier's worker (if it has one)."""
        if self.local is not None and self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work_locally())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        for job in [*self._queue, *self._taken.values()]:
            if not job.future.done():
                job.future.set_exception(VerificationTimeout("the coordinator is stopping"))
        self._queue.clear()
        self._taken.clear()
        self._jobs.clear()

    # --- the intake's side -----------------------------------------------------------------------
    async def check(
        self,
        version: int,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        claimed_logprobs: list[list[float]],
        *,
        backend: str = "hf",
        dtype: str = "float32",
        seeds: list[int] | None = None,
        steps: int | None = None,
    ) -> LogprobVerdict:
        if seeds is not None and len(seeds) != len(completions):
            raise ValueError(f"{len(seeds)} seeds for {len(completions)} completions")
        args = CheckArgs(
            version, prompt_ids, completions, claimed_logprobs, backend, dtype, seeds, steps
        )
        job = _Job(f"{self._prefix}-{next(self._ids)}", args,
                   asyncio.get_running_loop().create_future())  # fmt: skip
        self._jobs[job.job_id] = job
        self._queue.append(job)
        self._notify()
        # every slice: the deadlines of taken jobs are enforced (even when nobody asks for
        # work), and a job still queued fails once no verifier has been present for PRESENT_S
        step = min(self.job_timeout_s, PRESENT_S / 4)
        absent_since: float | None = None
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(job.future), step)
                now = self.clock()
                self._sweep(now)
                if job.future.done():
                    continue
                if self._taken.get(job.job_id) is job or self._could_take(job, now):
                    absent_since = None
                    continue
                absent_since = now if absent_since is None else absent_since
                if now - absent_since >= PRESENT_S:
                    self.timed_out += 1
                    raise VerificationTimeout(
                        f"no verifier has asked for work for {PRESENT_S:.0f} s; the re-score of "
                        f"v{version} ({len(completions)} samples) waits for one"
                    )
        finally:
            self._forget(job)

    def _present(self, now: float) -> set[str]:
        """Verifiers that asked for work within ``PRESENT_S`` or are working on a job now (the
        coordinator's own counts while its worker runs)."""
        here = {n for n, t in self._seen.items() if now - t <= PRESENT_S}
        here |= {j.taker for j in self._taken.values() if j.taker is not None}
        if self._worker is not None and not self._worker.done():
            here.add(LOCAL)
        return here

    def _could_take(self, job: _Job, now: float) -> bool:
        """Whether a present verifier may still take ``job`` (not one that refused it)."""
        return any(n not in job.refused_by for n in self._present(now))

    def _forget(self, job: _Job) -> None:
        with contextlib.suppress(ValueError):
            self._queue.remove(job)
        if self._taken.get(job.job_id) is job:
            del self._taken[job.job_id]
        self._jobs.pop(job.job_id, None)
        if not job.future.done():
            job.future.cancel()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- giving jobs out -------------------------------------------------------------------------
    def _sweep(self, now: float) -> None:
        """Jobs whose taker missed its deadline: given again, or failed after the last try."""
        for job_id, job in list(self._taken.items()):
            if now <= job.deadline:
                continue
            del self._taken[job_id]
            log.warning(
                "verifier %s did not answer re-score job %s within %.0f s",
                _short(job.taker), job_id, self.job_timeout_s,
            )  # fmt: skip
            job.taker = None
            if job.given >= self.attempts:
                self.timed_out += 1
                self._fail(job, VerificationTimeout(
                    f"re-score job of v{job.args.version} given {job.given} times, never answered"
                ))  # fmt: skip
                continue
            self.redelivered += 1
            self._queue.appendleft(job)
            self._notify()

    def _pop_for(self, name: str, now: float) -> _Job | None:
        self._sweep(now)
        present = self._present(now)
        for job in self._queue:
            if name in job.refused_by or job.future.done():
                continue
            # a job that missed its deadline with ``name`` goes to another verifier if one is here
            if name in job.takers and any(
                n not in job.takers and n not in job.refused_by for n in present
            ):
                continue
            self._queue.remove(job)
            job.given += 1
            job.taker = name
            job.takers.add(name)
            job.deadline = now + self.job_timeout_s
            self._taken[job.job_id] = job
            return job
        return None

    async def take(self, name: str, wait_s: float) -> _Job | None:
        """The next job for verifier ``name``, waiting up to ``wait_s`` for one (None: none)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + min(max(0.0, wait_s), MAX_TAKE_WAIT_S)
        while True:
            now = self.clock()
            self._seen[name] = now
            job = self._pop_for(name, now)
            if job is not None:
                return job
            left = end - loop.time()
            if left <= 0:
                return None
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, self.job_timeout_s))

    def finish(
        self, name: str, job_id: str, verdict: LogprobVerdict | None, *, refused: str = "",
        compute_s: float = 0.0, tokens: int = 0, error: bool = False,
    ) -> None:  # fmt: skip
        """Record the answer of ``name`` to ``job_id``: a verdict, or (``verdict`` None) that it
        cannot score the job (``refused`` says why; ``error``: its re-score failed, else it
        cannot hold the version). Raises :class:`Rejection` when the job was never given to
        ``name`` or is answered already."""
        job = self._jobs.get(job_id)
        if job is None or name not in job.takers or job.future.done():
            raise Rejection(
                ReasonCode.UNKNOWN_LEASE,
                f"re-score job {job_id} is not open for you (answered already, or never given "
                "to you)",
            )
        if name != LOCAL:
            self.remote_compute_s += compute_s
            self.remote_tokens += tokens
            if verdict is not None:
                self.remote_checks += 1
                if self._meter is not None:  # a refusal re-scored nothing: it says nothing of V
                    self._meter.record(name, float(tokens), compute_s, len(job.args.completions),
                                       self._meter_clock())  # fmt: skip
        held_by_another = self._taken.get(job_id) is job and job.taker != name
        if verdict is not None or not held_by_another:
            if self._taken.get(job_id) is job:
                del self._taken[job_id]
            with contextlib.suppress(ValueError):
                self._queue.remove(job)  # back in the queue after a missed deadline
            job.taker = None
        if verdict is not None:
            self._jobs.pop(job_id, None)
            job.future.set_result(verdict)
            return
        job.refused_by[name] = ("error: " if error else "") + refused
        if error:
            job.failed_by.add(name)
        if held_by_another:
            return  # given to another verifier after this one's deadline: its answer decides
        if self._someone_else_could(job):
            self._queue.appendleft(job)
            self._notify()
            return
        said = "; ".join(f"{_short(n)}: {why}" for n, why in job.refused_by.items())
        if LOCAL in job.refused_by and LOCAL not in job.failed_by:
            # the coordinator itself does not hold the version: skipped, as it always was
            self._fail(job, VerifierUnavailable(said))
        else:
            self.timed_out += 1
            self._fail(job, VerificationTimeout(f"no verifier could re-score it ({said})"))

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._jobs.pop(job.job_id, None)
        if not job.future.done():
            job.future.set_exception(exc)

    def _someone_else_could(self, job: _Job) -> bool:
        if self.local is not None and LOCAL not in job.refused_by:
            return True  # the coordinator's own verifier has not tried: it always may
        if job.given >= self.attempts:
            return False
        return self._could_take(job, self.clock())

    # --- the coordinator's own verifier ----------------------------------------------------------
    async def _work_locally(self) -> None:
        while True:
            job = await self.take(LOCAL, MAX_TAKE_WAIT_S)
            if job is None:
                continue
            try:
                verdict = await job.args.run(self._metered_local)
            except VerifierUnavailable as exc:
                with contextlib.suppress(Rejection):  # answered meanwhile, or the caller left
                    self.finish(LOCAL, job.job_id, None, refused=str(exc))
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the re-score failed: the caller's retries decide
                log.warning("re-score job %s failed in process: %s: %s", job.job_id,
                            type(exc).__name__, exc)  # fmt: skip
                with contextlib.suppress(Rejection):
                    self.finish(LOCAL, job.job_id, None, refused=str(exc), error=True)
                continue
            with contextlib.suppress(Rejection):  # answered by another meanwhile
                self.finish(LOCAL, job.job_id, verdict)


def _short(name: str | None) -> str:
    if name is None or name == LOCAL:
        return str(name)
    return short_fingerprint(name)


_FAIL_CODES = frozenset({ReasonCode.LOGPROB_MISMATCH, ReasonCode.SAMPLING_MISMATCH})


class VerifierHandlers:
    """``rswarm/vtake`` and ``rswarm/vdone``: verifier processes signing with one of ``keys``
    (fingerprints) take and answer the pool's jobs."""

    def __init__(
        self, pool: VerifierPool, keys: Collection[str], *, replay: Any, clock: Callable[[], float]
    ) -> None:
        self._pool = pool
        self._keys = frozenset(parse_fingerprint(k) for k in keys)
        self._replay = replay
        self._clock = clock

    def _open(self, request: bytes, type_: type[Any]) -> tuple[str, Any]:
        env = decode(request, SignedEnvelope)
        who = fingerprint_of(env.signer)
        if who not in self._keys:
            raise Rejection(
                ReasonCode.UNKNOWN_NODE,
                f"{short_fingerprint(who)} is not a verifier of this coordinator "
                "(verification.verifier_keys)",
            )
        return who, open_envelope(env, type_, now=self._clock(), replay=self._replay)

    async def on_take(self, caller: str, request: bytes) -> bytes:
        who, msg = self._open(request, VerifyTake)
        job = await self._pool.take(who, msg.wait_s)
        if job is None:
            return encode(Standby(retry_after_s=0.0, reason="no re-score job now"))
        return encode(job_message(job.job_id, job.args, job.deadline))

    async def on_done(self, caller: str, request: bytes) -> bytes:
        who, msg = self._open(request, VerifyVerdict)
        if msg.outcome in ("unavailable", "error"):
            self._pool.finish(who, msg.job_id, None, refused=msg.detail[:200],
                              compute_s=msg.compute_s, tokens=msg.tokens,
                              error=msg.outcome == "error")  # fmt: skip
        else:
            if msg.outcome == "fail" and msg.code not in _FAIL_CODES:
                raise Rejection(
                    ReasonCode.OUT_OF_RANGE,
                    f"a failed re-score's code is logprob_mismatch or sampling_mismatch, not "
                    f"{msg.code.value}",
                )
            verdict = LogprobVerdict(
                ok=msg.outcome == "pass", metric=msg.metric, value=msg.value,
                threshold=msg.threshold, detail=msg.detail, code=msg.code,
                figures=dict(msg.figures),
            )  # fmt: skip
            self._pool.finish(who, msg.job_id, verdict, compute_s=msg.compute_s,
                              tokens=msg.tokens)  # fmt: skip
        return encode(Ack(ref=msg.job_id))
