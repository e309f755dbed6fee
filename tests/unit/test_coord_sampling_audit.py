"""The sampling audit of the spot check (DESIGN.md §7, check 7) and the rules that make cheating
on *how* samples were drawn visible: seeds assigned by the lease, whole leases, full checks of
suspects. A real tiny model samples with the ``hf`` backend; cheats report honest log-probs of the
lease's distribution, so the log-prob comparison alone would pass them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from coord_harness import Harness, sampled, submission

from coordinator.logprobs import InProcessLogprobVerifier, sampling_z
from policy.draw import sample_uniforms
from policy.model import ModelSpec, build_model
from policy.scoring import audit_samples
from protocol.errors import ReasonCode
from protocol.messages import Ack, Reject, RolloutSubmission, unpack_tokens


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


def harness(
    tmp_path: Path, model: Any, fraction: float = 1.0, intake: dict[str, Any] | None = None
) -> Harness:
    h = Harness(
        tmp_path,
        intake={"spot_check_fraction": fraction, **(intake or {})},
        sampling={"max_new_tokens": 12},
    )
    h.verifier = InProcessLogprobVerifier(
        lambda version: model, h.cfg.intake.tolerances, cache_size=2
    )
    h.reopen()
    h.publish(1)
    return h


async def verdict(h: Harness, node: Any, sub: RolloutSubmission) -> Ack | Reject:
    return await h.core.submit(node.public_key, sub)


async def test_honest_samples_pass_the_replay_and_the_statistic(tmp_path: Path, model: Any) -> None:
    h = harness(tmp_path, model)
    for _ in range(3):
        node = h.node()
        lease = h.lease(node)
        got = await verdict(h, node, sampled(lease, model))
        assert isinstance(got, Ack), got
    assert h.store.rollout_count() == 3 * 3 * 2


async def test_greedy_decoding_is_a_sampling_mismatch(tmp_path: Path, model: Any) -> None:
    h = harness(tmp_path, model)
    node = h.node()
    lease = h.lease(node)
    got = await verdict(h, node, sampled(lease, model, greedy=True))
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert h.store.rollout_count() == 0


async def test_greedy_decoding_is_caught_by_the_statistic_without_replay(
    tmp_path: Path, model: Any
) -> None:
    """The statistic alone refuses greedy decoding (tokens far likelier than sampling gives),
    before the seeded replay is consulted."""
    h = harness(tmp_path, model)
    node = h.node()
    lease = h.lease(node)
    got = await verdict(h, node, sampled(lease, model, greedy=True))
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert "z=" in got.detail
    node2 = h.node()
    honest = await verdict(h, node2, sampled(h.lease(node2), model))
    assert isinstance(honest, Ack), honest


async def test_redrawn_or_cherry_picked_samples_fail_the_replay(tmp_path: Path, model: Any) -> None:
    """Samples drawn from other seeds (e.g. the best G of many draws) name the lease's seeds and
    carry honest log-probs, yet are not the draws of those seeds."""
    h = harness(tmp_path, model)
    node = h.node()
    lease = h.lease(node)
    got = await verdict(h, node, sampled(lease, model, seed_offset=7))
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert "draws of the lease's seeds" in got.detail


async def test_a_sample_must_name_the_seed_the_lease_assigns(tmp_path: Path, model: Any) -> None:
    h = harness(tmp_path, model, fraction=0.0)  # refused before any spot check
    node = h.node()
    lease = h.lease(node)
    honest = sampled(lease, model)
    group = honest.groups[0]
    bad = msgspec.structs.replace(
        honest,
        groups=[
            msgspec.structs.replace(
                group,
                samples=[msgspec.structs.replace(group.samples[0], seed=12345), *group.samples[1:]],
            ),
            *honest.groups[1:],
        ],
    )
    got = await verdict(h, node, bad)
    assert isinstance(got, Reject) and got.code is ReasonCode.SAMPLING_MISMATCH, got
    assert isinstance(await verdict(h, node, honest), Ack)


async def test_a_submission_must_answer_the_whole_lease(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    node = h.node()
    lease = h.lease(node, max_prompts=3)
    got = await verdict(h, node, submission(lease, prompts=[0, 2]))  # drops the hard prompt
    assert isinstance(got, Reject) and got.code is ReasonCode.INCOMPLETE_GROUP, got
    assert "2 of the 3 prompts" in got.detail
    assert isinstance(await verdict(h, node, submission(lease)), Ack)


async def test_a_struck_node_is_checked_on_every_lease(tmp_path: Path, model: Any) -> None:
    """With spot checks off, forged log-probs pass — until the node has a strike on record;
    from then on every lease and every sample of it is re-scored."""
    h = harness(tmp_path, model, fraction=0.0)

    def forged(lease: Any) -> RolloutSubmission:
        honest = sampled(lease, model)
        return msgspec.structs.replace(
            honest,
            groups=[
                msgspec.structs.replace(
                    g,
                    samples=[
                        msgspec.structs.replace(s, logprobs=s.logprobs[:-4] + s.logprobs[:4])
                        if len(unpack_tokens(s.token_ids)) > 1
                        else s
                        for s in g.samples
                    ],
                )
                for g in honest.groups
            ],
        )

    clean, struck = h.node(), h.node()
    assert isinstance(await verdict(h, clean, sampled(h.lease(clean), model)), Ack)
    # one bad termination: a strike (cheap check, no model needed)
    lease = h.lease(struck)
    bad = await verdict(h, struck, submission(lease, finish="length"))
    assert isinstance(bad, Reject) and bad.code is ReasonCode.BAD_TERMINATION
    assert h.core.reputation.suspect(struck.public_key)
    assert not h.core.reputation.suspect(clean.public_key)
    caught = await verdict(h, struck, forged(h.lease(struck)))
    assert isinstance(caught, Reject) and caught.code is ReasonCode.LOGPROB_MISMATCH, caught
    before = h.store.rollout_count()
    unchecked = await verdict(h, clean, forged(h.lease(clean)))  # fraction 0: not re-scored
    assert isinstance(unchecked, Ack), unchecked
    assert h.store.rollout_count() > before


def test_the_statistic_separates_sampling_from_greedy(model: Any) -> None:
    """z of honest draws stays near 0; greedy decoding lands far above the limit."""
    prompts = [[1, 5, 9, 13, 2], [1, 7, 7, 3, 2]]
    honest_z, greedy_z = [], []
    for seed in range(8):
        u = [sample_uniforms(seed * 2 + i, 16) for i in range(2)]
        comps = []
        for p, ui in zip(prompts, u, strict=True):
            seq = list(p)
            out = []
            for t in range(16):
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
                probs = torch.softmax(logits.float(), -1)
                tok = int(torch.searchsorted(probs.cumsum(-1), ui[t] * probs.sum(), right=True))
                out.append(min(tok, probs.numel() - 1))
                seq.append(out[-1])
            comps.append(out)
        audits = audit_samples(model, prompts, comps, uniforms=u)
        assert all(a.replay_misses == 0 for a in audits)
        honest_z.append(sampling_z(audits))
        greedy = []
        for p in prompts:
            seq, out = list(p), []
            for _ in range(16):
                with torch.inference_mode():
                    tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                out.append(tok)
                seq.append(tok)
            greedy.append(out)
        greedy_z.append(sampling_z(audit_samples(model, prompts, greedy)))
    assert max(abs(z) for z in honest_z) < 4.0, honest_z
    assert min(greedy_z) > 6.0, greedy_z
