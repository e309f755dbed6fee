"""Behaviour log-prob spot check (DESIGN.md §7, check 7): the interface and an in-process verifier.

:class:`LogprobVerifier` is what the intake calls; :class:`InProcessLogprobVerifier` re-scores with
:func:`node.scoring.score_logprobs` on a model held by the coordinator (a cache of the last
``S + 1`` versions) and compares with a tolerance chosen per ``(backend, dtype)``:

* ``max_abs``: largest ``|Δ|`` over all tokens (fp32 on CPU is near exact: 1e-3);
* ``median_rel``: ``median(exp(|Δ|)) − 1`` over all tokens (GRAIL's statistic; bf16 across GPUs:
  honest deviation ≤ 0.066 in 430k trials, rejected above 0.10).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.config import Tolerance

ScoreFn = Callable[..., list[list[float]]]
ModelLoader = Callable[[int], Any]


class VerifierUnavailable(Exception):
    """The verifier cannot re-score this version now (weights not held); not the node's fault."""


@dataclass(frozen=True)
class LogprobVerdict:
    ok: bool
    metric: str
    value: float
    threshold: float
    detail: str


class LogprobVerifier(Protocol):
    """Re-scores completions at ``version`` and says whether the claimed log-probs are honest."""

    async def check(
        self,
        version: int,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        claimed_logprobs: list[list[float]],
        *,
        backend: str = "hf",
        dtype: str = "float32",
    ) -> LogprobVerdict: ...


def tolerance_for(table: Mapping[str, Tolerance], backend: str, dtype: str) -> Tolerance:
    """Most specific entry of ``table`` for ``backend/dtype`` ("*": any); strict default."""
    for key in (f"{backend}/{dtype}", f"*/{dtype}", f"{backend}/*", "*/*"):
        if key in table:
            return table[key]
    return Tolerance(metric="max_abs", threshold=1e-3)


def deviation(metric: str, claimed: list[list[float]], reference: list[list[float]]) -> float:
    """Tolerance statistic between claimed and re-scored log-probs (inf on a length mismatch)."""
    deltas: list[float] = []
    for c, r in zip(claimed, reference, strict=True):
        if len(c) != len(r):
            return math.inf
        deltas += [abs(a - b) if math.isfinite(b) else math.inf for a, b in zip(c, r, strict=True)]
    if not deltas:
        return 0.0
    if metric == "max_abs":
        return max(deltas)
    return statistics.median(math.exp(min(d, 700.0)) for d in deltas) - 1.0


class InProcessLogprobVerifier:
    """Scores on a CPU/GPU model in this process; models are loaded on demand and cached."""

    def __init__(
        self,
        model_loader: ModelLoader,
        tolerances: Mapping[str, Tolerance],
        *,
        cache_size: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        pad_id: int = 0,
        score_fn: ScoreFn | None = None,
    ) -> None:
        self.model_loader = model_loader
        self.tolerances = dict(tolerances)
        self.cache_size = max(1, cache_size)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.pad_id = pad_id
        self._score_fn = score_fn
        self._models: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # one scoring at a time; torch threads are set by the caller

    def _model(self, version: int) -> Any:
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        model = self.model_loader(version)
        self._models[version] = model
        while len(self._models) > self.cache_size:
            self._models.popitem(last=False)
        return model

    def cached_versions(self) -> list[int]:
        return list(self._models)

    def _score(
        self, version: int, prompt_ids: list[list[int]], completions: list[list[int]]
    ) -> list[list[float]]:
        score = self._score_fn
        if score is None:
            from node.scoring import score_logprobs

            score = score_logprobs
        with self._lock:
            model = self._model(version)
            return score(
                model,
                prompt_ids,
                completions,
                self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                pad_id=self.pad_id,
            )

    async def check(
        self,
        version: int,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        claimed_logprobs: list[list[float]],
        *,
        backend: str = "hf",
        dtype: str = "float32",
    ) -> LogprobVerdict:
        reference = await asyncio.to_thread(self._score, version, prompt_ids, completions)
        tol = tolerance_for(self.tolerances, backend, dtype)
        value = deviation(tol.metric, claimed_logprobs, reference)
        ok = value <= tol.threshold
        detail = (
            f"{tol.metric}={value:.3g} over {sum(map(len, completions))} tokens of "
            f"{len(completions)} samples at version {version} ({backend}/{dtype} limit "
            f"{tol.threshold:g})"
        )
        return LogprobVerdict(ok, tol.metric, value, tol.threshold, detail)
