"""The verification budget: verification as a resource of the capacity plan (issue 35).

docs/capacity.md, "Verification as a resource of the plan", is the user-facing description.

* **V**, the verifiers' throughput in re-scored tokens per second (prompt and completion tokens
  of every re-scored sample): each re-score's tokens over the seconds it took, a running mean per
  verifier (:class:`VerifierMeter`), summed over the verifiers that answered within
  ``verification.window_s``. :class:`MeteredVerifier` is the intake's view of a verifier that
  meters it: from the verifier's own ``tokens`` / ``compute_s`` counters when it keeps them (the
  re-scoring time, not the wait for its scoring lock), else from the call's tokens and wall time.
  Before any measurement V is ``verification.assumed_tokens_per_s`` (unset: unknown).
* **D**, the demand: Σ_i rate_i · ρ_i · τ over the live nodes not on standby, rate_i the node's
  check rate (:meth:`coordinator.trust.Trust.rate_of`), ρ_i its measured rollouts per second
  (``NodeRecord.rollouts_per_s``: samples over the time from a lease's issue to its
  submission's arrival, the verifier queue left out; a node not measured yet: the median of
  the measured ones; before any, a lease's samples over ``leases.target_lease_s``) and τ the
  re-scored tokens per rollout (measured; before any re-score, ``sampling.max_new_tokens``).
  Computed at every re-plan (:meth:`VerificationBudget.observe`), plus the newcomers admitted
  since.
* the rule D ≤ (1 − h)·V sits in the plan beside the learner's
  (:func:`coordinator.capacity.with_verification`);
* **admission**: a new identity starts at the check rate ``intake.new_node_check_rate``, so it
  adds ``rate_0 · ρ · τ`` to D. It is admitted only while that fits in the spare budget
  (1 − h)·V − D, at the pace of a :class:`~coordinator.admission.ProbationBucket` that refills at
  the spare budget over the re-score of a newcomer's first lease; otherwise the registration is
  refused ``swarm_full`` with ``retry_after_s``, oldest first. Nodes already admitted are never
  refused for it (re-registrations do not pass here). While D is 0 one newcomer is admitted
  whatever its estimated cost (else a budget smaller than one node would admit nobody, ever).

With no verifier, no check rate or no V known, nothing is limited. Soft state: a restarted
coordinator measures V again (its admitted nodes stay admitted: they are in the store).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.admission import ProbationBucket
from coordinator.config import CoordinatorConfig
from coordinator.errors import Rejection
from coordinator.logprobs import LogprobVerdict, LogprobVerifier
from coordinator.trust import Trust
from coordinator.verifying import VerifyingLeases
from protocol.errors import ReasonCode

#: What a re-plan reads of each live node (:meth:`coordinator.store.Store.planner_rows`):
#: ``(node_key, price_per_hour, tokens_per_s, rollouts_per_s, leases_completed, leases_expired)``.
PlannerRow = tuple[bytes, float | None, float | None, float | None, int, int]


@dataclass
class _Verifier:
    tokens_per_s: float
    answered_at: float


class VerifierMeter:
    """Running mean of re-scored tokens per second per verifier; V is their sum."""

    def __init__(self, *, window_s: float, ewma: float) -> None:
        self.window_s = window_s
        self.ewma = ewma
        self._verifiers: dict[str, _Verifier] = {}
        #: re-scored tokens and samples, all verifiers together (τ = tokens / samples)
        self.tokens = 0.0
        self.samples = 0

    def record(
        self, verifier: str, tokens: float, seconds: float, samples: int, now: float
    ) -> None:
        """One re-score: ``tokens`` of ``samples`` samples in ``seconds`` by ``verifier``.

        Read off counters, a call's tokens may hold an overlapping call's too, and that call then
        reads none (:class:`MeteredVerifier`): its samples still count, or τ (tokens over samples)
        would grow with the overlap (twice the truth in the simulation at 1,000 nodes, where two
        intake workers' re-scores overlap as a rule, and D with it)."""
        if samples > 0:
            self.samples += samples
        if tokens > 0:
            self.tokens += tokens
        if not (tokens > 0 and seconds > 0 and math.isfinite(tokens / seconds)):
            return  # nothing re-scored, or no time measured: says nothing of its speed
        rate = tokens / seconds
        v = self._verifiers.get(verifier)
        if v is None:
            self._verifiers[verifier] = _Verifier(rate, now)
        else:
            v.tokens_per_s = (1 - self.ewma) * v.tokens_per_s + self.ewma * rate
            v.answered_at = max(v.answered_at, now)

    def tokens_per_s(self, now: float) -> float | None:
        """V: the running means of the verifiers that answered within ``window_s``; when none
        did, the one that answered last (an idle verifier is still there); None: never
        measured."""
        if not self._verifiers:
            return None
        recent = [v.tokens_per_s for v in self._verifiers.values()
                  if now - v.answered_at <= self.window_s]  # fmt: skip
        if recent:
            return sum(recent)
        return max(self._verifiers.values(), key=lambda v: v.answered_at).tokens_per_s

    @property
    def verifiers(self) -> int:
        return len(self._verifiers)

    @property
    def tokens_per_rollout(self) -> float | None:
        """τ: re-scored tokens per re-scored sample (None: nothing re-scored yet)."""
        return self.tokens / self.samples if self.samples else None


class MeteredVerifier:
    """``inner`` as the intake calls it, each re-score recorded in ``meter`` under ``name``.

    When ``inner`` keeps ``tokens`` and ``compute_s`` counters (the in-process verifier; the
    simulation's, which advances them by its simulated time), a check records what they grew by
    since the last one: concurrent checks waiting for the scoring lock add no time. Otherwise the
    call's own tokens (prompt + completion) over its wall time (``timer``)."""

    def __init__(
        self,
        inner: LogprobVerifier,
        meter: VerifierMeter,
        clock: Callable[[], float],
        *,
        name: str = "local",
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.inner = inner
        self.meter = meter
        self.clock = clock
        self.name = name
        self.timer = timer
        self._seen = self._counters()

    def _counters(self) -> tuple[float, float] | None:
        tokens = getattr(self.inner, "tokens", None)
        seconds = getattr(self.inner, "compute_s", None)
        if isinstance(tokens, int | float) and isinstance(seconds, int | float):
            return float(tokens), float(seconds)
        return None

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
        t0 = self.timer()
        verdict = await self.inner.check(
            version, prompt_ids, completions, claimed_logprobs,
            backend=backend, dtype=dtype, seeds=seeds, steps=steps,
        )  # fmt: skip
        now = self.counters_or_wall(prompt_ids, completions, self.timer() - t0)
        self.meter.record(self.name, now[0], now[1], len(completions), self.clock())
        return verdict

    def counters_or_wall(
        self, prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        wall_s: float,
    ) -> tuple[float, float]:  # fmt: skip
        """(tokens, seconds) of the check just made."""
        seen, now = self._seen, self._counters()
        if seen is not None and now is not None:
            self._seen = now
            return now[0] - seen[0], now[1] - seen[1]
        tokens = sum(len(p) + len(c) for p, c in zip(prompt_ids, completions, strict=True))
        return float(tokens), wall_s


class VerificationBudget:
    """V, D, the admission of new identities and the leases held for verification (module
    docstring). ``lease_size(tokens_per_s)`` is the lease manager's sizing (prompts of a node's
    lease); ``checks_on``: the intake has a verifier and some check rate is above 0;
    ``verifying``: the leases held for verification, shared with the lease manager (None: its
    own)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        trust: Trust,
        clock: Callable[[], float],
        lease_size: Callable[[float | None], int],
        checks_on: bool,
        verifying: VerifyingLeases | None = None,
    ) -> None:
        cfg = self.config = config.verification
        self.trust = trust
        self.clock = clock
        self.lease_size = lease_size
        self.checks_on = checks_on and trust.rate_after(0) > 0
        self.group_size = config.group_size
        self.max_new_tokens = config.sampling.max_new_tokens
        self.target_lease_s = config.leases.target_lease_s
        self.meter = VerifierMeter(window_s=cfg.window_s, ewma=cfg.throughput_ewma)
        self.bucket = ProbationBucket(
            burst=cfg.admission_burst, retry_s=cfg.admission_retry_s, max_waiting=config.max_nodes
        )
        self.verifying = (  # not `or`: an empty VerifyingLeases is falsy (it has __len__)
            verifying
            if verifying is not None
            else VerifyingLeases(enabled=cfg.hold_verifying_leases)
        )
        #: D at the last re-plan, and the demand of the newcomers admitted since (tokens/s)
        self.planned_demand = 0.0
        self.pending_demand = 0.0
        #: median measured ρ at the last re-plan (rollouts/s); None: nobody measured yet
        self.rho_measured: float | None = None
        self.admitted = 0
        self.refused = 0
        #: the verifier pool's own figures (jobs queued, taken, ...), when it has one
        self.pool_status: Callable[[], dict[str, Any]] | None = None

    def metered(self, verifier: LogprobVerifier | None) -> LogprobVerifier | None:
        """``verifier`` as the intake should call it: metered into V (None stays None). A
        verifier of several verifiers (:class:`coordinator.verifier_pool.VerifierPool`) meters
        each under its own name (``attach_meter``): V is their sum."""
        if verifier is None:
            return None
        attach = getattr(verifier, "attach_meter", None)
        if callable(attach):
            attach(self.meter, self.clock)
            self.pool_status = getattr(verifier, "status", None)
            return verifier
        return MeteredVerifier(verifier, self.meter, self.clock)

    # --- V and D ---------------------------------------------------------------------------------
    def capacity(self, now: float | None = None) -> float | None:
        """V (re-scored tokens/s): measured, else assumed; None: unknown."""
        measured = self.meter.tokens_per_s(self.clock() if now is None else now)
        return measured if measured is not None else self.config.assumed_tokens_per_s

    @property
    def demand(self) -> float:
        """D now (re-scored tokens/s): the last re-plan's plus the newcomers admitted since."""
        return self.planned_demand + self.pending_demand

    def tokens_per_rollout(self) -> float:
        """τ: measured, else ``sampling.max_new_tokens`` (the prompt's are not known yet)."""
        return self.meter.tokens_per_rollout or float(self.max_new_tokens)

    def _rho_guess(self, tokens_per_s: float | None) -> float:
        """ρ of a node not measured yet: the median measured one, else its first lease's
        samples over ``target_lease_s`` (the lease is sized for that much generation)."""
        if self.rho_measured is not None:
            return self.rho_measured
        return self.lease_size(tokens_per_s) * self.group_size / self.target_lease_s

    def observe(self, rows: Sequence[PlannerRow], standby: Collection[str]) -> float:
        """Recompute D over the live nodes ``rows`` not in ``standby`` (hex keys); returns it."""
        if not self.checks_on:
            self.planned_demand = self.pending_demand = 0.0
            return 0.0
        states = self.trust.all_states()
        measured = [r[3] for r in rows if r[3] is not None and r[3] > 0 and math.isfinite(r[3])]
        self.rho_measured = statistics.median(measured) if measured else None
        tau = self.tokens_per_rollout()
        rate_new = self.trust.rate_after(0)
        off = frozenset(standby)
        total = 0.0
        for key, _price, tps, rps, _done, _expired in rows:
            if off and key.hex() in off:
                continue
            state = states.get(key)
            rate = rate_new if state is None else self.trust.rate_of(state)
            if rate <= 0:
                continue
            rho = rps if rps is not None and rps > 0 and math.isfinite(rps) else None
            total += rate * (rho if rho is not None else self._rho_guess(tps)) * tau
        self.planned_demand, self.pending_demand = total, 0.0
        return total

    # --- admission -------------------------------------------------------------------------------
    def admit_new(
        self, node_key: bytes, tokens_per_s: float | None, now: float, *, registered: int
    ) -> None:
        """Admit a new identity, or raise ``Rejection(SWARM_FULL, retry_after_s=...)``.

        ``registered`` is how many nodes the coordinator holds now: below
        ``verification.admission_min_nodes`` every newcomer is admitted (its probation still
        counts in D), so a small swarm, whose verifier is usually the coordinator itself, never
        turns a volunteer away."""
        if not (self.config.admission and self.checks_on):
            return
        rate0, tau = self.trust.rate_after(0), self.tokens_per_rollout()
        each = rate0 * self._rho_guess(tokens_per_s) * tau  # its demand on probation (tokens/s)
        if registered < self.config.admission_min_nodes:
            self.admitted += 1
            self.pending_demand += each
            return
        v = self.capacity(now)
        if v is None:
            return
        samples = self.lease_size(tokens_per_s) * self.group_size
        first = rate0 * samples * tau  # expected re-scored tokens of its first lease
        spare = (1.0 - self.config.headroom) * v - self.demand
        room = spare / each if each > 0 else math.inf
        if self.demand <= 0:  # nothing to verify yet: one newcomer at least, whatever it costs
            room = max(room, 1.0)
        per_s = max(0.0, spare) / first if first > 0 else math.inf
        wait = self.bucket.take(node_key, now, per_s=per_s, room=room)
        if wait is None:
            self.admitted += 1
            self.pending_demand += each
            return
        self.refused += 1
        ahead = self.bucket.position(node_key)
        where = f"place {ahead + 1} in the queue" if ahead is not None else "the queue is full"
        raise Rejection(
            ReasonCode.SWARM_FULL,
            f"the verifiers' budget admits no new node now ({where}); register again in "
            f"{wait:.0f}s",
            retry_after_s=wait,
        )

    # --- /status ---------------------------------------------------------------------------------
    def status(self, now: float | None = None) -> dict[str, Any]:
        """The budget's figures for the operator's ``/status`` (aggregates only)."""
        t = self.clock() if now is None else now
        v = self.capacity(t)
        limit = None if v is None else (1.0 - self.config.headroom) * v
        pool = self.pool_status() if self.pool_status is not None else {}
        return pool | {
            "verify_tokens_per_s": round(v, 3) if v is not None else None,
            "verify_tokens_per_s_measured": self.meter.tokens_per_s(t) is not None,
            "verify_verifiers": self.meter.verifiers,
            "verify_demand_tokens_per_s": round(self.demand, 3),
            "verify_budget_tokens_per_s": round(limit, 3) if limit is not None else None,
            "verify_budget_meets": None if limit is None else self.demand <= limit,
            "verify_tokens_per_rollout": self.meter.tokens_per_rollout,
            "admission_admitted": self.admitted,
            "admission_refused": self.refused,
            "admission_waiting": self.bucket.waiting,
            "leases_in_verification": len(self.verifying),
            "leases_held_for_verification": self.verifying.held,
        }
