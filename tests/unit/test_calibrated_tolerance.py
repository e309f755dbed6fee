"""The coordinator decides the tolerance (issue 34, findings 1 and 2): each version's tolerance is
calibrated on the coordinator's own model copy across the precisions it accepts, the same for
every node, never chosen by the node's registered dtype (coordinator/calibration.py).

The forgeries of finding 1 were accepted under a bf16 or fp16 registration (median_rel 0.10, a
2% tail beyond 1.0); they are refused under any registration now, and honest nodes of every
accepted precision and path pass."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from coord_harness import Harness, sampled

from coordinator.calibration import (
    LOCAL_FLOOR,
    HonestError,
    admissible_per_position,
    calibrated_tolerance,
    local_dtype,
    local_slack,
    measure_honest_error,
)
from coordinator.config import IntakeSection, Tolerance
from coordinator.logprobs import CalibrationSettings, InProcessLogprobVerifier
from policy.model import CharTokenizer, ModelSpec, build_model
from protocol.errors import ReasonCode
from protocol.messages import Ack, Reject, RolloutSubmission, pack_logprobs, unpack_logprobs

PRECISIONS = ("float32", "bfloat16", "float16")


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0).eval()


def calibrated(tmp_path: Path, model: Any, **top: Any) -> Harness:
    """A coordinator that re-scores every lease with a calibrated verifier (as the service)."""
    h = Harness(
        tmp_path,
        intake={"spot_check_fraction": 1.0},
        sampling={"max_new_tokens": 12},
        **top,
    )
    h.verifier = InProcessLogprobVerifier(
        lambda version: model,
        h.cfg.intake.tolerances,
        cache_size=2,
        calibration=CalibrationSettings.from_intake(h.cfg.intake),
    )
    h.reopen()
    h.publish(1)
    return h


def forge(sub: RolloutSubmission, how: Any) -> RolloutSubmission:
    """The submission with every sample's log-probs passed through ``how(list) -> list``."""
    return msgspec.structs.replace(
        sub,
        groups=[
            msgspec.structs.replace(
                g,
                samples=[
                    msgspec.structs.replace(
                        s, logprobs=pack_logprobs(how(unpack_logprobs(s.logprobs)))
                    )
                    for s in g.samples
                ],
            )
            for g in sub.groups
        ],
    )


def _shift_45(lps: list[float]) -> list[float]:
    k = max(1, int(0.45 * len(lps)))
    return [min(0.0, x - 0.99) for x in lps[:k]] + lps[k:]


def _jitter(lps: list[float]) -> list[float]:
    return [min(0.0, x + (0.09 if i % 2 else -0.09)) for i, x in enumerate(lps)]


def _minus_30(lps: list[float]) -> list[float]:
    return [-30.0, *lps[1:]]  # one token of the sample (the lease: ~1.5% of its tokens)


FORGERIES = {"shift_45pct_-0.99": _shift_45, "all_±0.09": _jitter, "one_token_-30": _minus_30}


@pytest.mark.parametrize("dtype", PRECISIONS)
async def test_finding_1_forgeries_are_refused_under_any_registration(
    tmp_path: Path, model: Any, dtype: str
) -> None:
    h = calibrated(tmp_path, model, group_size=4)
    node_model = copy.deepcopy(model).to(getattr(torch, dtype))
    for name, how in FORGERIES.items():
        node = h.node(dtype=dtype)  # a fresh identity each: the gross ones are banned at once
        honest = sampled(h.lease(node, max_prompts=2), node_model, dtype=dtype)
        got = await h.core.submit(node.public_key, forge(honest, how))
        assert isinstance(got, Reject) and got.code is ReasonCode.LOGPROB_MISMATCH, (name, got)
        banned = h.core.reputation.banned(node.public_key, h.clock()) is not None
        assert banned == (name != "all_±0.09"), name  # ±0.09 is ~7x the limit: a strike
    honest_node = h.node(dtype=dtype)
    honest = sampled(h.lease(honest_node, max_prompts=2), node_model, dtype=dtype)
    assert isinstance(await h.core.submit(honest_node.public_key, honest), Ack)
    assert h.verifier is not None
    assert list(h.verifier.calibrated) == [1]  # calibrated once, for version 1
    # re-scored in fp32 whatever the node's dtype, plus the bf16 forward whose spread sizes the
    # replay's slack (the coarsest accepted precision)
    assert h.verifier._models.keys() == {(1, "float32"), (1, "bfloat16")}


