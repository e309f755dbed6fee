"""Holes a node could use to steer its own verification, and honest nodes struck for rounding
(issue 12). Each test fails on the coordinator before the fix (commit 9b642ef): a real tiny
model samples with the ``hf`` backend; cheats keep everything else honest."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from coord_harness import Harness, advert, sampled, submission

from coordinator.errors import Rejection
from coordinator.intake import expected_seed
from coordinator.logprobs import InProcessLogprobVerifier
from policy.model import ModelSpec, build_model
from policy.testing import rounding_twins
from protocol.envelope import seal
from protocol.errors import ProtocolError, ReasonCode
from protocol.messages import (
    Ack,
    Reject,
    RolloutSubmission,
    pack_logprobs,
    pack_tokens,
    unpack_logprobs,
)


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


@pytest.fixture(scope="module")
def finetuned(model: Any) -> Any:
    """A perturbed ("fine-tuned") copy: the reference weights plus 2% noise."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    return other


def checked(
    tmp_path: Path,
    model: Any,
    *,
    sampling: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
    **intake: Any,
) -> Harness:
    """A coordinator that re-scores every lease (every sample) with ``model``; ``top``: other
    top-level settings (group_size, ...)."""
    h = Harness(
        tmp_path,
        **(top or {}),
        intake={"spot_check_fraction": 1.0, **intake},
        sampling={"max_new_tokens": 12, **(sampling or {})},
    )
    h.verifier = InProcessLogprobVerifier(
        lambda version: model,
        h.cfg.intake.tolerances,
        cache_size=2,
        temperature=h.cfg.sampling.temperature,
        top_p=h.cfg.sampling.top_p,
        top_k=h.cfg.sampling.top_k,
    )
    h.reopen()
    h.publish(1)
    return h


def relabel(sub: RolloutSubmission, backend: str, dtype: str) -> RolloutSubmission:
    return msgspec.structs.replace(sub, backend=backend, dtype=dtype)  # type: ignore[arg-type]


# --- hole 1: the submission chose its own checks ------------------------------------------------
async def test_a_submission_cannot_relabel_its_backend_or_dtype(
    tmp_path: Path, model: Any, finetuned: Any
) -> None:
    """A node registered hf/float32 labels its submissions vllm/bfloat16 to get the looser bf16
    tolerance and no replay: cherry-picked samples and samples of a fine-tuned copy were accepted.
    Now the labels must be the registration's: refused (registration_mismatch) and struck."""
    h = checked(tmp_path, model)
    node = h.node(backend="hf", dtype="float32")
    for cheat in (
        sampled(h.lease(node), model, seed_offset=3),  # re-drawn from other seeds
        sampled(h.lease(node), finetuned),  # another model's samples and log-probs
    ):
        got = await h.core.submit(node.public_key, relabel(cheat, "vllm", "bfloat16"))
        assert isinstance(got, Reject) and got.code is ReasonCode.REGISTRATION_MISMATCH, got
        assert "registered hf/float32" in got.detail
    assert h.core.reputation.strikes(node.public_key) == {"registration_mismatch": 2}
    # labelled honestly, the same cheats meet the registration's checks
    cheat = sampled(h.lease(node), finetuned)
    got = await h.core.submit(node.public_key, cheat)
    assert isinstance(got, Reject) and got.code is ReasonCode.LOGPROB_MISMATCH, got
    assert h.store.rollout_count() == 0


async def test_the_spot_check_rescores_in_the_registered_dtype(tmp_path: Path, model: Any) -> None:
    """A node registered bfloat16 is re-scored on a bfloat16 copy of the weights, and its honest
    bf16 samples pass; re-registering with another dtype is rate-limited and logged."""
    h = checked(tmp_path, model)
    node = h.node(backend="hf", dtype="bfloat16")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    got = await h.core.submit(
        node.public_key, sampled(h.lease(node), bf16, backend="hf", dtype="bfloat16")
    )
    assert isinstance(got, Ack), got
    assert h.verifier is not None
    assert (1, "bfloat16") in h.verifier._models  # type: ignore[attr-defined]
    # a change of dtype right away is refused (no strike), later allowed with a fresh history
    with pytest.raises(Rejection) as e:
        h.core.register(node.public_key, advert(node, h.clock(), dtype="float32"))
    assert e.value.code is ReasonCode.REGISTRATION_MISMATCH and not e.value.strike
    assert e.value.retry_after_s is not None and e.value.retry_after_s > 0
    h.clock.advance(h.cfg.intake.registration_change_interval_s + 1)
    h.core.register(node.public_key, advert(node, h.clock(), dtype="float32"))
    assert h.store.get_node(node.public_key).dtype == "float32"  # type: ignore[union-attr]
    assert h.core.reputation.strikes(node.public_key) == {}
    kinds = [e.data().get("held_to") for e in h.core.receipts.entries() if e.kind == "register"]
    assert kinds == ["hf/bfloat16", "hf/float32"]


