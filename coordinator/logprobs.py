"""Behaviour log-prob spot check (DESIGN.md §7, check 7): the interface and an in-process verifier.

:class:`LogprobVerifier` is what the intake calls; :class:`InProcessLogprobVerifier` re-scores with
:func:`policy.scoring.audit_samples` on a model held by the coordinator (a cache of the last
``S + 1`` versions, cast to the dtype the node registered) and judges with the
:class:`~coordinator.config.Tolerance` of the node's registered ``(backend, dtype)``:

* each token's ``Δ`` is the distance of the claimed log-prob from its admissible interval (a point
  away from the top-k/top-p boundaries, wider where another machine's rounding within the
  tolerance's ``logit_margin`` may flip a boundary token: :mod:`policy.boundary`);
* ``max_abs``: largest ``Δ`` (fp32: near exact, 1e-3); ``median_rel``: ``median(exp(Δ)) − 1``
  (GRAIL's statistic; bf16 across GPUs: honest deviation ≤ 0.066 in 430k trials, rejected above
  0.10);
* the tail: the share of tokens with ``Δ > tail_delta`` at most ``tail_fraction`` (the median
  alone ignores up to half of the tokens, whose log-probs go straight into importance weights).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.config import Tolerance
from protocol.errors import ReasonCode

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from coordinator.calibration import HonestError
    from policy.scoring import SampleAudit

ModelLoader = Callable[[int], Any]


@dataclass(frozen=True)
class CalibrationSettings:
    """How the verifier calibrates each version's tolerance (:mod:`coordinator.calibration`)."""

    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    samples: int = 256
    margin: float = 2.0
    #: prompts of the version's first check used for the calibration, at most
    prompts: int = 16
    #: re-measure every this many versions; a version in between is held to the newest
    #: calibration at or below it (1: every version is measured)
    every: int = 1
    #: widen replayed bounds by the local spread of a second, bf16 forward (else one slack)
    local: bool = True

    @classmethod
    def from_intake(cls, intake: Any) -> CalibrationSettings | None:
        """From :class:`coordinator.config.IntakeSection` (None when ``calibrate`` is off)."""
        if not intake.calibrate:
            return None
        return cls(tuple(intake.accepted_dtypes), intake.calibration_samples,
                   intake.calibration_margin, every=intake.calibration_every,
                   local=intake.calibration_local)  # fmt: skip


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
    #: every figure the check computed (for the receipt log): statistic -> value
    figures: dict[str, float] = field(default_factory=dict)


class LogprobVerifier(Protocol):
    """Re-scores completions at ``version`` and says whether the claimed log-probs are honest.

    ``backend``/``dtype`` are what the node is held to (its registration, recorded in the
    lease), never a submission's labels; ``seeds`` (one per completion) replay every draw."""

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


def token_deltas(
    claimed: list[list[float]],
    lo: list[list[float]],
    hi: list[list[float]] | None = None,
) -> list[float]:
    """``Δ`` per token: distance of each claimed log-prob from ``[lo, hi]`` (``hi`` = ``lo``
    when omitted); ``inf`` for a token no honest machine keeps or on a length mismatch."""
    deltas: list[float] = []
    highs = hi if hi is not None else lo
    for c, a, b in zip(claimed, lo, highs, strict=True):
        if len(c) != len(a) or len(c) != len(b):
            return [math.inf]
        for x, low, high in zip(c, a, b, strict=True):
            if not math.isfinite(low):
                deltas.append(math.inf)
            else:
                deltas.append(max(0.0, low - x, x - high))
    return deltas


def deviation(
    metric: str,
    claimed: list[list[float]],
    reference: list[list[float]],
    reference_hi: list[list[float]] | None = None,
) -> float:
    """Tolerance statistic of the claimed log-probs against the re-scored ones (or their
    admissible intervals ``[reference, reference_hi]``); inf on a length mismatch."""
    deltas = token_deltas(claimed, reference, reference_hi)
    if not deltas:
        return 0.0
    if metric == "max_abs":
        return max(deltas)
    return statistics.median(math.exp(min(d, 700.0)) for d in deltas) - 1.0