async def test_honest_nodes_of_every_precision_and_path_pass(tmp_path: Path, model: Any) -> None:
    """No false strike: fp32, bf16 and fp16 nodes generating through the KV cache, and a bf16
    node computing in fp32, over 16 leases of 24 samples (384 samples, ~4,600 tokens); the
    calibration bench runs >= 10,000 per precision (bench/calibrate_verifier.py)."""
    h = calibrated(tmp_path, model, group_size=8)
    bf16_fp32 = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    nodes = [(d, copy.deepcopy(model).to(getattr(torch, d))) for d in PRECISIONS]
    nodes.append(("bfloat16", bf16_fp32))
    for dtype, node_model in nodes:
        node = h.node(dtype=dtype)
        for _ in range(4):
            lease = h.lease(node, max_prompts=3)
            got = await h.core.submit(node.public_key, sampled(lease, node_model, dtype=dtype))
            assert isinstance(got, Ack), (dtype, got)
        assert h.core.reputation.strikes(node.public_key) == {}


def test_calibration_measures_each_path_and_rejects_a_bad_margin(model: Any) -> None:
    tok = CharTokenizer()
    prompts = [tok.encode_prompt(p) for p in ("abc>", "dcb>", "aab>")]
    err = measure_honest_error(model, prompts, dtypes=PRECISIONS, samples=16, steps=6)
    assert set(err.paths) == {
        "kv/float32", "kv/bfloat16", "batched/bfloat16", "fp32-compute/bfloat16",
        "kv/float16", "batched/float16", "fp32-compute/float16",
    }  # fmt: skip
    # fp32 through the KV cache vs one batched forward: rounding only (fp32 ulps of ~1)
    assert err.paths["kv/float32"][0] < 1e-4
    # bf16 (8 mantissa bits) errs more than fp16 (11) on this model
    assert err.paths["batched/bfloat16"][1] > err.paths["batched/float16"][1]
    tol = calibrated_tolerance(err, 2.0)
    assert tol.metric == "max_abs" and tol.replay_miss_share == 0.0
    assert tol.threshold == pytest.approx(2.0 * err.logprob)
    with pytest.raises(ValueError, match="margin"):
        calibrated_tolerance(err, 0.5)
    with pytest.raises(ValueError, match="prompt"):
        measure_honest_error(model, [], dtypes=PRECISIONS, samples=8, steps=4)


PROMPTS = ("abc>", "dcb>", "aab>", "bca>")


@pytest.fixture(scope="module")
def version_error(model: Any) -> HonestError:
    """The embedded model's calibration at the coordinator's defaults (256 samples per path)."""
    tok = CharTokenizer()
    prompts = [tok.encode_prompt(p) for p in PROMPTS]
    settings = CalibrationSettings()
    return measure_honest_error(
        model, prompts, dtypes=settings.dtypes, samples=settings.samples, steps=8
    )


def test_the_replay_admits_at_most_1_05_tokens_per_position(
    model: Any, version_error: HonestError
) -> None:
    """Finding 2: the fixed bf16 slack (2% of the mass at every CDF bound) admitted ~2 tokens
    per position, enough for a forgery to pick the best one at every step; one calibrated global
    slack (M · κ · c(1 − c)) ~1.11. Widening each bound by the local spread of the verifier's own
    fp32 and bf16 forwards admits ~1.046 (measured on these 2,048 positions; 1.047 on model seed
    1). The count is deterministic for this model and seed; the 0.0036 left to the target is 7
    admitted tokens of 2,048, far more than float rounding can move (a token flips only where
    ``u`` lies within rounding, ~1e-7, of a widened bound)."""
    err = version_error
    margin = IntakeSection().calibration_margin
    tol = calibrated_tolerance(err, margin)
    assert err.local_dtype == "bfloat16"
    tok = CharTokenizer()
    prompts = [tok.encode_prompt(p) for p in PROMPTS]
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([prompts[i % 4] + torch.randint(3, 26, (6,), generator=g).tolist()
                        for i in range(256)])  # fmt: skip
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[:, -8:].reshape(-1, 26).float()
        alt = bf16(input_ids=ids).logits[:, -8:].reshape(-1, 26).float()
    u = torch.rand(logits.shape[0], generator=g)
    local = admissible_per_position(logits, u, tol, alt_logits=alt, local=local_slack(err, margin))
    global_slack = tol.model_copy(update={"replay_rel_slack": margin * err.cdf_rel})
    legacy = admissible_per_position(logits, u, IntakeSection().tolerances["*/bfloat16"])
    assert legacy > 1.8
    assert admissible_per_position(logits, u, global_slack) > 1.09
    assert local <= 1.05


