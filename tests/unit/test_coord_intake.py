"""Intake pipeline through the coordinator core: each rejection reason, exactly-once storage,
recomputed rewards, and the log-prob spot check with a real tiny model."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from coord_harness import TOK, Harness, answer, sampled, submission

from coordinator.errors import Rejection
from coordinator.logprobs import InProcessLogprobVerifier, deviation
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    Ack,
    LeaseRequest,
    Reject,
    RolloutSubmission,
    Standby,
    pack_logprobs,
    unpack_tokens,
)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    harness = Harness(tmp_path)
    harness.publish(1)
    return harness


async def rejected(h: Harness, who: Identity, sub: RolloutSubmission) -> ReasonCode:
    verdict = await h.core.submit(who.public_key, sub)
    assert isinstance(verdict, Reject), verdict
    return verdict.code


def test_bad_signature_and_unknown_node(h: Harness) -> None:
    node = h.node()
    lease = h.lease(node)
    env = seal(node, submission(lease), now=h.clock())
    signer, msg = h.core.open(env, RolloutSubmission)
    assert signer == node.public_key and msg.lease_id == lease.lease_id
    forged = msgspec.structs.replace(env, nonce=bytes(16), signature=bytes(64))
    with pytest.raises(ProtocolError) as e:
        h.core.open(forged, RolloutSubmission)
    assert e.value.code is ReasonCode.BAD_SIGNATURE
    tampered = msgspec.structs.replace(env, signer=Identity.generate().public_key)
    with pytest.raises(ProtocolError) as e:
        h.core.open(tampered, RolloutSubmission)
    assert e.value.code is ReasonCode.BAD_SIGNATURE
    stranger = Identity.generate()
    with pytest.raises(Rejection) as e2:
        h.core.open(seal(stranger, submission(lease), now=h.clock()), RolloutSubmission)
    assert e2.value.code is ReasonCode.UNKNOWN_NODE


async def test_unknown_lease_and_wrong_node(h: Harness) -> None:
    a, b = h.node(), h.node()
    lease = h.lease(a)
    bogus = msgspec.structs.replace(submission(lease), lease_id="L99999999-000000000000")
    assert await rejected(h, a, bogus) is ReasonCode.UNKNOWN_LEASE
    assert await rejected(h, b, submission(lease)) is ReasonCode.WRONG_NODE
    assert h.core.reputation.strikes(b.public_key) == {"wrong_node": 1}
    stale = msgspec.structs.replace(submission(lease), epoch=lease.epoch + 7)
    assert await rejected(h, a, stale) is ReasonCode.STALE_EPOCH
    assert h.core.reputation.strikes(a.public_key) == {}


async def test_versions_other_than_the_lease_and_stale_beyond_s(h: Harness) -> None:
    for v in (2, 3, 4):
        h.publish(v)
    node = h.node()
    lease = h.lease(node)
    assert lease.policy_version == 4
    # any version but the lease's (older, newer, unpublished) is a claim no honest node makes
    for claimed in (1, 3, 9):
        got = await rejected(h, node, submission(lease, version=claimed))
        assert got is ReasonCode.VERSION_MISMATCH, claimed
    assert h.core.reputation.strikes(node.public_key) == {"version_mismatch": 3}
    assert isinstance(await h.core.submit(node.public_key, submission(lease, version=4)), Ack)
    # the honest case of staleness: the learner moved on while the node was generating
    lease2 = h.lease(node)
    for v in (5, 6, 7):
        h.publish(v)
    late = submission(lease2, version=lease2.policy_version)
    assert await rejected(h, node, late) is ReasonCode.TOO_STALE


async def test_a_lease_refused_too_stale_is_closed_at_once(h: Harness) -> None:
    """Its version only ages, so no result of it can ever be accepted: the coordinator frees it
    at once (prompts reassignable, one active lease fewer for the node) instead of holding it
    to its deadline — a node at its cap of active leases would otherwise be put on standby
    (measured in the demo at S = 1: first leases on a version up to 4 s late)."""
    cap = h.core.config.leases.max_active_per_node
    node = h.node()
    leases = [h.lease(node, max_prompts=1) for _ in range(cap)]
    assert isinstance(h.core.request_lease(node.public_key, LeaseRequest(
        peer_id="peer", policy_version=1, max_prompts=1)), Standby)  # fmt: skip
    for v in (2, 3, 4):
        h.publish(v)
    late = submission(leases[0], version=leases[0].policy_version)
    assert await rejected(h, node, late) is ReasonCode.TOO_STALE
    assert h.core.store.get_lease(leases[0].lease_id).state == "expired"
    assert h.core.store.node_count() and h.core.reputation.strikes(node.public_key) == {}
    again = h.lease(node, max_prompts=1)  # below the cap again, and gets the freed prompt
    assert again.policy_version == 4 and again.prompts == leases[0].prompts
    # the same bytes sent again still get their verdict; the node's record is not charged
    assert await rejected(h, node, late) is ReasonCode.TOO_STALE
    record = h.core.store.get_node(node.public_key)
    assert record is not None and record.leases_expired == 0


async def test_token_and_length_checks(h: Harness) -> None:
    node = h.node()
    lease = h.lease(node, max_prompts=1)

    def one(tokens: list[int]) -> list[list[list[int]]]:
        return [[tokens, answer(lease, 0)]]

    oov = submission(lease, completions=one([5, 99, TOK.eos_token_id]))
    assert await rejected(h, node, oov) is ReasonCode.TOKEN_OUT_OF_VOCAB
    long = submission(lease, completions=one([5, 6, 7, 8, TOK.eos_token_id]))  # 5 > 4
    assert await rejected(h, node, long) is ReasonCode.LENGTH_EXCEEDED
    short = submission(lease, samples=1)
    assert await rejected(h, node, short) is ReasonCode.INCOMPLETE_GROUP


async def test_termination_must_be_legitimate(h: Harness) -> None:
    node = h.node()
    lease = h.lease(node, max_prompts=1)
    eos = TOK.eos_token_id
    after_eos = submission(lease, completions=[[[5, eos, 6], answer(lease, 0)]])
    assert await rejected(h, node, after_eos) is ReasonCode.BAD_TERMINATION
    no_eos = submission(lease, completions=[[[5, 6], [5, 6]]], finish="eos")
    assert await rejected(h, node, no_eos) is ReasonCode.BAD_TERMINATION
    early_length = submission(lease, completions=[[[5, 6], [5, 6]]], finish="length")
    assert await rejected(h, node, early_length) is ReasonCode.BAD_TERMINATION
    full = submission(lease, completions=[[[5, 6, 7, 8], [5, 6, 7, 8]]], finish="length")
    assert isinstance(await h.core.submit(node.public_key, full), Ack)
    rows = h.core.fetch_rollouts(0, 10).rollouts
    assert [r.finish_reason for r in rows] == ["length", "length"]


async def test_reward_is_recomputed_and_cannot_be_claimed(h: Harness) -> None:
    node = h.node()
    lease = h.lease(node, max_prompts=1)
    wrong = [TOK.encode("a")[0], TOK.eos_token_id]
    sub = submission(lease, completions=[[answer(lease, 0), wrong]])
    # A node cannot even claim a reward: the field does not exist on the wire.
    raw = msgspec.msgpack.decode(encode(sub))
    raw["groups"][0]["samples"][1]["reward"] = 1.0
    with pytest.raises(ProtocolError) as e:
        decode(msgspec.msgpack.encode(raw), RolloutSubmission)
    assert e.value.code is ReasonCode.UNKNOWN_FIELD
    assert isinstance(await h.core.submit(node.public_key, sub), Ack)
    rows = h.core.fetch_rollouts(0, 10).rollouts
    problem = h.core.task.problem(0)
    assert [r.reward for r in rows] == [1.0, h.core.task.reward(problem, "a", True)]
    assert rows[1].reward < 1.0


async def test_duplicate_submission_stored_once_with_same_verdict(h: Harness) -> None:
    node = h.node()
    lease = h.lease(node)
    sub = submission(lease)
    first = await h.core.submit(node.public_key, sub)
    assert isinstance(first, Ack)
    assert await h.core.submit(node.public_key, sub) == first
    assert h.store.rollout_count() == 2 * len(lease.prompts)
    batch = h.core.fetch_rollouts(0, 100)
    seqs = [r.seq for r in batch.rollouts]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and batch.last_seq == seqs[-1]
    assert h.core.fetch_rollouts(batch.last_seq, 100).rollouts == []
    # a different payload for the completed lease is a duplicate, not stored
    other = submission(lease, completions=[[[5, 2], [5, 2]]] * len(lease.prompts))
    assert await rejected(h, node, other) is ReasonCode.DUPLICATE
    assert h.store.rollout_count() == 2 * len(lease.prompts)
    # a rejected payload re-sent gets the same verdict and no second strike
    lease2 = h.lease(node, max_prompts=1)
    bad = submission(lease2, completions=[[[99, 2], [99, 2]]])
    v1 = await h.core.submit(node.public_key, bad)
    v2 = await h.core.submit(node.public_key, bad)
    assert isinstance(v1, Reject) and v1 == v2
    assert h.core.reputation.strikes(node.public_key) == {"token_out_of_vocab": 1}


async def test_strikes_lead_to_ban(tmp_path: Path) -> None:
    h = Harness(tmp_path, reputation={"strikes_to_ban": 3, "ban_base_s": 60.0})
    h.publish(1)
    node = h.node()
    for _ in range(3):
        lease = h.lease(node, max_prompts=1)
        assert await rejected(h, node, submission(lease, samples=1)) is ReasonCode.INCOMPLETE_GROUP
    with pytest.raises(Rejection) as e:
        h.lease(node)
    assert e.value.code is ReasonCode.BANNED
    assert e.value.retry_after_s == pytest.approx(60.0)  # the node is told when to come back
    h.clock.advance(61.0)
    assert h.lease(node).lease_id


async def test_fabricated_logprobs_caught_by_spot_check(tmp_path: Path) -> None:
    import torch

    from policy.model import ModelSpec, build_model

    torch.set_num_threads(1)
    model = build_model(ModelSpec(), seed=0)
    loaded: list[int] = []

    def loader(version: int) -> object:
        loaded.append(version)
        return model

    h = Harness(tmp_path, intake={"spot_check_fraction": 1.0})
    verifier = InProcessLogprobVerifier(loader, h.cfg.intake.tolerances, cache_size=3)
    h.verifier = verifier
    h.reopen()
    h.publish(1)
    node = h.node()
    lease = h.lease(node, max_prompts=2)
    honest = sampled(lease, model)
    fake = msgspec.structs.replace(
        honest,
        groups=[
            msgspec.structs.replace(
                g,
                samples=[
                    msgspec.structs.replace(
                        s, logprobs=pack_logprobs([-0.01] * len(unpack_tokens(s.token_ids)))
                    )
                    for s in g.samples
                ],
            )
            for g in honest.groups
        ],
    )
    verdict = await h.core.submit(node.public_key, fake)
    assert isinstance(verdict, Reject) and verdict.code is ReasonCode.LOGPROB_MISMATCH
    assert h.store.rollout_count() == 0
    # 3.6 nats off, thousands of times the limit: banned at once (issue 34)
    assert h.core.reputation.banned(node.public_key, h.clock()) is not None
    other = h.node()
    ok = await h.core.submit(other.public_key, sampled(h.lease(other, max_prompts=2), model))
    assert isinstance(ok, Ack), ok
    assert loaded == [1]  # the model for version 1 was loaded once and cached
    assert verifier.cached_versions() == [1]


def test_deviation_metrics() -> None:
    assert deviation("max_abs", [[-1.0, -2.0]], [[-1.0005, -2.0]]) == pytest.approx(5e-4)
    # GRAIL statistic: median exp(|Δ|) − 1
    rel = deviation("median_rel", [[-1.0, -1.0, -1.0]], [[-1.0, -1.05, -1.2]])
    assert rel == pytest.approx(2.718281828**0.05 - 1)
    assert deviation("max_abs", [[-1.0]], [[float("-inf")]]) == float("inf")
    # against an admissible interval [lo, hi]: 0 inside, the distance outside
    assert deviation("max_abs", [[-1.0, -3.0]], [[-1.2, -2.0]], [[-0.9, -1.5]]) == 1.0


def test_decode_errors_cost_no_strike_even_when_signed(h: Harness) -> None:
    """docs/operations.md §6.2: decode codes (unknown_field, schema, too_long, not_finite, ...)
    cost no strike, even when the signature verifies: three lease requests with one unknown
    field (a client one protocol revision ahead) leave the key unbanned and unstruck. A forged
    envelope (bad signature) strikes nobody either."""
    import os

    from protocol.envelope import signed_bytes
    from protocol.messages import LeaseRequest

    h2 = Harness(h.tmp_path / "three", reputation={"strikes_to_ban": 3})
    h2.publish(1)
    node = h2.node()

    def signed(payload: bytes) -> object:
        nonce, ts = os.urandom(16), h2.clock()
        sig = node.sign(signed_bytes(node.public_key, nonce, ts, payload))
        env = seal(node, LeaseRequest(peer_id="peer", policy_version=1, max_prompts=1), now=ts)
        return msgspec.structs.replace(env, nonce=nonce, ts=ts, payload=payload, signature=sig)

    ahead = msgspec.msgpack.decode(
        encode(LeaseRequest(peer_id="peer", policy_version=1, max_prompts=1))
    )
    ahead["priority"] = 1  # a field of a later protocol revision
    for _ in range(3):
        with pytest.raises(ProtocolError) as e:
            h2.core.open(signed(msgspec.msgpack.encode(ahead)), LeaseRequest)
        assert e.value.code is ReasonCode.UNKNOWN_FIELD
    not_finite = msgspec.msgpack.decode(encode(submission(h2.lease(node))))
    not_finite["timings"]["generate_s"] = float("nan")
    with pytest.raises(ProtocolError) as e:
        h2.core.open(signed(msgspec.msgpack.encode(not_finite)), RolloutSubmission)
    assert e.value.code is ReasonCode.NOT_FINITE
    assert h2.core.reputation.strikes(node.public_key) == {}
    assert h2.core.reputation.banned(node.public_key, h2.clock()) is None
    assert h2.lease(node).lease_id  # still served
    forged = msgspec.structs.replace(signed(msgspec.msgpack.encode(ahead)), nonce=os.urandom(16))
    with pytest.raises(ProtocolError) as e:
        h2.core.open(forged, LeaseRequest)
    assert e.value.code is ReasonCode.BAD_SIGNATURE
    assert h2.core.reputation.strikes(node.public_key) == {}


async def test_verification_failures_still_strike_and_ban(tmp_path: Path) -> None:
    """The other half of the policy: a verification failure (here out-of-vocabulary tokens) is a
    strike, and three ban the key (docs/operations.md §6.2, codes marked strike)."""
    h = Harness(tmp_path, reputation={"strikes_to_ban": 3})
    h.publish(1)
    node = h.node()
    for _ in range(3):
        lease = h.lease(node, max_prompts=1)
        oov = submission(lease, completions=[[[TOK.vocab_size], [TOK.vocab_size]]])
        assert await rejected(h, node, oov) is ReasonCode.TOKEN_OUT_OF_VOCAB
    assert h.core.reputation.strikes(node.public_key) == {"token_out_of_vocab": 3}
    assert h.core.reputation.banned(node.public_key, h.clock()) is not None
