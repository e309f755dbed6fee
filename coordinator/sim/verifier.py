"""The log-prob verifier of the simulation: re-scores against the reference model of the nodes.

It implements :class:`coordinator.logprobs.LogprobVerifier` (what the intake calls for check 7) and
decides with the production functions :func:`~coordinator.logprobs.tolerance_for` and
:func:`~coordinator.logprobs.deviation`; only the re-scoring forward pass is replaced by
:func:`~coordinator.sim.base.reference_logprob`. Its compute time is charged by the intake queue
of the simulation (:mod:`coordinator.sim.world`), not spent here; the world books it in the
``tokens`` / ``compute_s`` counters the in-process verifier keeps, so the coordinator's
verification budget (:class:`coordinator.verify_budget.MeteredVerifier`) measures V from the
same simulated time the queue charges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from coordinator.config import Tolerance
from coordinator.logprobs import LogprobVerdict, deviation, tolerance_for
from coordinator.sim.base import reference_logprob
from protocol.errors import ReasonCode


class ReferenceVerifier:
    """Re-scores completions with the simulation's reference log-probs."""

    def __init__(self, tolerances: Mapping[str, Tolerance], vocab_size: int) -> None:
        self.tolerances = tolerances
        self.vocab_size = vocab_size
        self.checks = 0
        self.samples = 0
        #: re-scored tokens and seconds of re-scoring, as the world charges them (the in-process
        #: verifier's counters: :class:`coordinator.logprobs.InProcessLogprobVerifier`)
        self.tokens = 0.0
        self.compute_s = 0.0

    def charge(self, tokens: float, seconds: float) -> None:
        """A re-score the world charged: ``tokens`` re-scored in ``seconds`` of verifier time."""
        self.tokens += tokens
        self.compute_s += seconds

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
        self.checks += 1
        self.samples += len(completions)
        reference = [
            [
                reference_logprob(version, pos, t) if t < self.vocab_size else -math.inf
                for pos, t in enumerate(tokens)
            ]
            for tokens in completions
        ]
        tol = tolerance_for(self.tolerances, backend, dtype)
        value = deviation(tol.metric, claimed_logprobs, reference)
        ok = value <= tol.threshold
        return LogprobVerdict(
            ok=ok,
            metric=tol.metric,
            value=value,
            threshold=tol.threshold,
            detail=f"{tol.metric} {value:.3g} {'<=' if ok else '>'} {tol.threshold:g}",
            code=ReasonCode.LOGPROB_MISMATCH,
        )