def test_honest_bf16_samples_pass_the_local_replay(model: Any, version_error: HonestError) -> None:
    """The local slack is sized on the verifier's own spread: honest bf16 nodes (through the KV
    cache, and weights in bf16 computing in fp32) must still replay every token, seeds other
    than the calibration's (the intake-level test above runs fp32/fp16 nodes too)."""
    from node.backends import GenerationRequest, SamplingConfig
    from node.backends.hf import HFBackend
    from policy.draw import sample_uniforms
    from policy.sampling import prompt_seed, sample_seed
    from policy.scoring import audit_samples

    err = version_error
    margin = IntakeSection().calibration_margin
    tol = calibrated_tolerance(err, margin)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    nodes = {"kv/bf16": bf16, "fp32-compute/bf16": copy.deepcopy(bf16).to(torch.float32)}
    tok = CharTokenizer()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8)
    for name, node_model in nodes.items():
        backend = HFBackend(model=node_model, device="cpu")
        requests = [GenerationRequest(tok.encode_prompt(p), 8, prompt_seed(4242, i))
                    for i, p in enumerate(PROMPTS * 4)]  # fmt: skip
        misses = tokens = 0
        for req, group in zip(requests, backend.generate(requests, cfg), strict=True):
            comps = [s.token_ids for s in group]
            uniforms = [sample_uniforms(sample_seed(req.seed, j), 8) for j in range(8)]
            audits = audit_samples(
                model, [req.prompt_token_ids] * 8, comps, uniforms=uniforms,
                slack=tol.replay_slack, rel_slack=tol.replay_rel_slack, margin=tol.logit_margin,
                alt_model=bf16, local_slack=local_slack(err, margin),
            )  # fmt: skip
            misses += sum(a.replay_misses or 0 for a in audits)
            tokens += sum(map(len, comps))
        assert tokens > 800 and misses == 0, (name, misses, tokens)


def test_the_local_slack_rule_and_its_inputs() -> None:
    assert local_dtype(["float32", "bfloat16", "float16"]) == "bfloat16"  # coarsest first
    assert local_dtype(["float16", "float32"]) == "float16"
    assert local_dtype(["float32"]) is None  # fp32 only: no second forward
    with pytest.raises(ValueError, match="float8"):
        local_dtype(["float8"])
    err = HonestError(1e-3, 1e-3, 1e-3, 0.5, "bfloat16", 10, 1, {})
    assert local_slack(err, 2.0) == pytest.approx(1.0)
    assert local_slack(dataclasses.replace(err, local=0.0), 2.0) > 0.0  # floored
    with pytest.raises(ValueError, match="margin"):
        local_slack(err, 0.5)
    assert isinstance(calibrated_tolerance(err, 2.0), Tolerance)


def test_calibration_is_measured_every_few_versions_not_every_version(model: Any) -> None:
    """A measurement costs about as much as generating ``samples`` rollouts per precision; with a
    version per learner step (the demo) measuring each one starved the checks (the demo's learner
    went from ~1 step/s to ~0.25). Versions between two measurements are held to the newest one
    at or below them; a version ``every`` after it is measured afresh."""
    verifier = InProcessLogprobVerifier(
        lambda version: model,
        {},
        cache_size=4,
        calibration=CalibrationSettings(samples=8, every=3),
    )
    prompts = [[1, 2, 3, 4]]
    with verifier._lock:
        first = verifier.tolerance_of(5, prompts, 6)
        assert verifier.calibrations == 1
        assert verifier.tolerance_of(6, prompts, 6) == first
        assert verifier.tolerance_of(7, prompts, 6) == first
        assert verifier.calibrations == 1
        verifier.tolerance_of(8, prompts, 6)  # 5 + every: measured again
        assert verifier.calibrations == 2
        verifier.tolerance_of(4, prompts, 6)  # nothing measured at or below 4
        assert verifier.calibrations == 3


def test_every_version_is_measured_with_every_1(model: Any) -> None:
    verifier = InProcessLogprobVerifier(
        lambda version: model, {}, cache_size=4, calibration=CalibrationSettings(samples=8)
    )
    with verifier._lock:
        for v in (1, 2, 3):
            verifier.tolerance_of(v, [[1, 2, 3]], 4)
    assert verifier.calibrations == 3


def test_calibration_local_false_uses_one_global_slack_and_no_second_forward(model: Any) -> None:
    """``intake.calibration_local = false`` (a CPU verifier, where the bf16 forward costs ~5x
    the fp32 one): the replay falls back to one global slack M·κ·c(1 − c), no bf16 copy."""
    intake = IntakeSection(calibration_local=False, calibration_samples=8)
    settings = CalibrationSettings.from_intake(intake)
    assert settings is not None and not settings.local
    verifier = InProcessLogprobVerifier(
        lambda version: model, {}, cache_size=2, calibration=settings
    )
    with verifier._lock:
        tol, err = verifier.calibration_of(1, [[1, 2, 3, 4]], 6)
    audits, _ = verifier._audit(1, "float32", [[1, 2, 3, 4]], [[5, 6, 7]], [9], 6, None)
    assert tol.replay_rel_slack == pytest.approx(settings.margin * err.cdf_rel)
    assert audits[0].replay_misses is not None
    assert verifier._models.keys() == {(1, "float32")}
    local_tol = calibrated_tolerance(err, settings.margin)
    assert local_tol.replay_rel_slack == pytest.approx(
        local_slack(err, settings.margin) * LOCAL_FLOOR
    )
