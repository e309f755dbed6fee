"""node.byzantine: each mode changes exactly what it claims to, and the coordinator catches it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from coord_harness import TOK, Harness, submission

from node.byzantine import local_answer, misbehave
from protocol.errors import ReasonCode
from protocol.messages import Reject, unpack_logprobs, unpack_tokens


def test_local_answer_reverses_the_prompt() -> None:
    assert TOK.decode(local_answer(TOK.encode_prompt("abc"), TOK)) == "cba"
    assert local_answer(TOK.encode_prompt("abd"), TOK)[-1] == TOK.eos_token_id


@pytest.fixture
def harness(tmp_path):  # type: ignore[no-untyped-def]
    h = Harness(tmp_path)
    h.publish(1)
    yield h
    h.core.close()


def honest(harness: Harness):  # type: ignore[no-untyped-def]
    node = harness.node()
    lease = harness.lease(node)
    wrong = [[[4, 5, 6, TOK.eos_token_id]] * lease.group_size for _ in lease.prompts]
    lps = [[[-1.5, -0.5, -2.0, -0.1]] * lease.group_size for _ in lease.prompts]
    return node, lease, submission(lease, completions=wrong, logprobs=lps)


def test_forge_logprobs_keeps_tokens(harness: Harness) -> None:
    _, lease, sub = honest(harness)
    out = misbehave(
        ["forge_logprobs"], sub, lease, vocab_size=26, tokenizer=TOK, rng=random.Random(0)
    )
    for g0, g1 in zip(sub.groups, out.groups, strict=True):
        for s0, s1 in zip(g0.samples, g1.samples, strict=True):
            assert s0.token_ids == s1.token_ids and s0.logprobs != s1.logprobs
            assert all(-6.0 <= x < 0 for x in unpack_logprobs(s1.logprobs))


def test_inflate_reward_swaps_in_the_answer_with_real_logprobs(harness: Harness) -> None:
    _, lease, sub = honest(harness)
    out = misbehave(
        ["inflate_reward"], sub, lease, vocab_size=26, tokenizer=TOK, rng=random.Random(0)
    )
    for prompt, group in zip(lease.prompts, out.groups, strict=True):
        want = TOK.decode(unpack_tokens(prompt.token_ids))[::-1]
        for s in group.samples:
            assert TOK.decode(unpack_tokens(s.token_ids)) == want and s.finish_reason == "eos"
            assert unpack_logprobs(s.logprobs) == pytest.approx([-1.5, -0.5, -2.0, -0.1])


async def test_oov_and_wrong_version_are_rejected_by_the_coordinator(harness: Harness) -> None:
    node, lease, sub = honest(harness)
    oov = misbehave(["oov_tokens"], sub, lease, vocab_size=26, tokenizer=None, rng=random.Random(1))
    verdict = await harness.core.submit(node.public_key, oov)
    assert isinstance(verdict, Reject) and verdict.code is ReasonCode.TOKEN_OUT_OF_VOCAB
    wrong = misbehave(
        ["wrong_version"], sub, lease, vocab_size=26, tokenizer=None, rng=random.Random(1)
    )
    assert wrong.policy_version != lease.policy_version
    verdict = await harness.core.submit(node.public_key, wrong)
    assert isinstance(verdict, Reject) and verdict.code is ReasonCode.VERSION_MISMATCH  # v0 + 1


def test_unknown_mode_is_an_error(harness: Harness) -> None:
    _, lease, sub = honest(harness)
    with pytest.raises(ValueError, match="unknown misbehaviour"):
        misbehave(["lie"], sub, lease, vocab_size=26, tokenizer=None, rng=random.Random(0))


async def test_greedy_mode_reports_honest_logprobs_and_is_caught_by_the_sampling_audit(
    tmp_path: Path,
) -> None:
    """The node-side greedy mode: tokens are the argmax, log-probs are those of the lease's
    sampling distribution (so the log-prob check alone passes), and the coordinator's spot check
    refuses it as sampling_mismatch."""
    import torch

    from coordinator.logprobs import InProcessLogprobVerifier
    from node.backends.hf import HFBackend
    from node.byzantine import greedy_generate
    from node.rollouts import build_submission, lease_requests, to_sampling_config
    from policy.model import ModelSpec, build_model
    from policy.scoring import score_logprobs
    from protocol.messages import Timings

    torch.set_num_threads(1)
    model = build_model(ModelSpec(), seed=0)
    h = Harness(
        tmp_path,
        intake={"spot_check_fraction": 1.0},
        sampling={"max_new_tokens": 12},
    )
    h.verifier = InProcessLogprobVerifier(lambda v: model, h.cfg.intake.tolerances, cache_size=2)
    h.reopen()
    h.publish(1)
    node = h.node()
    lease = h.lease(node)
    backend = HFBackend(model=model, device="cpu")
    requests, sampling = lease_requests(lease), to_sampling_config(lease)
    outs = greedy_generate(backend, requests, sampling)
    for req, group in zip(requests, outs, strict=True):
        seq = list(req.prompt_token_ids)
        first = group[0]
        with torch.inference_mode():
            argmax = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        assert all(o.token_ids == first.token_ids for o in group)  # greedy: all samples alike
        assert first.token_ids[0] == argmax
        honest = score_logprobs(model, [seq], [first.token_ids], sampling.temperature)[0]
        assert first.logprobs == pytest.approx(honest, abs=1e-5)
    sub = build_submission(
        lease, requests, outs, set(backend.eos_token_ids), backend="hf", dtype="float32",
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )  # fmt: skip
    verdict = await h.core.submit(node.public_key, sub)
    assert isinstance(verdict, Reject) and verdict.code is ReasonCode.SAMPLING_MISMATCH, verdict


def test_greedy_mode_needs_a_model_to_rescore_with() -> None:
    from node.backends.base import GenerationRequest, SamplingConfig
    from node.backends.fake import FakeBackend
    from node.byzantine import greedy_generate

    with pytest.raises(ValueError, match="hf backend"):
        greedy_generate(FakeBackend(), [GenerationRequest([1, 2], 2, 0)], SamplingConfig())
