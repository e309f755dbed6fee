"""node.byzantine: each mode changes exactly what it claims to, and the coordinator catches it."""

from __future__ import annotations

import random

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