def tail_share(deltas: Sequence[float], tail_delta: float) -> float:
    """Share of tokens whose ``Δ`` exceeds ``tail_delta`` (0 for no tokens)."""
    if not deltas:
        return 0.0
    return sum(1 for d in deltas if d > tail_delta) / len(deltas)


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

    ``model_loader(version)`` gives the published weights (fp32); a node registered in another
    dtype is re-scored on a copy cast to that dtype (hole: a bf16 node compared against fp32
    would need a looser tolerance than bf16 against bf16). One forward pass per check gives four
    tests, cheapest verdict first:

    1. claimed vs admissible log-probs within the tolerance's metric (``logprob_mismatch``:
       fabricated log-probs, another model or version);
    2. the tail: at most ``tail_fraction`` of the tokens beyond ``tail_delta``
       (``logprob_mismatch``: a few log-probs forged far off, which a median ignores);
    3. the sampling statistic :func:`sampling_z` within ``±z_max`` (``sampling_mismatch``: greedy
       or low-temperature decoding, another sampler — the log-probs alone can be honest);
    4. every token is an admissible draw of its seeded uniform (``sampling_mismatch``: re-drawn or
       cherry-picked samples). Every backend samples with :func:`policy.draw.draw_tokens`, so
       every submission is replayed.

    With calibration, the replay widens each CDF bound by the local spread of a second forward
    of the same batch in the coarsest accepted precision (bf16 by default: its model copy is
    cached beside the fp32 one) times the calibrated factor
    (:func:`coordinator.calibration.local_slack`).

    ``compute_s`` / ``checks`` / ``tokens`` add up the re-scoring work (verification compute,
    the second forward included).
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
        calibration: CalibrationSettings | None = None,
    ) -> None:
        self.model_loader = model_loader
        #: with settings: every version's tolerance is calibrated here, the same for every node,
        #: and every node is re-scored in fp32 (its registered dtype chooses nothing)
        self.calibration = calibration
        #: version -> its calibrated tolerance and the honest error it came from
        self.calibrated: dict[int, tuple[Tolerance, HonestError]] = {}
        self.tolerances = dict(tolerances)
        self.cache_size = max(1, cache_size)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.pad_id = pad_id
        self.z_max = z_max
        self._models: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # one scoring at a time; torch threads are set by the caller
        #: the re-scores' own thread: they run one at a time under ``_lock`` anyway, and on the
        #: event loop's shared executor a queue of them (a version's calibration takes minutes
        #: on a CPU) took every thread, so the answers' reward scoring (``asyncio.to_thread``)
        #: waited behind them until the nodes' submissions timed out
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rescore")
        #: seconds spent re-scoring (forward passes and audits), checks run, tokens re-scored
        self.compute_s = 0.0
        self.checks = 0
        self.tokens = 0
        #: seconds spent calibrating versions (not in ``compute_s``) and measurements made
        self.calibration_s = 0.0
        self.calibrations = 0

    @classmethod
    def for_config(
        cls, cfg: Any, model_loader: ModelLoader, *, pad_id: int
    ) -> InProcessLogprobVerifier:
        """The verifier a coordinator with config ``cfg`` (:class:`coordinator.config.
        CoordinatorConfig`) re-scores with; a verifier process builds the same from the same
        config, so both hold nodes to the same tolerances."""
        return cls(
            model_loader,
            cfg.intake.tolerances,
            cache_size=cfg.staleness_bound + 1,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            pad_id=pad_id,
            z_max=cfg.intake.sampling_z_max,
            calibration=CalibrationSettings.from_intake(cfg.intake),
        )

    def _model(self, version: int, dtype: str) -> Any:
        """The model of ``version`` in ``dtype`` (loaded/cast if not cached); call with
        ``_lock`` held."""
        key = (version, dtype)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        base = self._models.get((version, "float32"))
        if base is None:
            base = self._cache((version, "float32"), self.model_loader(version))
        if dtype == "float32":
            return base
        import torch

        return self._cache(key, copy.deepcopy(base).to(getattr(torch, dtype)))

    def _cache(self, key: tuple[int, str], model: Any) -> Any:
        self._models[key] = model
        versions = {v for v, _ in self._models}
        while len(versions) > self.cache_size:  # drop the least recently used version wholly
            oldest = next(iter(self._models))[0]
            for k in [k for k in self._models if k[0] == oldest]:
                del self._models[k]
            versions.discard(oldest)
        return model

    def preload(self, version: int) -> None:
        """Load the model of ``version`` ahead of its first check (blocking: call it from a worker
        thread). The load runs outside the scoring lock, so checks go on meanwhile."""
        if (version, "float32") in self._models:
            return
        model = self.model_loader(version)
        with self._lock:
            if (version, "float32") not in self._models:
                self._cache((version, "float32"), model)

    def cached_versions(self) -> list[int]:
        return list(dict.fromkeys(v for v, _ in self._models))

    def tolerance_of(self, version: int, prompt_ids: list[list[int]], steps: int) -> Tolerance:
        """The calibrated tolerance of ``version`` (see :meth:`calibration_of`)."""
        return self.calibration_of(version, prompt_ids, steps)[0]

    def calibration_of(
        self, version: int, prompt_ids: list[list[int]], steps: int
    ) -> tuple[Tolerance, HonestError]:
        """The calibrated tolerance of ``version`` (blocking; call with ``_lock`` held): honest
        samples of the check's prompts in every accepted precision
        (:func:`coordinator.calibration.measure_honest_error`), measured on the first check of a
        version at least ``calibration.every`` versions after the newest measured one; a version
        in between is held to the newest measurement at or below it. Measuring costs about as
        much as generating ``samples`` rollouts per precision, so measuring every version starves
        the checks when versions come every few seconds (the demo publishes one per step)."""
        from coordinator.calibration import calibrated_tolerance, measure_honest_error

        assert self.calibration is not None
        cal = self.calibration
        if version not in self.calibrated:
            below = [v for v in self.calibrated if v <= version]
            if below and version - max(below) < cal.every:
                return self.calibrated[max(below)]
            t0 = time.perf_counter()
            log.info(
                "calibrating policy v%d: %d honest samples in %s (the checks of v%d wait for it)",
                version, cal.samples, "/".join(cal.dtypes), version,
            )  # fmt: skip
            err = measure_honest_error(
                self._model(version, "float32"),
                prompt_ids[: cal.prompts],
                dtypes=cal.dtypes,
                samples=cal.samples,
                steps=max(1, steps),
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=version,
            )
            spent = time.perf_counter() - t0
            self.calibration_s += spent
            self.calibrations += 1
            tol = calibrated_tolerance(err, cal.margin, local=cal.local)
            log.info(
                "calibrated policy v%d in %.1f s: per-token |Δ log p| up to %.3g (%d positions)",
                version, spent, tol.threshold, err.positions,
            )  # fmt: skip
            self.calibrated[version] = (tol, err)
            while len(self.calibrated) > self.cache_size:
                del self.calibrated[min(self.calibrated)]
        return self.calibrated[version]

    def _audit(
        self,
        version: int,
        dtype: str,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        seeds: list[int] | None,
        steps: int | None,
        tol: Tolerance | None,
    ) -> tuple[list[SampleAudit], Tolerance]:
        from policy.draw import sample_uniforms
        from policy.scoring import audit_samples

        uniforms = None
        if seeds is not None:
            width = max([steps or 0, *map(len, completions)])
            uniforms = [sample_uniforms(seed, width) for seed in seeds]
        with self._lock:
            alt, local = None, 0.0
            if tol is None:
                from coordinator.calibration import local_slack

                assert self.calibration is not None
                tol, err = self.calibration_of(
                    version, prompt_ids, steps or max(map(len, completions))
                )
                if self.calibration.local and err.local_dtype is not None and uniforms is not None:
                    # the second forward whose spread sizes each replayed bound's slack
                    alt = self._model(version, err.local_dtype)
                    local = local_slack(err, self.calibration.margin)
            model = self._model(version, dtype)  # loading weights is I/O, not re-scoring
            t0 = time.perf_counter()
            out = audit_samples(
                model,
                prompt_ids,
                completions,
                self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                uniforms=uniforms,
                slack=tol.replay_slack,
                rel_slack=tol.replay_rel_slack,
                margin=tol.logit_margin,
                alt_model=alt,
                local_slack=local,
                pad_id=self.pad_id,
            )
            self.compute_s += time.perf_counter() - t0
            self.checks += 1
            self.tokens += sum(
                len(p) + len(c) for p, c in zip(prompt_ids, completions, strict=True)
            )
            return out, tol

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
        if self.calibration is not None:  # the coordinator's measurement, whatever the label
            fixed, dtype, label = None, "float32", f"calibrated v{version}"
        else:
            fixed = tolerance_for(self.tolerances, backend, dtype)
            label = f"{backend}/{dtype}"
        audits, tol = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._audit, version, dtype, prompt_ids, completions, seeds, steps,
            fixed,
        )  # fmt: skip
        return judge(
            audits,
            claimed_logprobs,
            tol,
            label=label,
            version=version,
            z_max=self.z_max,
            temperature=self.temperature,
            replayed=seeds is not None,
        )


