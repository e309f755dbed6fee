"""Behaviour log-prob spot check (DESIGN.md §7, check 7): the interface and an in-process verifier.

:class:`LogprobVerifier` is what the intake calls; :class:`InProcessLogprobVerifier` re-scores with
:func:`policy.scoring.audit_samples` on a model held by the coordinator (a cache of the last
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.config import Tolerance
from protocol.errors import ReasonCode

if TYPE_CHECKING:
    from policy.scoring import SampleAudit

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
    #: the reason code of a failed check (``logprob_mismatch`` or ``sampling_mismatch``)
    code: ReasonCode = ReasonCode.LOGPROB_MISMATCH


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
        seeds: list[int] | None = None,
        steps: int | None = None,
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


#: Probability mass by which a replayed token's CDF interval is widened (float rounding between
#: the node's forward pass and ours), and the share of replayed tokens allowed to miss, per dtype.
REPLAY_SLACK: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 0.0),
    "bfloat16": (2e-2, 0.02),
    "float16": (1e-2, 0.02),
}


def sampling_z(audits: Sequence[SampleAudit]) -> float:
    """How many standard deviations Σ log p(token) lies from its expectation under honest
    sampling (positive: likelier tokens than sampling gives, as greedy decoding produces)."""
    total = sum(sum(a.logprobs) for a in audits)
    mean = -sum(a.entropy for a in audits)
    var = sum(a.variance for a in audits)
    if var <= 1e-12:
        return 0.0
    return (total - mean) / math.sqrt(var)


class InProcessLogprobVerifier:
    """Scores on a CPU/GPU model in this process; models are loaded on demand and cached.

    One forward pass per check gives three tests, cheapest verdict first:

    1. claimed vs re-scored log-probs within the ``(backend, dtype)`` tolerance
       (``logprob_mismatch``: fabricated log-probs, another model or version);
    2. the sampling statistic :func:`sampling_z` within ``±z_max`` (``sampling_mismatch``: greedy
       or low-temperature decoding, another sampler — the log-probs alone can be honest);
    3. with ``seeds`` (backends with the reference inverse-CDF sampler), every token is the draw
       of its seeded uniform (``sampling_mismatch``: re-drawn or cherry-picked samples).
    """

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
        z_max: float = 6.0,
    ) -> None:
        self.model_loader = model_loader
        self.tolerances = dict(tolerances)
        self.cache_size = max(1, cache_size)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.pad_id = pad_id
        self.z_max = z_max
        self._models: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # one scoring at a time; torch threads are set by the caller

    def _model(self, version: int) -> Any:
        """The model of ``version`` (loaded if not cached); call with ``_lock`` held."""
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        return self._cache(version, self.model_loader(version))

    def _cache(self, version: int, model: Any) -> Any:
        self._models[version] = model
        while len(self._models) > self.cache_size:
            self._models.popitem(last=False)
        return model

    def preload(self, version: int) -> None:
        """Load the model of ``version`` ahead of its first check (blocking: call it from a worker
        thread). The load runs outside the scoring lock, so checks go on meanwhile."""
        if version in self._models:
            return
        model = self.model_loader(version)
        with self._lock:
            if version not in self._models:
                self._cache(version, model)

    def cached_versions(self) -> list[int]:
        return list(self._models)

    def _audit(
        self,
        version: int,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        seeds: list[int] | None,
        steps: int | None,
        slack: float,
    ) -> list[SampleAudit]:
        from policy.draw import sample_uniforms
        from policy.scoring import audit_samples

        uniforms = None
        if seeds is not None:
            width = max([steps or 0, *map(len, completions)])
            uniforms = [sample_uniforms(seed, width) for seed in seeds]
        with self._lock:
            model = self._model(version)
            return audit_samples(
                model,
                prompt_ids,
                completions,
                self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                uniforms=uniforms,
                slack=slack,
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
        seeds: list[int] | None = None,
        steps: int | None = None,
    ) -> LogprobVerdict:
        if seeds is not None and len(seeds) != len(completions):
            raise ValueError(f"{len(seeds)} seeds for {len(completions)} completions")
        slack, miss_share = REPLAY_SLACK.get(dtype, REPLAY_SLACK["bfloat16"])
        audits = await asyncio.to_thread(
            self._audit, version, prompt_ids, completions, seeds, steps, slack
        )
        n_tokens = sum(map(len, completions))
        where = f"{n_tokens} tokens of {len(completions)} samples at version {version}"
        tol = tolerance_for(self.tolerances, backend, dtype)
        value = deviation(tol.metric, claimed_logprobs, [a.logprobs for a in audits])
        if value > tol.threshold:
            return LogprobVerdict(
                False, tol.metric, value, tol.threshold,
                f"{tol.metric}={value:.3g} over {where} ({backend}/{dtype} limit "
                f"{tol.threshold:g})",
            )  # fmt: skip
        z = sampling_z(audits)
        if abs(z) > self.z_max:
            what = "likelier" if z > 0 else "less likely"
            return LogprobVerdict(
                False, "sampling_z", z, self.z_max,
                f"the tokens are {what} than sampling at temperature {self.temperature:g} gives "
                f"(z={z:.1f}, limit ±{self.z_max:g}) over {where}: greedy or another sampler",
                ReasonCode.SAMPLING_MISMATCH,
            )  # fmt: skip
        if seeds is not None:
            misses = sum(a.replay_misses or 0 for a in audits)
            allowed = math.floor(miss_share * n_tokens)
            if misses > allowed:
                return LogprobVerdict(
                    False, "replay_misses", float(misses), float(allowed),
                    f"{misses} of {n_tokens} tokens are not the draws of the lease's seeds "
                    f"(limit {allowed}) at version {version}: samples re-drawn, chosen or "
                    "decoded another way",
                    ReasonCode.SAMPLING_MISMATCH,
                )  # fmt: skip
        return LogprobVerdict(
            True, tol.metric, value, tol.threshold,
            f"{tol.metric}={value:.3g}, z={z:.1f} over {where} ({backend}/{dtype})",
        )  # fmt: skip