# --- hole 2: the median ignored up to half of the tokens ----------------------------------------
async def test_forged_tail_logprobs_are_caught_under_bf16(tmp_path: Path, model: Any) -> None:
    """40% of each sample's behaviour log-probs set to −20 (they go straight into importance
    weights): the bf16 median statistic ignores them; the tail bound does not."""
    h = checked(tmp_path, model)
    node = h.node(backend="hf", dtype="bfloat16")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    honest = sampled(h.lease(node), bf16, dtype="bfloat16")

    def forge(lps: list[float]) -> list[float]:
        k = int(0.4 * len(lps))
        return [-20.0] * k + lps[k:]

    forged = msgspec.structs.replace(
        honest,
        groups=[
            msgspec.structs.replace(
                g,
                samples=[
                    msgspec.structs.replace(
                        s, logprobs=pack_logprobs(forge(unpack_logprobs(s.logprobs)))
                    )
                    for s in g.samples
                ],
            )
            for g in honest.groups
        ],
    )
    got = await h.core.submit(node.public_key, forged)
    assert isinstance(got, Reject) and got.code is ReasonCode.LOGPROB_MISMATCH, got
    assert "deviate by more than" in got.detail
    # 40% of tokens beyond the bound, 20 times the 2% allowed: banned at once (issue 34)
    assert h.core.reputation.banned(node.public_key, h.clock()) is not None


# --- hole 3: replay for every backend -----------------------------------------------------------
async def test_a_vllm_node_is_replayed_too(tmp_path: Path, model: Any) -> None:
    """Samples re-drawn from other seeds (best-of-N material) with honest log-probs pass every
    statistic; only the seeded replay tells. It used to run for ``hf`` only: a node registered as
    ``vllm`` escaped it. Every backend now draws with the same rule and is replayed."""
    h = checked(tmp_path, model)
    node = h.node(backend="vllm", dtype="float32")
    cheat = sampled(h.lease(node), model, seed_offset=5, backend="vllm")
    got = await h.core.submit(node.public_key, cheat)
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert "draws of the lease's seeds" in got.detail
    assert h.core.reputation.banned(node.public_key, h.clock()) is not None  # far off: at once
    other = h.node(backend="vllm", dtype="float32")
    honest = sampled(h.lease(other), model, backend="vllm")
    assert isinstance(await h.core.submit(other.public_key, honest), Ack)


# --- hole 4: honest nodes struck for their rounding ---------------------------------------------
async def test_an_honest_node_with_other_rounding_is_not_struck(tmp_path: Path) -> None:
    """top-k 5 / top-p 0.8 at T = 1.3, and a node whose logits differ from the coordinator's by
    ~1e-6 (another CPU): where tied tokens straddle the cut the two keep different sets, and the
    node's log-probs of that position differ by the flipped tokens' mass. Boundary tokens within
    the fp32 logit margin are admissible: every lease accepted, no strike."""
    reference, other_cpu = rounding_twins()
    h = checked(tmp_path, reference, sampling={"temperature": 1.3, "top_k": 5, "top_p": 0.8})
    node = h.node()
    boundary = 0.0
    for _ in range(4):
        got = await h.core.submit(node.public_key, sampled(h.lease(node), other_cpu))
        assert isinstance(got, Ack), got
    for entry in h.core.receipts.entries():
        if entry.kind == "verdict":
            boundary += entry.data()["checks"]["figures"]["boundary_tokens"]
    assert boundary > 0  # the rounding did flip boundary tokens, and they were admitted
    assert h.core.reputation.strikes(node.public_key) == {}


