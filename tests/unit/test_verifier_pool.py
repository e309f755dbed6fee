"""Verification scaled out (issue 35): re-scores as jobs that the coordinator's own verifier and
verifier processes take from one queue (:mod:`coordinator.verifier_pool`).

A "verifier process" here is the test itself, going through the coordinator's two RPC handlers
with signed requests and re-scoring with the same :class:`InProcessLogprobVerifier` and the same
wire helpers the real process uses (:mod:`coordinator.verifier_process`); the real process over
libp2p is in tests/integration/test_remote_verifier.py. A real tiny model samples with the ``hf``
backend, as in tests/unit/test_deferred_check.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from coord_harness import Harness, sampled
from test_deferred_check import tampered

from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.logprobs import InProcessLogprobVerifier, LogprobVerdict, VerifierUnavailable
from coordinator.verifier_pool import (
    PRESENT_S,
    CheckArgs,
    VerificationTimeout,
    VerifierHandlers,
    VerifierPool,
    job_args,
    job_message,
    verdict_message,
)
from policy.model import ModelSpec, build_model
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.limits import MAX_FLOAT
from protocol.messages import Ack, Reject, Standby, VerifyJob, VerifyTake, VerifyVerdict


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


class Setup:
    """A coordinator core whose verifier is a pool (no local verifier unless ``local``), its
    handlers, and one listed verifier key with its own in-process verifier."""

    def __init__(self, tmp_path: Path, model: Any, *, local: bool = False,
                 job_timeout_s: float = 30.0, attempts: int = 2) -> None:  # fmt: skip
        self.key = Identity.generate()
        self.h = Harness(
            tmp_path,
            intake={"spot_check_fraction": 1.0, "new_node_check_rate": 1.0},
            sampling={"max_new_tokens": 8},
            leases={"max_prompts_per_lease": 2, "max_active_per_node": 64},
        )
        tol = self.h.cfg.intake.tolerances
        self.rescorer = InProcessLogprobVerifier(lambda v: model, tol, cache_size=2)
        self.pool = VerifierPool(
            InProcessLogprobVerifier(lambda v: model, tol, cache_size=2) if local else None,
            job_timeout_s=job_timeout_s, attempts=attempts, clock=self.h.clock,
        )  # fmt: skip
        self.h.verifier = self.pool
        self.h.reopen()
        self.h.publish(1)
        self.handlers = VerifierHandlers(
            self.pool, [self.key.fingerprint], replay=None, clock=self.h.clock
        )

    async def take(self, who: Identity | None = None, wait_s: float = 5.0) -> VerifyJob | None:
        env = seal(who or self.key, VerifyTake(wait_s=wait_s), now=self.h.clock())
        out = decode(await self.handlers.on_take("peer", encode(env)))
        assert isinstance(out, VerifyJob | Standby), out
        return out if isinstance(out, VerifyJob) else None

    async def answer(self, verdict: VerifyVerdict, who: Identity | None = None) -> None:
        env = seal(who or self.key, verdict, now=self.h.clock())
        out = decode(await self.handlers.on_done("peer", encode(env)))
        assert isinstance(out, Ack), out

    async def serve_one(self, who: Identity | None = None) -> VerifyVerdict:
        """Take one job, re-score it as the verifier process does, answer it."""
        job = await self.take(who)
        assert job is not None
        seconds, tokens = self.rescorer.compute_s, self.rescorer.tokens
        verdict = await job_args(job).run(self.rescorer)
        msg = verdict_message(job.job_id, verdict, compute_s=self.rescorer.compute_s - seconds,
                              tokens=self.rescorer.tokens - tokens)  # fmt: skip
        await self.answer(msg, who)
        return msg


async def test_a_verifier_process_passes_an_honest_lease_into_the_feed(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model)
    node = s.h.node()
    lease = s.h.lease(node, 2)
    answer, held = await s.h.core.desk.receive(node.public_key, sampled(lease, model))
    assert isinstance(answer, Ack) and held is not None
    final, msg = await asyncio.gather(s.h.core.desk.settle(held), s.serve_one())
    assert isinstance(final, Ack), final
    assert msg.outcome == "pass" and msg.tokens > 0 and msg.compute_s > 0
    rows = s.h.core.fetch_rollouts(0, 100).rollouts
    assert {r.lease_id for r in rows} == {lease.lease_id}
    assert len(rows) == 2 * s.h.cfg.group_size
    # metered under the verifier's own name, counted in the ledger's totals
    meter = s.h.core.budget.meter
    assert meter.verifiers == 1 and meter.tokens_per_s(s.h.clock()) is not None
    assert s.pool.checks == 1 and s.pool.tokens == msg.tokens
    status = s.h.core.budget.status()
    assert status["verifier_processes"] == 1 and status["verify_jobs_queued"] == 0


async def test_a_verifier_process_refuses_a_forged_lease(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model)
    node = s.h.node()
    lease = s.h.lease(node, 2)
    sub = tampered(sampled(lease, model))
    answer, held = await s.h.core.desk.receive(node.public_key, sub)
    assert isinstance(answer, Ack) and held is not None
    final, msg = await asyncio.gather(s.h.core.desk.settle(held), s.serve_one())
    assert msg.outcome == "fail" and msg.code is ReasonCode.LOGPROB_MISMATCH
    assert isinstance(final, Reject) and final.code is ReasonCode.LOGPROB_MISMATCH, final
    assert len(s.h.store.live_strikes(node.public_key, 0.0)) == 1
    assert s.h.core.fetch_rollouts(0, 100).rollouts == []


async def test_a_key_not_listed_takes_nothing(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model)
    with pytest.raises(Rejection) as info:
        await s.take(Identity.generate())
    assert info.value.code is ReasonCode.UNKNOWN_NODE
    assert "verification.verifier_keys" in info.value.detail


async def test_an_unanswered_job_goes_to_the_next_verifier_and_the_first_verdict_wins(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, job_timeout_s=30.0)
    other = Identity.generate()
    s.handlers = VerifierHandlers(
        s.pool, [s.key.fingerprint, other.fingerprint], replay=None, clock=s.h.clock
    )
    node = s.h.node()
    lease = s.h.lease(node, 2)
    _, held = await s.h.core.desk.receive(node.public_key, sampled(lease, model))
    assert held is not None
    settling = asyncio.ensure_future(s.h.core.desk.settle(held))
    first = await s.take()  # the first verifier takes it and goes silent
    assert first is not None
    assert await s.take(other, wait_s=0.0) is None  # not given twice within its deadline
    s.h.clock.advance(31.0)
    assert await s.take(wait_s=0.0) is None  # not back to the silent one while another is here
    second = await s.take(other, wait_s=0.0)
    assert second is not None and second.job_id == first.job_id
    assert s.pool.redelivered == 1
    verdict = await job_args(second).run(s.rescorer)
    # the first verifier's answer comes late, but first: it counts (the same re-score)
    await s.answer(verdict_message(first.job_id, verdict, compute_s=0.1, tokens=10))
    assert isinstance(await settling, Ack)
    with pytest.raises(Rejection) as info:  # the second answer finds the job answered
        await s.answer(verdict_message(second.job_id, verdict, compute_s=0.1, tokens=10), other)
    assert info.value.code is ReasonCode.UNKNOWN_LEASE


def _unavailable(job: VerifyJob, why: str, outcome: str = "unavailable") -> VerifyVerdict:
    return VerifyVerdict(
        job_id=job.job_id, outcome=outcome, metric="", value=0.0, threshold=0.0,  # type: ignore[arg-type]
        detail=why, code=ReasonCode.INTERNAL, figures={}, compute_s=0.0, tokens=0,
    )  # fmt: skip


ARGS = CheckArgs(1, [[1, 2]], [[3]], [[-0.5]], "hf", "float32", None, None)


async def test_a_job_no_process_could_score_keeps_its_lease_held(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, attempts=5)
    other = Identity.generate()
    s.handlers = VerifierHandlers(
        s.pool, [s.key.fingerprint, other.fingerprint], replay=None, clock=s.h.clock
    )
    assert await s.take(other, wait_s=0.0) is None  # the second verifier is present
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    job = await s.take()
    assert job is not None
    await s.answer(_unavailable(job, "cannot fetch v1: no seed answered"))
    assert not checking.done()
    assert await s.take(wait_s=0.0) is None  # never back to the one that could not
    again = await s.take(other)  # given to the other verifier
    assert again is not None and again.job_id == job.job_id
    await s.answer(_unavailable(again, "CUDA out of memory", "error"), other)
    # nobody left; the coordinator holds the version, so this is no skip: the check fails
    # without a verdict and the lease is re-scored later (its rows held)
    with pytest.raises(VerificationTimeout, match=r"no seed answered.*error: CUDA out of memory"):
        await checking
    assert s.h.core.budget.meter.samples == 0  # refusals re-scored nothing: no τ, no V


def _refusing(exc: Exception) -> InProcessLogprobVerifier:
    """The coordinator's own verifier whose model loader raises ``exc`` (VerifierUnavailable:
    the weights are not held, as :class:`coordinator.holding.SpotCheckModels` says)."""

    def load(version: int) -> Any:
        raise exc

    return InProcessLogprobVerifier(load, {}, cache_size=1)


async def test_only_the_coordinator_lacking_the_version_skips_the_check(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model)
    pool = VerifierPool(
        _refusing(VerifierUnavailable("policy v1 is not held by the coordinator")),
        job_timeout_s=30.0, attempts=3, clock=s.h.clock,
    )  # fmt: skip
    pool.start()
    try:
        with pytest.raises(VerifierUnavailable, match="not held by the coordinator"):
            await asyncio.wait_for(pool.check(*_positional(ARGS), **_keywords(ARGS)), 10)
        assert pool.status()["verifier_processes"] == 0  # its own verifier is no process
    finally:
        await pool.stop()
    failing = VerifierPool(_refusing(RuntimeError("boom")), job_timeout_s=30.0, attempts=3,
                           clock=s.h.clock)  # fmt: skip
    failing.start()
    try:  # a failure is not "unavailable": no skip, the caller retries later
        with pytest.raises(VerificationTimeout, match="error: boom"):
            await asyncio.wait_for(failing.check(*_positional(ARGS), **_keywords(ARGS)), 10)
    finally:
        await failing.stop()


async def test_what_a_process_cannot_score_goes_to_the_coordinators_own_verifier(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, local=True)
    node = s.h.node()
    lease = s.h.lease(node, 2)
    _, held = await s.h.core.desk.receive(node.public_key, sampled(lease, model))
    assert held is not None
    settling = asyncio.ensure_future(s.h.core.desk.settle(held))
    job = await s.take()  # the process asks first (the local worker is not started yet)
    assert job is not None
    await s.answer(_unavailable(job, "cannot fetch v1"))
    s.pool.start()
    try:
        assert isinstance(await asyncio.wait_for(settling, 60), Ack)
        assert s.pool.remote_checks == 0 and s.pool.checks == 1
    finally:
        await s.pool.stop()


async def test_the_coordinators_own_verifier_takes_jobs_too(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model, local=True)
    s.pool.start()
    try:
        node = s.h.node()
        lease = s.h.lease(node, 2)
        _, held = await s.h.core.desk.receive(node.public_key, sampled(lease, model))
        assert held is not None
        final = await asyncio.wait_for(s.h.core.desk.settle(held), 60)
        assert isinstance(final, Ack), final  # the local worker took it (no process asked)
        assert s.pool.checks == 1 and s.pool.remote_checks == 0
        assert s.h.core.budget.meter.verifiers == 1
        assert s.h.core.budget.status()["verifier_processes"] == 0
    finally:
        await s.pool.stop()


async def test_a_job_nobody_takes_fails_once_no_verifier_is_present_and_the_lease_stays_held(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, job_timeout_s=0.05, attempts=1)
    node = s.h.node()
    lease = s.h.lease(node, 2)
    _, held = await s.h.core.desk.receive(node.public_key, sampled(lease, model))
    assert held is not None
    settling = asyncio.ensure_future(s.h.core.desk.settle(held))
    await asyncio.sleep(0.2)
    assert not settling.done()  # queued: waits while it may still be taken
    s.h.clock.advance(PRESENT_S + 1)
    with pytest.raises(VerificationTimeout, match="no verifier has asked for work"):
        await asyncio.wait_for(settling, 10)
    # its rows stay held, re-scored later (the node handlers' retry)
    assert [p.lease_id for p in s.h.core.desk.records.held.pending()] == [lease.lease_id]
    assert s.h.core.desk.records.held.count() == 2 * s.h.cfg.group_size
    assert s.pool.timed_out == 1 and s.h.core.fetch_rollouts(0, 100).rollouts == []


async def test_a_taken_job_past_its_deadline_fails_after_its_attempts_without_any_ask(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, job_timeout_s=0.05, attempts=1)
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    assert await s.take() is not None  # taken, never answered; nobody asks again
    s.h.clock.advance(1.0)
    with pytest.raises(VerificationTimeout, match="given 1 times, never answered"):
        await asyncio.wait_for(checking, 10)


async def test_a_job_given_back_to_the_queue_fails_once_its_silent_taker_is_gone(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, job_timeout_s=0.05, attempts=3)
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    assert await s.take() is not None  # taken; its verifier then dies
    s.h.clock.advance(1.0)
    await asyncio.sleep(0.2)  # its deadline passed: back in the queue (1 of 3 attempts used)
    assert s.pool.redelivered == 1 and not checking.done()
    s.h.clock.advance(PRESENT_S + 1)  # the dead verifier is no longer present: nobody is
    await asyncio.sleep(0.2)
    s.h.clock.advance(PRESENT_S + 1)
    with pytest.raises(VerificationTimeout, match="no verifier has asked for work"):
        await asyncio.wait_for(checking, 10)


async def test_a_late_refusal_leaves_the_job_with_its_new_taker(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model, job_timeout_s=30.0)
    other = Identity.generate()
    s.handlers = VerifierHandlers(
        s.pool, [s.key.fingerprint, other.fingerprint], replay=None, clock=s.h.clock
    )
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    first = await s.take()
    assert first is not None
    s.h.clock.advance(31.0)
    second = await s.take(other, wait_s=0.0)  # the first missed its deadline
    assert second is not None
    await s.answer(_unavailable(first, "cannot fetch v1"))  # the first's late refusal
    assert s.pool.status()["verify_jobs_taken"] == 1  # still the other's
    assert await s.take(wait_s=0.0) is None  # and not queued again for anyone
    verdict = await job_args(second).run(s.rescorer)
    await s.answer(verdict_message(second.job_id, verdict, compute_s=0.0, tokens=3), other)
    assert await checking == verdict


async def test_a_job_only_refusers_are_left_for_fails_once_the_others_are_gone(
    tmp_path: Path, model: Any
) -> None:
    s = Setup(tmp_path, model, job_timeout_s=0.05, attempts=3)
    other = Identity.generate()
    s.handlers = VerifierHandlers(
        s.pool, [s.key.fingerprint, other.fingerprint], replay=None, clock=s.h.clock
    )
    assert await s.take(other, wait_s=0.0) is None  # the other verifier asks once, then dies
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    job = await s.take()
    assert job is not None
    await s.answer(_unavailable(job, "cannot fetch v1"))  # queued again: the other is present
    assert s.pool.status()["verify_jobs_queued"] == 1
    for _ in range(2):  # the refuser keeps asking; the other is gone
        s.h.clock.advance(PRESENT_S + 1)
        assert await s.take(wait_s=0.0) is None
        await asyncio.sleep(0.2)
    with pytest.raises(VerificationTimeout, match="no verifier has asked for work"):
        await asyncio.wait_for(checking, 10)


async def test_stop_fails_what_waits(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model)
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    await asyncio.sleep(0)
    await s.pool.stop()
    with pytest.raises(VerificationTimeout, match="stopping"):
        await checking


def test_an_infinite_statistic_still_travels() -> None:
    verdict = LogprobVerdict(
        False, "max_abs", math.inf, 1e-3, "max_abs=inf", ReasonCode.LOGPROB_MISMATCH,
        figures={"max_abs": math.inf, "sampling_z": math.nan, "tokens": 3.0},
    )  # fmt: skip
    msg = decode(encode(verdict_message("j", verdict, compute_s=0.1, tokens=3)), VerifyVerdict)
    assert msg.outcome == "fail" and msg.value == MAX_FLOAT and msg.threshold == 1e-3
    assert msg.figures == {"max_abs": MAX_FLOAT, "sampling_z": MAX_FLOAT, "tokens": 3.0}


async def test_a_failed_verdict_must_carry_a_check_code(tmp_path: Path, model: Any) -> None:
    s = Setup(tmp_path, model)
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    job = await s.take()
    assert job is not None
    bad = verdict_message(
        job.job_id, LogprobVerdict(False, "max_abs", 1.0, 1e-3, "x", ReasonCode.BANNED),
        compute_s=0.0, tokens=3,
    )  # fmt: skip
    with pytest.raises(Rejection) as info:
        await s.answer(bad)
    assert info.value.code is ReasonCode.OUT_OF_RANGE
    checking.cancel()


def test_a_job_travels_intact() -> None:
    args = CheckArgs(
        7, [[1, 2], [1, 2], [5]], [[3, 4], [9], [6, 6, 6]],
        [[-0.5, -1.25], [-2.0], [-0.1, -0.2, -0.3]], "hf", "bfloat16", [11, 12, 13], 8,
    )  # fmt: skip
    job = decode(encode(job_message("j-1", args, 123.0)), VerifyJob)
    assert [len(g.samples) for g in job.groups] == [2, 1]  # equal consecutive prompts share
    back = job_args(job)
    assert back.prompt_ids == args.prompt_ids and back.completions == args.completions
    assert back.seeds == args.seeds and back.steps == 8 and back.dtype == "bfloat16"
    for got, want in zip(back.claimed_logprobs, args.claimed_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-6)  # float32 on the wire; these are exact
    unreplayed = job_args(job_message("j-2", CheckArgs(7, [[1]], [[2]], [[-1.0]], "hf",
                                                       "float32", None, None), 1.0))  # fmt: skip
    assert unreplayed.seeds is None and unreplayed.steps is None


def test_the_config_needs_a_verifier_somewhere() -> None:
    with pytest.raises(ValueError, match="nothing re-scores"):
        CoordinatorConfig.model_validate({"verification": {"local_verifier": False}})
    with pytest.raises(ValueError, match=r"verifier_keys\[0\]"):
        CoordinatorConfig.model_validate({"verification": {"verifier_keys": ["nope"]}})
    fp = Identity.generate().fingerprint
    cfg = CoordinatorConfig.model_validate(
        {"verification": {"verifier_keys": [fp], "local_verifier": False}}
    )
    assert cfg.verification.verifier_keys == [fp]


def _positional(a: CheckArgs) -> tuple[Any, ...]:
    return (a.version, a.prompt_ids, a.completions, a.claimed_logprobs)


def _keywords(a: CheckArgs) -> dict[str, Any]:
    return {"backend": a.backend, "dtype": a.dtype, "seeds": a.seeds, "steps": a.steps}


async def test_a_verifier_process_is_told_plainly_when_it_is_not_wanted(
    tmp_path: Path, model: Any
) -> None:
    """The process's client side over the in-memory transport: a coordinator that takes no
    verifier processes (no ``rswarm/vtake``), then one that does not list its key."""
    from coordinator.service import register_handlers
    from coordinator.verifier_process import VerifierProcess, VerifierRefused
    from protocol import rpc
    from swarm.memtransport import InMemoryNetwork

    s = Setup(tmp_path, model)
    net = InMemoryNetwork()
    coordinator = net.endpoint("coord")
    process = VerifierProcess(
        s.h.cfg, tmp_path / "verifier", coordinator="/ip4/127.0.0.1/tcp/1/p2p/coord",
        coordinator_key=s.h.publisher.fingerprint, pad_id=0,
    )  # fmt: skip
    process.transport = net.endpoint("verifier")
    assert process.coordinator_peer_id == "coord"
    stop = asyncio.Event()
    with pytest.raises(VerifierRefused, match=r"takes no verifier processes.*verifier_keys"):
        await asyncio.wait_for(process.run(stop), 10)
    await register_handlers(
        coordinator, {rpc.VERIFY_TAKE: s.handlers.on_take, rpc.VERIFY_DONE: s.handlers.on_done}
    )
    with pytest.raises(VerifierRefused, match=f"add {process.fingerprint} to its"):
        await asyncio.wait_for(process.run(stop), 10)
    # listed: it takes a job over the transport, and its answer is acknowledged
    # (the process signs with the wall clock; the harness's is a fake one)
    s.handlers = VerifierHandlers(s.pool, [process.fingerprint], replay=None, clock=time.time)
    await coordinator.unregister(rpc.VERIFY_TAKE)
    await coordinator.unregister(rpc.VERIFY_DONE)
    await register_handlers(
        coordinator, {rpc.VERIFY_TAKE: s.handlers.on_take, rpc.VERIFY_DONE: s.handlers.on_done}
    )
    checking = asyncio.ensure_future(s.pool.check(*_positional(ARGS), **_keywords(ARGS)))
    job = await process.take()
    assert job is not None and job_args(job).completions == ARGS.completions
    verdict = await job_args(job).run(s.rescorer)
    assert await process.answer(verdict_message(job.job_id, verdict, compute_s=0.0, tokens=3))
    assert await checking == verdict


async def test_a_verifier_process_goes_on_after_a_failed_re_score(
    tmp_path: Path, model: Any
) -> None:
    """A re-score that raises (not "unavailable") is answered ``error`` and the process keeps
    taking jobs; the check, with nobody else to ask, fails without a skip."""
    from coordinator.service import register_handlers
    from coordinator.verifier_process import VerifierProcess
    from protocol import rpc
    from swarm.memtransport import InMemoryNetwork

    s = Setup(tmp_path, model, attempts=1)
    net = InMemoryNetwork()
    process = VerifierProcess(
        s.h.cfg, tmp_path / "verifier", coordinator="/ip4/127.0.0.1/tcp/1/p2p/coord",
        coordinator_key=s.h.publisher.fingerprint, pad_id=0, take_wait_s=0.2,
    )  # fmt: skip
    process.transport = net.endpoint("verifier")
    process.verifier = s.rescorer

    async def broken(version: int) -> None:
        raise RuntimeError("CUDA out of memory")

    process.hold = broken  # type: ignore[method-assign]
    handlers = VerifierHandlers(s.pool, [process.fingerprint], replay=None, clock=time.time)
    await register_handlers(
        net.endpoint("coord"),
        {rpc.VERIFY_TAKE: handlers.on_take, rpc.VERIFY_DONE: handlers.on_done},
    )
    stop = asyncio.Event()
    running = asyncio.ensure_future(process.run(stop))
    try:
        for _ in range(2):
            checking = s.pool.check(*_positional(ARGS), **_keywords(ARGS))
            with pytest.raises(VerificationTimeout, match="error: RuntimeError: CUDA out of"):
                await asyncio.wait_for(checking, 10)
        assert process.answered["error"] == 2 and not running.done()
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