def judge(
    audits: Sequence[SampleAudit],
    claimed: list[list[float]],
    tol: Tolerance,
    *,
    label: str,
    version: int,
    z_max: float,
    temperature: float,
    replayed: bool,
) -> LogprobVerdict:
    """The verdict of one spot check from its audits, cheapest test first (see
    :class:`InProcessLogprobVerifier`). The detail names figures and limits, never which samples
    were checked nor what the expected draws were."""
    n_tokens = sum(len(c) for c in claimed)
    where = f"{n_tokens} tokens of {len(claimed)} samples at version {version}"
    lo = [a.lo or a.logprobs for a in audits]
    hi = [a.hi or a.logprobs for a in audits]
    deltas = token_deltas(claimed, lo, hi)
    value = deviation(tol.metric, claimed, lo, hi)
    figures: dict[str, float] = {
        "tokens": float(n_tokens),
        "samples": float(len(claimed)),
        tol.metric: value,
        "boundary_tokens": float(sum(a.boundary for a in audits)),
    }
    if value > tol.threshold:
        return LogprobVerdict(
            False, tol.metric, value, tol.threshold,
            f"{tol.metric}={value:.3g} over {where} ({label} limit {tol.threshold:g})",
            figures=figures,
        )  # fmt: skip
    if tol.tail_delta is not None:
        tail = tail_share(deltas, tol.tail_delta)
        figures["tail_share"] = tail
        if tail > tol.tail_fraction:
            return LogprobVerdict(
                False, "tail_share", tail, tol.tail_fraction,
                f"{tail:.1%} of {where} deviate by more than {tol.tail_delta:g} in log-prob "
                f"({label} limit {tol.tail_fraction:.1%})",
                figures=figures,
            )  # fmt: skip
    z = sampling_z(audits)
    figures["sampling_z"] = z
    if abs(z) > z_max:
        what = "likelier" if z > 0 else "less likely"
        return LogprobVerdict(
            False, "sampling_z", z, z_max,
            f"the tokens are {what} than sampling at temperature {temperature:g} gives "
            f"(z={z:.1f}, limit ±{z_max:g}) over {where}: greedy or another sampler",
            ReasonCode.SAMPLING_MISMATCH,
            figures=figures,
        )  # fmt: skip
    if replayed:
        misses = sum(a.replay_misses or 0 for a in audits)
        allowed = math.floor(tol.replay_miss_share * n_tokens)
        figures["replay_misses"] = float(misses)
        if misses > allowed:
            return LogprobVerdict(
                False, "replay_misses", float(misses), float(allowed),
                f"{misses} of {n_tokens} tokens are not the draws of the lease's seeds "
                f"(limit {allowed}) at version {version}: samples re-drawn, chosen or "
                "decoded another way",
                ReasonCode.SAMPLING_MISMATCH,
                figures=figures,
            )  # fmt: skip
    return LogprobVerdict(
        True, tol.metric, value, tol.threshold,
        f"{tol.metric}={value:.3g}, z={z:.1f} over {where} ({label})",
        figures=figures,
    )  # fmt: skip