# --- hole 6: a byte-for-byte re-send gets the stored verdict ------------------------------------
async def test_resending_the_same_envelope_returns_the_stored_verdict(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    lease = h.lease(node, max_prompts=1)
    bad = seal(node, submission(lease, completions=[[[99, 2], [99, 2]]]), now=h.clock())
    signer, sub = h.core.open(bad, RolloutSubmission)
    first = await h.core.submit(signer, sub)
    assert isinstance(first, Reject) and first.code is ReasonCode.TOKEN_OUT_OF_VOCAB
    with pytest.raises(ProtocolError) as e:  # the replay guard has seen these bytes
        h.core.open(bad, RolloutSubmission)
    assert e.value.code is ReasonCode.REPLAYED
    assert h.core.replayed_submission(bad) == first  # what the service answers
    good = seal(node, submission(h.lease(node, max_prompts=1)), now=h.clock())
    ack = await h.core.submit(*h.core.open(good, RolloutSubmission))
    assert isinstance(ack, Ack)
    assert h.core.replayed_submission(good) == ack
    assert h.store.rollout_count() == 2  # nothing counted twice
    assert h.core.reputation.strikes(node.public_key) == {"token_out_of_vocab": 1}
    # another key re-sending it learns nothing (the lease is not its own): refused as replayed
    other = h.node()
    stolen = msgspec.structs.replace(bad, signer=other.public_key)
    assert h.core.replayed_submission(stolen) is None


# --- hole 7: details must not hand a cheater what it needs --------------------------------------
async def test_a_seed_refusal_does_not_name_the_expected_seed(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    lease = h.lease(node, max_prompts=1)
    sub = submission(lease)
    group = sub.groups[0]
    wrong = msgspec.structs.replace(
        sub,
        groups=[
            msgspec.structs.replace(
                group, samples=[msgspec.structs.replace(group.samples[0], seed=1), group.samples[1]]
            )
        ],
    )
    got = await h.core.submit(node.public_key, wrong)
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH
    assert str(expected_seed(lease.sampling.seed, 0, 0)) not in got.detail
    assert "seed 1 is not the one the lease assigns" in got.detail


def test_a_token_only_another_machine_keeps_leaves_the_statistic_finite() -> None:
    """Found by bench/calibrate_verifier.py: a boundary token the verifier's own rounding drops
    (its log-prob here is -inf) made the sampling statistic infinite and refused an honest
    sample. Its admissible value is used instead; only a token no honest machine keeps is -inf."""
    from coordinator.logprobs import sampling_z
    from node.backends import GenerationRequest, SamplingConfig
    from node.backends.hf import HFBackend
    from policy.boundary import DEFAULT_LOGIT_MARGIN
    from policy.draw import sample_uniforms
    from policy.sampling import sample_seed
    from policy.scoring import audit_samples, score_logprobs

    reference, other_cpu = rounding_twins()
    cfg = SamplingConfig(temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=12)
    prompts = [[1, 4 + i % 4, 5, 3] for i in range(6)]
    reqs = [GenerationRequest(p, 4, seed=i) for i, p in enumerate(prompts)]
    outs = HFBackend(model=other_cpu, device="cpu").generate(reqs, cfg)
    ps = [r.prompt_token_ids for r, g in zip(reqs, outs, strict=True) for _ in g]
    cs = [s.token_ids for g in outs for s in g]
    own = score_logprobs(reference, ps, cs, 1.3, top_p=0.8, top_k=5)
    assert any(x == float("-inf") for lp in own for x in lp)  # the case: dropped here
    seeds = [sample_seed(r.seed, j) for r in reqs for j in range(4)]
    audits = audit_samples(
        reference, ps, cs, 1.3, top_p=0.8, top_k=5,
        uniforms=[sample_uniforms(s, 12) for s in seeds],
        margin=DEFAULT_LOGIT_MARGIN["float32"],
    )  # fmt: skip
    assert all(x > float("-inf") for a in audits for x in a.logprobs)
    assert abs(sampling_z(audits)) < 6.0
    assert sum(a.replay_misses or 0 for a in audits) == 0


# --- issue 34, finding 5: only 8 samples of a checked lease were re-scored ----------------------
async def test_every_sample_of_a_checked_lease_is_rescored(tmp_path: Path, model: Any) -> None:
    """One sample of 24 replaced by a reward-1 forgery (the right answer, with the honest
    log-probs of those tokens, so only the seeded replay can tell): with 8 of 24 samples
    re-scored it passed 2 checks in 3. Every sample is re-scored now: each lease is refused."""
    from coord_harness import answer

    from policy.scoring import score_logprobs

    h = checked(tmp_path, model, top={"group_size": 8})
    refused = 0
    for k in range(6):
        node = h.node()  # a fresh identity per lease (its refused leases stay active)
        lease = h.lease(node, max_prompts=3)
        honest = sampled(lease, model)
        gi, si = k % 3, (5 * k) % 8
        forged_tokens = answer(lease, gi)
        prompt = list(unpack_tokens_of(lease, gi))
        lps = score_logprobs(model, [prompt], [forged_tokens])[0]
        group = honest.groups[gi]
        samples = list(group.samples)
        samples[si] = msgspec.structs.replace(
            samples[si],
            token_ids=pack_tokens(forged_tokens),
            logprobs=pack_logprobs(lps),
            finish_reason="eos",
        )
        groups = list(honest.groups)
        groups[gi] = msgspec.structs.replace(group, samples=samples)
        got = await h.core.submit(node.public_key, msgspec.structs.replace(honest, groups=groups))
        refused += isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH
    assert refused == 6
    assert h.store.rollout_count() == 0


def unpack_tokens_of(lease: Any, index: int) -> list[int]:
    from protocol.messages import unpack_tokens

    return unpack_tokens(lease.prompts[index].token_ids)
