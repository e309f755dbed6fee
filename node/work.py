"""The lease loop: ask for work -> load the lease's version -> generate -> sign and submit.

:class:`WorkLoop` owns the lease in hand, what the node is doing (:attr:`WorkLoop.phase`) and
the capacity figures of the next submission; it receives every collaborator it uses. One pass
of :meth:`WorkLoop.run`:

* ask the coordinator for a lease (``client.lease``); ``Standby`` waits ``retry_after_s``;
  coordinator or network errors back off exponentially with jitter, and the loop resumes by
  itself when the coordinator answers again; ``unknown_node`` re-registers (``registrar``);
* a lease over local limits (:func:`~node.rollouts.lease_problem`) is released unrun;
* make ``lease.policy_version`` the loaded weights (``checkpoints.ensure``);
* generate each prompt ``group_size`` times on the generation thread (prompt ``i`` seeded with
  :func:`~policy.sampling.prompt_seed` ``(lease.sampling.seed, i)``; sample ``j`` with
  :func:`~policy.sampling.sample_seed` ``(prompt seed, j)``, recorded in ``Sample.seed``);
  failures count in ``failures`` (its back-off; after identical ones the node stops taking
  leases);
* sign and submit (retried until the lease deadline), count the verdict in ``stats``.

The submission runs in the background while the node asks for, loads and generates its next
lease (at most one in flight: the next one waits for it), so the GPU does not idle through the
upload and the coordinator's checks. A lease within :data:`LATE_MARGIN_S` of its deadline (or
past it) is submitted first: a lease request would otherwise expire it at the coordinator and
hand its prompts back to this node before its late result, which is then refused whole. The
coordinator counts a lease as active until its verdict (``leases.max_active_per_node``, 4 by
default, bounds what a node may hold).

After the ``stopping`` event: no new lease; results in hand are submitted (the submission in
flight included), a lease still loading or generating is released (the coordinator reassigns its
prompts at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from node.checkpoints import CheckpointError
from node.client import CoordinatorError, CoordinatorUnavailable, Rejected
from node.rollouts import build_submission, lease_problem, lease_requests, to_sampling_config
from node.status import Backoff
from protocol.errors import ReasonCode
from protocol.messages import Ack, Lease, LeaseRequest, RolloutSubmission, Standby, Timings

if TYPE_CHECKING:
    from node.backends.base import GenerationRequest, InferenceBackend, SampleOut
    from node.checkpoints import CheckpointManager
    from node.client import CoordinatorClient
    from node.config import NodeConfig
    from node.failures import FailureTracker
    from node.generation import GenerationThread
    from node.presence import Registrar
    from node.status import NodeStats
    from policy.model import Tokenizer

__all__ = ["WorkLoop"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A lease whose deadline is less than this away when its generation ends is submitted before
#: the next lease is asked for, not in the background (see :meth:`WorkLoop._run_lease`): seconds
#: for the upload and clock skew (the deadline is the coordinator's wall clock).
LATE_MARGIN_S = 10.0


class WorkLoop:
    """The contributor's work (see the module docstring)."""

    def __init__(
        self,
        client: CoordinatorClient,
        checkpoints: CheckpointManager,
        generation: GenerationThread,
        registrar: Registrar,
        *,
        config: NodeConfig,
        backend: InferenceBackend,
        stats: NodeStats,
        failures: FailureTracker,
        backoff: Backoff,
        stopping: asyncio.Event,
        peer_id: str,
        on_version_loaded: Callable[[], None],
        tokenizer: Tokenizer | None,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self._client = client
        self._checkpoints = checkpoints
        self._generation = generation
        self._registrar = registrar
        self._config = config
        self._backend = backend
        self._stats = stats
        self._failures = failures
        self._backoff = backoff
        self._stopping = stopping
        self._peer_id = peer_id
        self._on_version_loaded = on_version_loaded
        self._tokenizer = tokenizer
        self._rng = rng
        self._clock = clock
        #: what the node is doing now, in a few words (the status page shows it)
        self.phase = "starting"
        #: the lease being worked on, if any
        self.lease: Lease | None = None
        #: capacity figures (Timings.load_s / overhead_s): when the last generation ended
        #: (monotonic) and the deliberate waits since then
        self._gen_ended: float | None = None
        self._waited_s = 0.0
        #: the previous lease's submission, in flight while the next lease is worked on
        self._submitting: asyncio.Task[None] | None = None

    def request_stop(self) -> None:
        """Take no new lease (the ``stopping`` event is the caller's to set)."""
        self.phase = "stopping"

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._failures.gave_up:  # stays up (heartbeats, adverts, chunks) until stopped
                    await self._settle()
                    self.phase = "stopped taking leases"
                    await self._stopping.wait()
                    break
                got = await self._ask()
                if got is None:
                    continue
                self.lease = got
                try:
                    await self._run_lease(got)
                except Exception as exc:  # a bug or a fatal local problem: give the work back
                    await self._release(got, f"node failure: {type(exc).__name__}")
                    raise
                finally:
                    self.lease = None
            await self._settle()  # results in hand are submitted before the loop ends
        finally:  # cancelled (abandoned after the drain time) or failed: nothing left running
            if self._submitting is not None and not self._submitting.done():
                self._submitting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._submitting

    async def _settle(self) -> None:
        """Wait for the submission in flight, if any (re-raises its failure: a bug)."""
        task, self._submitting = self._submitting, None
        if task is not None:
            if not task.done():
                self.phase = "submitting rollouts"
            await task

    async def _ask(self) -> Lease | None:
        """One lease request; None after a refusal, an error or a standby (already waited)."""
        self.phase = "asking for work"
        req = LeaseRequest(
            peer_id=self._peer_id,
            policy_version=self._backend.loaded_version,
            max_prompts=self._config.max_prompts,
        )
        try:
            got = await self._client.lease(req)
        except Rejected as exc:
            await self._on_rejected(exc)
            return None
        except CoordinatorError as exc:
            self._stats.coordinator_errors += 1
            delay = self._backoff.next_delay()
            self.phase = f"coordinator unreachable, retrying in {delay:.0f} s"
            log.warning("lease request failed (%s); retrying in %.1f s", exc, delay)
            await self._sleep(delay)
            return None
        if self._backoff.failures:
            log.info("coordinator reachable again")
        self._backoff.reset()
        if isinstance(got, Standby):
            self.phase = f"standby: {got.reason}"
            log.info("standby (%s); asking again in %.1f s", got.reason, got.retry_after_s)
            await self._sleep(got.retry_after_s)
            return None
        return got

    async def _on_rejected(self, exc: Rejected) -> None:
        if exc.code is ReasonCode.UNKNOWN_NODE:
            await self._registrar.reregister()
            await self._sleep(self._backoff.next_delay())
            return
        if exc.code is ReasonCode.BANNED:
            delay = exc.retry_after_s or self._config.backoff_max_s
            self.phase = f"banned: {exc.detail}"
            log.error("this node is banned: %s; asking again in %.0f s", exc.detail, delay)
            await self._sleep(delay)
            return
        delay = self._backoff.next_delay()
        self.phase = f"lease refused ({exc.code.value}), retrying in {delay:.0f} s"
        log.error("lease request refused: %s; retrying in %.1f s", exc, delay)
        await self._sleep(delay)

    async def _run_lease(self, lease: Lease) -> None:
        log.debug(
            "lease %s: %d prompts x %d at v%d, deadline in %.0f s",
            lease.lease_id,
            len(lease.prompts),
            lease.group_size,
            lease.policy_version,
            lease.deadline - self._clock(),
        )
        problem = lease_problem(lease, self._config.max_prompts)
        if problem is not None:  # a broken coordinator must not make this node run out of memory
            log.error("lease %s refused: %s; giving it back", lease.lease_id, problem)
            await self._release(lease, f"lease exceeds local limits: {problem}")
            await self._sleep(self._backoff.next_delay())
            return
        try:
            sampling = to_sampling_config(lease)
        except ValueError as exc:
            await self._release(lease, f"unsupported sampling parameters: {exc}")
            return
        self.phase = f"loading policy v{lease.policy_version}"
        load_t0 = time.monotonic()
        try:
            ok, _ = await self._unless_stopped(self._checkpoints.ensure(lease.policy_version))
        except CheckpointError as exc:
            log.error("cannot load policy v%d: %s", lease.policy_version, exc)
            await self._release(lease, f"cannot load v{lease.policy_version}: {exc}")
            await self._sleep(self._backoff.next_delay())
            return
        if not ok:
            await self._release(lease, "node shutting down")
            return
        self._on_version_loaded()
        requests = lease_requests(lease)
        started = self._clock()
        t0 = time.perf_counter()
        load_s, overhead_s = self._lease_plumbing(load_t0)
        log.debug("generating lease %s", lease.lease_id)
        self.phase = f"generating {len(lease.prompts)} prompts × {lease.group_size}"
        future = self._generation.submit(requests, sampling)
        try:
            ok, outs = await self._unless_stopped(asyncio.shield(future))
        except Exception as exc:  # a backend failure must not kill the node: give the work back
            reason = f"generation failed: {type(exc).__name__}: {exc}"
            delay = self._failures.record(reason)
            if self._failures.gave_up:
                log.error("%s; no more leases until this node is restarted", self._failures.problem)
                await self._release(lease, self._failures.problem or reason)
                return
            log.exception("generation failed for lease %s", lease.lease_id)
            await self._release(lease, self._failures.problem or reason)
            await self._sleep(delay)
            return
        if not ok or outs is None:
            await self._release(lease, "node shutting down")
            return
        gen_s = time.perf_counter() - t0
        self._failures.reset()
        self._gen_ended, self._waited_s = time.monotonic(), 0.0
        sub = self._submission(
            lease, requests, outs, started, gen_s, load_s=load_s, overhead_s=overhead_s
        )
        await self._settle()  # one submission in flight at most
        self._submitting = asyncio.create_task(
            self._submit(lease, sub), name=f"submit-{lease.lease_id}"
        )
        if lease.deadline - self._clock() < LATE_MARGIN_S:
            # late (or nearly): the next lease request would expire this lease at the
            # coordinator and re-issue its prompts to this node before the result lands, and
            # the result would then be refused whole (stale_epoch). Let it land first.
            await self._settle()

    # ------------------------------------------------------------------ waits
    async def _sleep(self, seconds: float) -> None:
        """Sleep, but return at once when stopping (a deliberate wait: not plumbing overhead)."""
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), max(0.0, seconds))
        self._waited_s += time.monotonic() - t0

    async def _unless_stopped(self, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Run ``aw`` unless a stop arrives first (then ``aw`` is cancelled: (False, None))."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return True, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False, None

    def _lease_plumbing(self, load_t0: float) -> tuple[float, float]:
        """(load_s, overhead_s) of the lease whose generation starts now (Timings): the wait for
        its version since ``load_t0``, and the rest of the time since the previous generation
        ended, deliberate waits (standby, back-off) excluded."""
        now = time.monotonic()
        load_s = max(0.0, now - load_t0)
        if self._gen_ended is None:
            return load_s, 0.0
        return load_s, max(0.0, now - self._gen_ended - load_s - self._waited_s)

    # ------------------------------------------------------------------ results
    def _submission(
        self,
        lease: Lease,
        requests: list[GenerationRequest],
        outs: list[list[SampleOut]],
        started: float,
        gen_s: float,
        *,
        load_s: float = 0.0,
        overhead_s: float = 0.0,
    ) -> RolloutSubmission:
        for req, samples in zip(requests, outs, strict=True):
            if len(samples) != lease.group_size:
                raise RuntimeError(f"backend returned {len(samples)} samples, asked {req.n}")
        self._stats.record_generation(sum(len(s.token_ids) for group in outs for s in group), gen_s)
        sub = build_submission(
            lease,
            requests,
            outs,
            set(self._backend.eos_token_ids),
            backend=self._backend.name,
            dtype=self._backend.dtype,
            timings=Timings(
                started_at=started,
                finished_at=self._clock(),
                generate_s=gen_s,
                load_s=load_s,
                overhead_s=overhead_s,
            ),
        )
        if self._config.misbehave:
            from node.byzantine import misbehave

            sub = misbehave(
                self._config.misbehave,
                sub,
                lease,
                vocab_size=self._backend.vocab_size,
                tokenizer=self._tokenizer,
                rng=self._rng,
            )
        return sub

    async def _submit(self, lease: Lease, sub: RolloutSubmission) -> None:
        """Submit, retrying network errors until the lease deadline (re-sends are idempotent);
        runs in the background (:meth:`_settle` waits for it)."""
        backoff = Backoff(self._config.backoff_initial_s, self._config.backoff_max_s, self._rng)
        while True:
            try:
                verdict = await self._client.submit(sub)
                break
            except CoordinatorError as exc:
                self._stats.coordinator_errors += 1
                left = lease.deadline - self._clock()
                if left <= 0 or not isinstance(exc, CoordinatorUnavailable):
                    log.error("lease %s: submission lost: %s", lease.lease_id, exc)
                    return
                delay = min(backoff.next_delay(), left)
                if self._stopping.is_set() and backoff.failures > 2:
                    log.error("lease %s: giving up the submission on shutdown", lease.lease_id)
                    return
                log.warning("submit failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
        stats = self._stats
        stats.leases_done += 1
        if isinstance(verdict, Ack):
            stats.leases_accepted += 1
            stats.samples_accepted += sum(len(g.samples) for g in sub.groups)
            log.debug("lease %s accepted: %s", lease.lease_id, verdict.detail)
        else:
            stats.leases_rejected += 1
            stats.last_reject = f"{verdict.code.value}: {verdict.detail}"
            stats.last_reject_at = self._clock()
            log.warning("lease %s rejected: %s", lease.lease_id, stats.last_reject)

    async def _release(self, lease: Lease, reason: str) -> None:
        try:
            await self._client.release(lease.lease_id, lease.epoch, reason)
            self._stats.leases_released += 1
            log.info("released lease %s (%s)", lease.lease_id, reason)
        except CoordinatorError as exc:
            log.warning("could not release lease %s (%s): %s", lease.lease_id, reason, exc)
