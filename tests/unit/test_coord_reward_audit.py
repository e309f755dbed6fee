"""Reward audits (coordinator/audits.py): audit copies of prompts go to other nodes, rewards on the
same prompts are compared, and a node submitting the best of 4 draws is flagged while honest
nodes are not — with the detection power measured here and the false-positive rate bounded."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from coord_harness import TOK, Harness, sampled

from coordinator.audits import sign_test_p
from coordinator.config import RewardAuditSection
from coordinator.tasks import ReverseTask
from node.backends.base import SampleOut
from node.rollouts import build_submission, lease_requests, to_sampling_config
from policy.model import ModelSpec, build_model
from protocol.messages import Ack, Lease, RolloutSubmission, Timings

TASK = ReverseTask()


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


def audited(tmp_path: Path, fraction: float, **audit: Any) -> Harness:
    """A coordinator auditing ``fraction`` of the prompts, with a fixed secret (which prompts are
    audited is then the same in every run: the test is deterministic)."""
    h = Harness(
        tmp_path,
        group_size=4,
        reward_audit={"fraction": fraction, **audit},
        leases={"max_prompts_per_lease": 3},
        sampling={"max_new_tokens": 4},
    )
    h.store.set_meta("spot_check_secret", "ab" * 32)
    h.reopen()
    h.publish(1)
    return h


def best_of(lease: Lease, model: Any, n: int) -> RolloutSubmission:
    """Each sample is the best (by reward) of ``n`` draws: the first from the lease's seed, the
    others from other seeds; honest log-probs of the draws kept (caught by the seeded replay when
    spot-checked; this test turns spot checks off to measure the audit alone)."""
    from node.backends.hf import HFBackend

    backend = HFBackend(model=model, device="cpu")
    requests = lease_requests(lease)
    sampling = to_sampling_config(lease)
    draws = [
        backend.generate(
            [dataclasses.replace(r, seed=r.seed + 7919 * k) for r in requests], sampling
        )
        for k in range(n)
    ]
    outs: list[list[SampleOut]] = []
    for i, prompt in enumerate(lease.prompts):
        problem = TASK.problem(int(prompt.prompt_id.rsplit(":", 1)[1]))

        def reward(o: SampleOut, problem: Any = problem) -> float:
            return TASK.reward(problem, TOK.decode(o.token_ids), o.finish_reason == "stop")

        outs.append([max((d[i][j] for d in draws), key=reward) for j in range(lease.group_size)])
    return build_submission(
        lease, requests, outs, set(backend.eos_token_ids), backend="hf", dtype="float32",
        timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
    )  # fmt: skip


def test_the_sign_test_and_its_alpha_spending() -> None:
    assert sign_test_p(8, 8) == pytest.approx(1 / 256)
    assert sign_test_p(8, 0) == 1.0 and sign_test_p(4, 5) == 0.0
    assert sign_test_p(10, 9) == pytest.approx(11 / 1024)
    # Over a node's life the tests at n0, 2n0, 4n0, ... spend alpha/2, alpha/4, ...: simulated
    # honest nodes (d > 0 and d < 0 equally likely, ties dropped) are flagged at rate <= alpha.
    cfg = RewardAuditSection(alpha=0.01, min_pairs=8)
    rng = random.Random(0)
    flagged, nodes = 0, 20_000
    for _ in range(nodes):
        n_pos = n = 0
        for look in range(5):  # looks at 8, 16, 32, 64, 128 pairs
            target = cfg.min_pairs * 2**look
            while n < target:
                n_pos += rng.random() < 0.5
                n += 1
            if sign_test_p(n, n_pos) <= cfg.alpha / 2 ** (look + 1):
                flagged += 1
                break
    assert flagged / nodes <= cfg.alpha, flagged / nodes
    print(f"\nsimulated honest nodes flagged: {flagged}/{nodes} (alpha {cfg.alpha})")


async def test_audit_copies_go_to_other_nodes_and_pair_rewards(tmp_path: Path, model: Any) -> None:
    h = audited(tmp_path, fraction=1.0)  # every accepted prompt is audited
    a, b = h.node(), h.node()
    lease_a = h.lease(a)
    assert isinstance(await h.core.submit(a.public_key, sampled(lease_a, model)), Ack)
    # a's own prompts are never re-issued to a; b gets them first, as the same problems
    again = h.lease(a)
    assert not set(again.prompts[i].prompt_id for i in range(len(again.prompts))) & {
        p.prompt_id for p in lease_a.prompts
    }
    lease_b = h.lease(b)
    assert sorted((p.prompt_id, p.token_ids) for p in lease_b.prompts) == sorted(
        (p.prompt_id, p.token_ids) for p in lease_a.prompts
    )
    assert isinstance(await h.core.submit(b.public_key, sampled(lease_b, model)), Ack)
    assert len(h.core.audits.differences(a.public_key)) == len(lease_a.prompts)
    assert len(h.core.audits.differences(b.public_key)) == len(lease_a.prompts)
    # the audit groups are ordinary rollouts for the trainer: their own group ids
    groups = {(r.lease_id, r.prompt_id) for r in h.core.fetch_rollouts(0, 100).rollouts}
    assert {(lease_b.lease_id, p.prompt_id) for p in lease_b.prompts} <= groups


async def test_a_withdrawn_original_and_its_audit_copy_never_share_a_lease(
    tmp_path: Path, model: Any
) -> None:
    """A banned node's unconsumed rows are withdrawn and their prompts re-queued while their
    audit copies are pending: a lease with both would name one prompt id twice, and the node's
    honest answer was refused ``sampling_mismatch`` (the seeds of the second slot's position;
    test_byzantine_swarm, CI 2026-12-03). The copy goes first, the original to a later lease."""
    from coordinator.submission_records import withdraw_unconsumed

    h = audited(tmp_path, fraction=1.0)
    a, b = h.node(), h.node()
    first = h.lease(a, max_prompts=1)
    assert isinstance(await h.core.submit(a.public_key, sampled(first, model)), Ack)
    with h.store.transaction():  # what a ban of ``a`` does to its rows
        assert withdraw_unconsumed(h.store, h.core.receipts, a.public_key, h.clock()) == 4
    lease = h.lease(b, max_prompts=2)  # pending: the copy and its original
    ids = [p.prompt_id for p in lease.prompts]
    assert len(ids) == 2 and len(set(ids)) == 2 and first.prompts[0].prompt_id in ids
    assert isinstance(await h.core.submit(b.public_key, sampled(lease, model)), Ack)
    later = h.lease(b, max_prompts=2)  # the original, now that its copy is done
    assert first.prompts[0].prompt_id in [p.prompt_id for p in later.prompts]
    assert isinstance(await h.core.submit(b.public_key, sampled(later, model)), Ack)


async def test_best_of_4_is_flagged_and_honest_nodes_are_not(tmp_path: Path, model: Any) -> None:
    """Detection power: 4 honest nodes and one submitting the best of 4 draws per sample, spot
    checks off, a quarter of the prompts audited, the default test schedule (alpha = 1e-3 over a
    node's life, first test at 16 compared pairs). The cheat is flagged (then checked in full)
    within the rounds below; no honest node is."""
    h = audited(tmp_path, fraction=0.25)
    honest = [h.node() for _ in range(4)]
    cheat = h.node()
    flagged_after: int | None = None
    cheat_leases = 0
    # The tests look at 16, 32 and 64 compared pairs (about one per cheat lease here). A cheat
    # winning ~86% of its pairs passes the first two looks ~19% of the time and not the third
    # (P ~ 0.002): 60 rounds could end at 63 pairs, one short of it (seen once); 90 reach it.
    for _round in range(90):
        for node in honest:
            lease = h.lease(node)
            assert isinstance(await h.core.submit(node.public_key, sampled(lease, model)), Ack)
        lease = h.lease(cheat)
        cheat_leases += 1
        got = await h.core.submit(cheat.public_key, best_of(lease, model, 4))
        assert isinstance(got, Ack), got  # nothing else catches it: spot checks are off
        if h.core.trust.state(cheat.public_key).flagged_at is not None:
            flagged_after = cheat_leases
            break
    pairs = len([d for d in h.core.audits.differences(cheat.public_key) if d != 0])
    higher = sum(1 for d in h.core.audits.differences(cheat.public_key) if d > 0)
    print(
        f"\nbest-of-4 flagged after {flagged_after} of its leases ({cheat_leases} x 3 prompts, "
        f"{pairs} compared pairs, {higher} with the higher reward; audit fraction 0.25)"
    )
    assert flagged_after is not None, "the best-of-4 node was never flagged"
    assert h.core.trust.is_suspect(cheat.public_key)  # now re-scored in full
    assert all(h.core.trust.state(n.public_key).flagged_at is None for n in honest)
    flags = [e.data() for e in h.core.receipts.entries() if e.kind == "flag"]
    assert [f["node"] for f in flags] == [cheat.fingerprint]
