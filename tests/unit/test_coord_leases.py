"""Lease state machine: sizing, expiry, reassignment, fencing, at-most-once, drain, restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from coord_harness import FakeClock, Harness, submission

from coordinator.config import LeaseSection
from coordinator.errors import Rejection
from coordinator.leases import LeaseManager, RequestBook, decide_request
from coordinator.store import LeaseRecord, NodeRecord, Store
from protocol.errors import ReasonCode
from protocol.messages import Ack, LeaseRequest, Reject, Standby

A, B = b"A" * 32, b"B" * 32


def manager(tmp_path: Path, clock: FakeClock, **cfg: float) -> LeaseManager:
    store = Store(tmp_path / "s.sqlite")
    for key in (A, B):
        store.upsert_node(NodeRecord(key, key.hex(), None, clock(), clock()))
    section = LeaseSection(min_deadline_s=30, deadline_slack=2, target_lease_s=10, **cfg)  # type: ignore[arg-type]
    return LeaseManager(store, section, clock=clock, group_size=4, max_new_tokens=10)


def test_size_and_deadline_follow_throughput(tmp_path: Path) -> None:
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    # 10 s · 400 tok/s / (4 · 10 tok) = 100 -> capped at max_prompts_per_lease (64), then by request
    assert lm.lease_size(400.0) == 64
    assert lm.lease_size(400.0, max_prompts=5) == 5
    assert lm.lease_size(20.0) == 5  # 10 · 20 / 40
    assert lm.lease_size(1.0) == 1  # never zero
    # 5 prompts · 4 · 10 = 200 tokens at 20 tok/s -> 2 · 10 s = 20 s < min 30 s
    assert lm.deadline_s(5, 20.0) == 30.0
    assert lm.deadline_s(5, 2.0) == pytest.approx(200.0)  # 2 · 200 / 2
    lease = lm.issue(A, version=1, tokens_per_s=2.0, max_prompts=5)
    assert lease.deadline == clock() + lm.deadline_s(len(lease.prompts), 2.0)


def test_prompts_are_deterministic_and_epochs_grow(tmp_path: Path) -> None:
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    l1 = lm.issue(A, version=1, tokens_per_s=20.0, max_prompts=3)
    l2 = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=2)
    assert l1.prompts == (0, 1, 2) and l2.prompts == (3, 4)
    assert l2.epoch > l1.epoch


def test_expiry_requeues_and_reassigns(tmp_path: Path) -> None:
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    l1 = lm.issue(A, version=1, tokens_per_s=20.0, max_prompts=3)
    clock.advance(29.0)
    assert lm.expire_due() == []
    clock.advance(2.0)
    assert [x.lease_id for x in lm.expire_due()] == [l1.lease_id]
    assert lm.store.get_lease(l1.lease_id).state == "expired"  # type: ignore[union-attr]
    l2 = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=5)
    assert l2.prompts == (0, 1, 2, 3, 4)  # re-queued first, then fresh from the cursor
    assert l2.epoch > l1.epoch
    assert lm.store.get_node(A).leases_expired == 1  # type: ignore[union-attr]


def test_expiry_reads_no_lease_until_a_deadline_can_have_passed(tmp_path: Path) -> None:
    """Every submission and lease request asks for the due leases: between deadlines that is
    no read at all, and a lease issued with an earlier deadline than any before is still
    expired on time."""
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    reads: list[float] = []
    due_leases = lm.store.due_leases

    def counted(now: float) -> list[LeaseRecord]:
        reads.append(now)
        return due_leases(now)

    lm.store.due_leases = counted  # type: ignore[method-assign]
    slow = lm.issue(A, version=1, tokens_per_s=1.0, max_prompts=3)  # 1 prompt: 2 · 40 / 1 = 80 s
    assert slow.deadline == clock() + 80.0
    reads.clear()
    clock.advance(5.0)
    assert lm.expire_due() == [] and reads == []
    fast = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=2)  # 30 s: earlier than slow's
    assert fast.deadline == clock() + 30.0 < slow.deadline
    assert lm.expire_due() == [] and reads == []
    clock.advance(31.0)
    assert [x.lease_id for x in lm.expire_due()] == [fast.lease_id]
    assert reads  # read once a deadline had passed
    clock.advance(100.0)
    assert [x.lease_id for x in lm.expire_due()] == [slow.lease_id]
    reads.clear()
    assert lm.expire_due() == [] and reads == [clock()]  # none active: one read, then none
    assert lm.expire_due() == [] and reads == [clock()]


def test_fencing_and_ownership(tmp_path: Path) -> None:
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    lease = lm.issue(A, version=1, tokens_per_s=20.0)
    assert lm.check_holder(A, lease.lease_id, lease.epoch) == lease
    with pytest.raises(Rejection) as e:
        lm.check_holder(A, lease.lease_id, lease.epoch - 1)
    assert e.value.code is ReasonCode.STALE_EPOCH
    with pytest.raises(Rejection) as e:
        lm.check_holder(B, lease.lease_id, lease.epoch)
    assert e.value.code is ReasonCode.WRONG_NODE and e.value.strike
    with pytest.raises(Rejection) as e:
        lm.check_holder(A, "L-nope", 1)
    assert e.value.code is ReasonCode.UNKNOWN_LEASE and not e.value.strike
    with pytest.raises(Rejection) as e:  # a zombie cannot release with an old epoch
        lm.release(A, lease.lease_id, lease.epoch + 1)
    assert e.value.code is ReasonCode.STALE_EPOCH


def test_drain_release_makes_prompts_reassignable_at_once(tmp_path: Path) -> None:
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    l1 = lm.issue(A, version=1, tokens_per_s=20.0, max_prompts=2)
    assert lm.release(A, l1.lease_id, l1.epoch) == [0, 1]
    l2 = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=2)
    assert l2.prompts == (0, 1)
    with pytest.raises(Rejection) as e:  # results of a released lease are refused
        lm.check_holder(A, l1.lease_id, l1.epoch)
    assert e.value.code is ReasonCode.LEASE_EXPIRED


async def test_late_result_of_a_reissued_lease_is_fenced_by_the_newer_epoch(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    a, b = h.node(), h.node()
    l1 = h.lease(a, max_prompts=2)
    h.clock.advance(31.0)
    l2 = h.lease(b, max_prompts=2)  # l1 expired: same prompts, higher epoch
    assert [p.prompt_id for p in l2.prompts] == [p.prompt_id for p in l1.prompts]
    assert l2.epoch > l1.epoch
    late = await h.core.submit(a.public_key, submission(l1))
    assert isinstance(late, Reject) and late.code is ReasonCode.STALE_EPOCH, late
    assert h.store.rollout_count() == 0
    assert h.core.reputation.strikes(a.public_key) == {}  # slow is not dishonest
    assert isinstance(await h.core.submit(b.public_key, submission(l2)), Ack)
    assert h.store.rollout_count() == 4
    again = await h.core.submit(a.public_key, submission(l1))  # same bytes: same verdict
    assert again == late and h.store.rollout_count() == 4


async def test_late_result_of_an_expired_lease_not_yet_reissued_is_counted_once(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    a, b = h.node(), h.node()
    l1 = h.lease(a, max_prompts=2)
    h.clock.advance(31.0)
    h.core.tick()  # expired, prompts re-queued, nobody holds them yet
    late = submission(l1)
    first = await h.core.submit(a.public_key, late)
    assert isinstance(first, Ack), first  # nobody completed or re-leased them: accepted once
    assert await h.core.submit(a.public_key, late) == first  # re-send: same verdict
    assert h.store.rollout_count() == 4
    l2 = h.lease(b, max_prompts=2)  # the done prompts are not handed out again
    assert {p.prompt_id for p in l2.prompts}.isdisjoint(p.prompt_id for p in l1.prompts)


async def test_late_result_after_recompletion_is_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    a, b = h.node(), h.node()
    l1 = h.lease(a, max_prompts=2)
    h.clock.advance(31.0)
    l2 = h.lease(b, max_prompts=2)
    assert isinstance(await h.core.submit(b.public_key, submission(l2)), Ack)
    late = await h.core.submit(a.public_key, submission(l1))
    assert isinstance(late, Reject) and late.code is ReasonCode.LEASE_EXPIRED
    assert h.store.rollout_count() == 4
    assert h.core.reputation.strikes(a.public_key) == {}  # slow is not dishonest


async def test_restart_resumes_outstanding_leases(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    a, b = h.node(), h.node()
    l1 = h.lease(a, max_prompts=2)
    h.store.close()  # SIGKILL-equivalent: nothing but the SQLite file survives
    h.reopen()
    assert [x.lease_id for x in h.core.leases.outstanding()] == [l1.lease_id]
    l2 = h.lease(b, max_prompts=2)
    assert {p.prompt_id for p in l2.prompts}.isdisjoint(p.prompt_id for p in l1.prompts)
    assert l2.epoch > l1.epoch  # the fencing counter survived the restart
    assert isinstance(await h.core.submit(a.public_key, submission(l1)), Ack)  # still honoured
    # a lease whose deadline passes while the coordinator is down is reassigned after restart
    l3 = h.lease(a, max_prompts=1)
    h.store.close()
    h.clock.advance(60.0)
    h.reopen()
    assert h.store.get_lease(l3.lease_id).state == "expired"  # type: ignore[union-attr]
    l4 = h.lease(b, max_prompts=3)  # l2 (never answered) expired too
    expect = sorted(p.prompt_id for p in [*l2.prompts, *l3.prompts])
    assert [p.prompt_id for p in l4.prompts] == expect


def test_leases_name_the_newest_version_the_coordinator_can_serve(tmp_path: Path) -> None:
    """A version published but not held (the trainer died while seeding it) is not leased: a
    node could not load it. Older servable versions within S are leased instead."""
    h = Harness(tmp_path)
    held: set[int] = set()
    h.core.servable = held.__contains__
    a = h.node()
    h.publish(1)
    h.publish(2)
    out = h.core.request_lease(
        a.public_key, LeaseRequest(peer_id="p", policy_version=None, max_prompts=1)
    )
    assert isinstance(out, Standby) and "no policy version" in out.reason
    held.add(1)
    assert h.lease(a).policy_version == 1
    held.add(2)
    assert h.lease(a).policy_version == 2
    for v in (3, 4, 5):
        h.publish(v)
    held.discard(2)  # only v1 is servable, but it is more than S = 2 behind v5: nothing to lease
    out = h.core.request_lease(
        a.public_key, LeaseRequest(peer_id="p", policy_version=None, max_prompts=1)
    )
    assert isinstance(out, Standby)


# --- the lease request's pure decision (no store: coordinator.leases.decide_request) -----------
def _lease(key: bytes, epoch: int, prompts: tuple[int, ...]) -> LeaseRecord:
    return LeaseRecord(f"L{epoch:08d}-x", key, epoch, 1, prompts, 4, 10, 0.0, 30.0, "active")


def _book(**kw: Any) -> RequestBook:
    base: dict[str, Any] = dict(
        due=(), held={}, own_audits=frozenset(), active=0, pending=(), cursor=10, epoch=5
    )
    return RequestBook(**{**base, **kw})


def test_request_takes_pending_then_requeued_then_fresh_prompts() -> None:
    """The lowest of the pending prompts and those the expiry re-queues come first, then fresh
    ones from the cursor; the epoch is the next one."""
    due = _lease(B, 3, (2, 4, 6))
    book = _book(due=(due,), held={due.lease_id: (4, 6)}, pending=(1, 7))
    out = decide_request(book, A, size=4, cap=None)
    assert out.expire == (due,) and out.prompts == (1, 4, 6, 7)
    assert (out.epoch, out.cursor) == (6, 10)  # no fresh prompt taken: the cursor stays
    more = decide_request(book, A, size=6, cap=None)
    assert more.prompts == (1, 4, 6, 7, 10, 11) and more.cursor == 12


def test_request_never_hands_a_node_an_audit_copy_of_its_own_work() -> None:
    due = _lease(B, 3, (-2, 5))
    book = _book(due=(due,), held={due.lease_id: (-2, 5)}, own_audits=frozenset({-2}))
    assert decide_request(book, A, size=2, cap=None).prompts == (5, 10)


def test_request_holds_each_problem_once() -> None:
    """An audit copy and its original (or two copies of one original) never share a lease: the
    node answers one group per prompt id. The lowest is taken, the others stay pending."""
    book = _book(pending=(-4, -3, 2, 3), originals={-4: 2, -3: 2})
    out = decide_request(book, A, size=4, cap=None)
    assert out.prompts == (-4, 3, 10, 11) and out.cursor == 12
    due = _lease(B, 3, (7,))  # an expiry re-queues an original whose copy is pending
    book = _book(due=(due,), held={due.lease_id: (7,)}, pending=(-1,), originals={-1: 7})
    assert decide_request(book, A, size=2, cap=None).prompts == (-1, 10)


def test_request_cap_counts_the_node_s_leases_after_the_expiry() -> None:
    """A node at its cap gets no lease (the expiry is decided all the same); its own leases
    expiring now do not count against it."""
    mine = _lease(A, 3, (0,))
    book = _book(due=(mine,), held={mine.lease_id: (0,)}, active=2)
    at_cap = decide_request(book, A, size=1, cap=1)
    assert at_cap.prompts is None and at_cap.holding == 1 and at_cap.expire == (mine,)
    assert (at_cap.epoch, at_cap.cursor) == (5, 10)  # nothing issued: counters unchanged
    room = decide_request(book, A, size=1, cap=2)
    assert room.prompts == (0,) and room.holding == 1
    assert decide_request(_book(active=2), A, size=1, cap=2).prompts is None


def test_request_records_the_expiry_even_at_the_cap(tmp_path: Path) -> None:
    """One transaction: a node at its cap is refused a lease, and another node's due lease is
    expired by that request all the same (its prompts re-queued)."""
    clock = FakeClock()
    lm = manager(tmp_path, clock)
    l1 = lm.issue(A, version=1, tokens_per_s=20.0, max_prompts=2)
    l2 = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=1)
    clock.advance(29.0)
    l3 = lm.issue(B, version=1, tokens_per_s=20.0, max_prompts=1)
    clock.advance(2.0)  # l1 and l2 due; B still holds l3
    assert lm.request(B, version=1, tokens_per_s=20.0, max_prompts=1, cap=1) == 1
    assert [x.state for x in map(lm.store.get_lease, (l1.lease_id, l2.lease_id))] == [  # type: ignore[union-attr]
        "expired", "expired",
    ]  # fmt: skip
    assert lm.store.get_lease(l3.lease_id).state == "active"  # type: ignore[union-attr]
    nxt = lm.request(A, version=1, tokens_per_s=20.0, max_prompts=3, cap=1)
    assert isinstance(nxt, LeaseRecord) and nxt.prompts == (*l1.prompts, *l2.prompts)
