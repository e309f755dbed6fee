"""The ack does not wait for the re-score (issue 34, the timing side channel).

A lease drawn for the log-prob re-score (check 7) is acknowledged as an unchecked one: the same
answer, the same counters a node can read, with its rows held out of the trainer's feed until
the check passes (:mod:`coordinator.held`); a failed check then refuses, strikes and drops the
held rows. A real tiny model samples with the ``hf`` backend and the in-process verifier
re-scores, as in tests/unit/test_coord_sampling_audit.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from coord_harness import Harness, sampled

from coordinator.logprobs import InProcessLogprobVerifier
from coordinator.node_rpc import NodeHandlers
from coordinator.submissions import HeldCheck
from policy.model import ModelSpec, build_model
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.messages import Ack, Lease, Reject, RolloutSubmission


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(ModelSpec(), seed=0)


def harness(tmp_path: Path, model: Any, rate: float) -> Harness:
    h = Harness(
        tmp_path,
        intake={"spot_check_fraction": rate, "new_node_check_rate": rate},
        sampling={"max_new_tokens": 8},
        leases={"max_prompts_per_lease": 2, "max_active_per_node": 64},
    )
    h.verifier = InProcessLogprobVerifier(
        lambda version: model, h.cfg.intake.tolerances, cache_size=2
    )
    h.reopen()
    h.publish(1)
    return h


def drawn(h: Harness, node: Identity, lease: Lease) -> bool:
    """Whether the lease is drawn for the re-score (the coordinator's secret draw)."""
    return h.core.intake.spot_checked(lease.lease_id, h.core.trust.rate(node.public_key))


def leases_of_each(h: Harness, node: Identity) -> tuple[Lease, Lease]:
    """A lease the draw checks and one it does not (the draw is keyed: try until both came)."""
    checked = unchecked = None
    while checked is None or unchecked is None:
        lease = h.lease(node, 2)
        if drawn(h, node, lease):
            checked = checked or lease
        else:
            unchecked = unchecked or lease
    return checked, unchecked


def fetched(h: Harness) -> list[tuple[str, int, int]]:
    batch = h.core.fetch_rollouts(0, 1000)
    return [(r.lease_id, r.seq, r.sample_index) for r in batch.rollouts]


def tampered(sub: RolloutSubmission) -> RolloutSubmission:
    """Sample 0 of the first group with its log-probs shifted: the replay passes, the
    log-prob comparison does not (only the re-score can tell), by less than the ban multiple
    (a strike, not a ban)."""
    from protocol.messages import pack_logprobs, unpack_logprobs

    group = sub.groups[0]
    first = group.samples[0]
    shifted = [x - 0.005 for x in unpack_logprobs(first.logprobs)]  # 5x the fp32 limit
    samples = [msgspec.structs.replace(first, logprobs=pack_logprobs(shifted))]
    samples += list(group.samples[1:])
    groups = [msgspec.structs.replace(group, samples=samples), *sub.groups[1:]]
    return msgspec.structs.replace(sub, groups=groups)


def without_ref(answer: Ack | Reject) -> bytes:
    return encode(msgspec.structs.replace(answer, ref=""))


async def test_a_checked_lease_is_acked_as_an_unchecked_one(tmp_path: Path, model: Any) -> None:
    h = harness(tmp_path, model, 0.5)
    node = h.node()
    checked, unchecked = leases_of_each(h, node)
    key = node.public_key
    seen = []
    for lease in (checked, unchecked):
        before = (h.store.rollout_count(), h.store.get_node(key).leases_completed)  # type: ignore[union-attr]
        rate = h.core.trust.rate(key)
        answer, held = await h.core.desk.receive(key, sampled(lease, model))
        assert isinstance(answer, Ack), answer
        assert (held is not None) is (lease is checked)
        after = (h.store.rollout_count(), h.store.get_node(key).leases_completed)  # type: ignore[union-attr]
        # what the node can read: the answer, the accepted count, its completed leases, and the
        # rate its next lease is drawn at, move alike whether the lease is checked or not
        seen.append((without_ref(answer), after[0] - before[0], after[1] - before[1],
                     h.core.trust.rate(key) - rate))  # fmt: skip
    assert seen[0] == seen[1]
    assert seen[0][1] == 2 * h.cfg.group_size
    # only the unchecked lease is in the trainer's feed yet
    assert {lid for lid, _, _ in fetched(h)} == {unchecked.lease_id}


async def test_a_forged_checked_lease_is_acked_then_refused_and_struck(
    tmp_path: Path, model: Any
) -> None:
    h = harness(tmp_path, model, 1.0)
    node = h.node()
    lease = h.lease(node, 2)
    sub = tampered(sampled(lease, model))
    answer, held = await h.core.desk.receive(node.public_key, sub)
    assert isinstance(answer, Ack) and held is not None, answer
    assert fetched(h) == [] and h.store.live_strikes(node.public_key, 0.0) == []
    final = await h.core.desk.settle(held)
    assert isinstance(final, Reject) and final.code is ReasonCode.LOGPROB_MISMATCH, final
    assert len(h.store.live_strikes(node.public_key, 0.0)) == 1
    assert fetched(h) == [] and h.core.desk.records.held.count() == 0
    assert h.store.rollout_count() == 0  # the acknowledged count is withdrawn with the rows
    record = h.store.get_lease(lease.lease_id)
    assert record is not None
    states = h.store.prompt_states(record.prompts)
    assert [state for state, _ in states.values()] == ["pending"] * 2  # re-queued for others
    # the same bytes again get the refusal now, and nothing is counted twice
    again = await h.core.submit(node.public_key, sub)
    assert isinstance(again, Reject) and again.code is ReasonCode.LOGPROB_MISMATCH, again
    assert len(h.store.live_strikes(node.public_key, 0.0)) == 1
    # settling it again changes nothing
    assert without_ref(await h.core.desk.settle(held)) == without_ref(final)
    assert len(h.store.live_strikes(node.public_key, 0.0)) == 1


async def test_an_honest_checked_lease_reaches_the_feed_after_its_check(
    tmp_path: Path, model: Any
) -> None:
    h = harness(tmp_path, model, 0.5)
    node = h.node()
    key = node.public_key
    checked, unchecked = leases_of_each(h, node)
    _, held = await h.core.desk.receive(key, sampled(checked, model))
    assert held is not None
    _, none = await h.core.desk.receive(key, sampled(unchecked, model))
    assert none is None
    # the trainer consumes the unchecked lease first: its cursor passes it
    first = fetched(h)
    assert {lid for lid, _, _ in first} == {unchecked.lease_id}
    cursor = max(seq for _, seq, _ in first)
    clean = h.core.trust.state(key).clean_checks
    final = await h.core.desk.settle(held)
    assert isinstance(final, Ack), final
    later = h.core.fetch_rollouts(cursor, 1000).rollouts
    assert [r.lease_id for r in later] == [checked.lease_id] * (2 * h.cfg.group_size)
    assert h.core.trust.state(key).clean_checks == clean + 1
    assert len(fetched(h)) == 4 * h.cfg.group_size  # each row once
    assert h.core.desk.records.held.count() == 0


@pytest.mark.parametrize("forged", [False, True])
async def test_a_restart_between_ack_and_check_loses_nothing_and_counts_once(
    tmp_path: Path, model: Any, forged: bool
) -> None:
    h = harness(tmp_path, model, 1.0)
    node = h.node()
    lease = h.lease(node, 2)
    sub = sampled(lease, model)
    sub = tampered(sub) if forged else sub
    answer, held = await h.core.desk.receive(node.public_key, sub)
    assert isinstance(answer, Ack) and held is not None
    h.reopen()  # the coordinator dies after the ack, before the check
    assert fetched(h) == [] and h.store.rollout_count() == 2 * h.cfg.group_size
    assert await h.core.desk.settle_stored() == 1
    assert await h.core.desk.settle_stored() == 0  # settled once
    again = await h.core.submit(node.public_key, sub)  # the node re-sends after the restart
    strikes = len(h.store.live_strikes(node.public_key, 0.0))
    if forged:
        assert isinstance(again, Reject) and again.code is ReasonCode.LOGPROB_MISMATCH, again
        assert fetched(h) == [] and strikes == 1 and h.store.rollout_count() == 0
    else:
        assert isinstance(again, Ack), again
        rows = fetched(h)
        assert len(rows) == 2 * h.cfg.group_size == len(set(rows)) and strikes == 0
        assert h.store.rollout_count() == 2 * h.cfg.group_size


class VersionsHere:
    """Every version's weights are here (the harness's verifier holds its model)."""

    async def until_leasable(self, wait_s: float) -> None:
        return None

    async def wait_held(self, version: int, timeout: float) -> None:
        return None


async def test_the_node_rpc_answers_before_the_check_and_settles_after(
    tmp_path: Path, model: Any
) -> None:
    h = harness(tmp_path, model, 0.5)
    woken: list[int] = []
    rpc = NodeHandlers(h.core, versions=VersionsHere(), on_rollouts=lambda: woken.append(1))
    node = h.node()
    checked, unchecked = leases_of_each(h, node)

    async def submit(sub: RolloutSubmission) -> Ack | Reject:
        env = seal(node, sub, now=h.clock())
        raw = await rpc.on_submit("peer", encode(env))
        answer = decode(raw, Ack)
        return answer

    a = await submit(tampered(sampled(checked, model)))
    pending = set(rpc._checks)
    assert len(pending) == 1  # the checked lease's re-score runs after the answer
    assert h.store.live_strikes(node.public_key, 0.0) == []
    b = await submit(sampled(unchecked, model))
    assert without_ref(a) == without_ref(b)
    await asyncio.gather(*pending, *rpc._checks)
    assert len(h.store.live_strikes(node.public_key, 0.0)) == 1
    assert {lid for lid, _, _ in fetched(h)} == {unchecked.lease_id}
    assert rpc.resume_checks() == 0


async def test_settling_a_lease_that_is_not_held_answers_its_stored_verdict(
    tmp_path: Path, model: Any
) -> None:
    h = harness(tmp_path, model, 0.0)
    node = h.node()
    lease = h.lease(node, 2)
    answer, held = await h.core.desk.receive(node.public_key, sampled(lease, model))
    assert isinstance(answer, Ack) and held is None
    digest = h.store.query("SELECT digest FROM verdicts WHERE lease_id = ?", (lease.lease_id,))
    stored = await h.core.desk.settle(HeldCheck(lease.lease_id, bytes(digest[0][0])))
    assert without_ref(stored) == without_ref(answer)


async def test_answers_wait_while_the_pending_rescores_are_at_their_bound(
    tmp_path: Path, model: Any
) -> None:
    """Every lease drawn (a newcomer's rate 1.0): before, the node's wait for its ack held it to
    the verifier's pace; now the answer comes first, so the re-scores running after their
    answers are bounded. With the bound reached, the next answer (of any lease: it reveals only
    the load) waits until one ends, or at most check_room_wait_s."""
    h = harness(tmp_path, model, 1.0)
    rpc = NodeHandlers(h.core, versions=VersionsHere(), on_rollouts=lambda: None,
                       max_pending_checks=1, check_room_wait_s=30.0)  # fmt: skip
    node = h.node()
    first, second = h.lease(node, 1), h.lease(node, 1)
    gate = asyncio.Event()
    rescore = h.core.desk.intake.rescore

    async def held_up(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()  # the verifier is busy until the test opens the gate
        return await rescore(*args, **kwargs)

    h.core.desk.intake.rescore = held_up  # type: ignore[method-assign]

    async def submit(sub: RolloutSubmission) -> Ack | Reject:
        raw = await rpc.on_submit("peer", encode(seal(node, sub, now=h.clock())))
        return decode(raw, Ack)

    await submit(sampled(first, model))
    assert len(rpc._checks) == 1
    answer = asyncio.ensure_future(submit(sampled(second, model)))
    await asyncio.sleep(0.2)
    assert not answer.done()  # waits for room: one re-score running, the bound is 1
    gate.set()
    assert isinstance(await asyncio.wait_for(answer, 10.0), Ack)
    await asyncio.gather(*rpc._checks)
    assert {lid for lid, _, _ in fetched(h)} == {first.lease_id, second.lease_id}

    # the wait is bounded: with the verifier stuck, the answer comes after check_room_wait_s
    stuck = NodeHandlers(h.core, versions=VersionsHere(), on_rollouts=lambda: None,
                         max_pending_checks=1, check_room_wait_s=0.3)  # fmt: skip
    gate.clear()
    third, fourth = h.lease(node, 1), h.lease(node, 1)
    rpc = stuck
    await submit(sampled(third, model))
    t0 = asyncio.get_running_loop().time()
    assert isinstance(await asyncio.wait_for(submit(sampled(fourth, model)), 10.0), Ack)
    assert asyncio.get_running_loop().time() - t0 >= 0.3
    gate.set()
    await asyncio.gather(*stuck._checks)


async def test_a_rescore_that_raises_is_tried_again_and_then_left_held(
    tmp_path: Path, model: Any
) -> None:
    """The verifier failing (weights not loadable, an error in the scoring) is not the node's
    fault and must not strand its rows: before, one exception left them held until the
    coordinator's next start. Now the re-score is tried again after each retry delay; if every
    try fails, the rows stay held and the next start checks them."""
    h = harness(tmp_path, model, 1.0)
    node = h.node()
    rescore = h.core.desk.intake.rescore
    failures = [2]  # the next two tries raise

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("the verifier's weights could not be read")
        return await rescore(*args, **kwargs)

    h.core.desk.intake.rescore = flaky  # type: ignore[method-assign]
    woken: list[int] = []
    rpc = NodeHandlers(h.core, versions=VersionsHere(), on_rollouts=lambda: woken.append(1),
                       rescore_retry_s=(0.01, 0.01))  # fmt: skip

    async def submit(sub: RolloutSubmission) -> Ack | Reject:
        raw = await rpc.on_submit("peer", encode(seal(node, sub, now=h.clock())))
        return decode(raw, Ack)

    first = h.lease(node, 1)
    assert isinstance(await submit(sampled(first, model)), Ack)
    await asyncio.wait_for(asyncio.gather(*rpc._checks), 10.0)
    assert failures == [0] and woken  # two failures, the third try passed
    assert {lid for lid, _, _ in fetched(h)} == {first.lease_id}

    failures[0] = 3  # more failures than tries: the rows stay held for the next start
    second = h.lease(node, 1)
    assert isinstance(await submit(sampled(second, model)), Ack)
    await asyncio.wait_for(asyncio.gather(*rpc._checks), 10.0)
    assert {lid for lid, _, _ in fetched(h)} == {first.lease_id}
    assert [p.lease_id for p in h.core.desk.records.held.pending()] == [second.lease_id]
    failures[0] = 0
    assert rpc.resume_checks() == 1  # what the next start does
    await asyncio.wait_for(asyncio.gather(*rpc._checks), 10.0)
    assert {lid for lid, _, _ in fetched(h)} == {first.lease_id, second.lease_id}
