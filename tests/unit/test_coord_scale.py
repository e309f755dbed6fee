"""What a large swarm costs the coordinator per message (found with ``swarm simulate``):
liveness without a durable commit per heartbeat, no re-plan per joining node or per tick, standby
answers without a write transaction, the per-node lease count on an index."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from coord_harness import Harness, advert, config

from coordinator.core import Coordinator
from coordinator.store import Store
from coordinator.tasks import ReverseTask
from protocol.identity import fingerprint_of
from protocol.messages import Heartbeat, Lease, LeaseRequest, Standby

HB = Heartbeat(peer_id="p", seq=1, policy_version=None, active_leases=[], tokens_per_s=None)
REQ = LeaseRequest(peer_id="p", policy_version=1, max_prompts=3)


class CountingStore(Store):
    """Counts outermost transactions (each one a durable commit, an fsync on a real disk)."""

    commits = 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        outer = self._depth == 0
        with super().transaction():
            yield
        if outer:
            self.commits += 1


def counting_harness(tmp_path: Path, **overrides: object) -> Harness:
    h = Harness(tmp_path, **overrides)
    h.store.close()
    h.store = CountingStore(h.cfg.db_path)
    h.core = Coordinator(
        h.cfg, store=h.store, task=ReverseTask(), tokenizer=h.core.tokenizer, clock=h.clock,
        publisher_key=h.publisher.public_key,
    )  # fmt: skip
    return h


def test_heartbeats_commit_once_per_tick_and_count_as_alive(tmp_path: Path) -> None:
    h = counting_harness(tmp_path)
    nodes = [h.node() for _ in range(20)]
    h.clock.advance(100.0)  # all of them silent past the horizon
    assert h.core.alive_nodes() == []
    h.store.commits = 0
    for n in nodes:
        for _ in range(5):
            h.core.heartbeat(n.public_key, HB)
    assert h.store.commits == 0  # 100 heartbeats: no durable write each
    assert {n.node_key for n in h.core.alive_nodes()} == {n.public_key for n in nodes}
    assert h.store.commits == 1  # one flush for all of them
    h.core.heartbeat(nodes[0].public_key, HB)
    h.core.tick()
    seen = h.store.get_node(nodes[0].public_key)
    assert seen is not None and seen.last_seen == h.clock()


def test_liveness_survives_a_restart_up_to_the_last_tick(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    node = h.node()
    h.clock.advance(50.0)
    h.core.heartbeat(node.public_key, HB)
    h.core.close()  # closing flushes what the last tick did not
    h.reopen()
    seen = h.store.get_node(node.public_key)
    assert seen is not None and seen.last_seen == h.clock()


def test_joining_nodes_do_not_replan_the_swarm_each(tmp_path: Path) -> None:
    h = Harness(tmp_path, capacity={"activation": True})
    calls = 0
    replan = h.core.replan

    def counting() -> object:
        nonlocal calls
        calls += 1
        return replan()

    h.core.replan = counting  # type: ignore[method-assign]
    for _ in range(30):
        h.node()
    assert calls == 0  # unmeasured newcomers cannot change the plan
    returning = h.node()
    h.store.update_node(returning.public_key, rollouts_per_s=5.0)
    h.clock.advance(1000.0)
    h.core.register(returning.public_key, advert(returning, h.clock()))
    assert calls == 1  # a measured node coming back does


def test_tick_replans_at_most_every_interval(tmp_path: Path) -> None:
    h = Harness(tmp_path, capacity={"activation": True, "replan_interval_s": 5.0})
    first = h.core.plan
    h.core.tick()
    assert h.core.plan is first
    h.clock.advance(5.0)
    h.core.tick()
    assert h.core.plan is not first


def test_standby_answers_and_idle_expiry_open_no_write_transaction(tmp_path: Path) -> None:
    h = counting_harness(tmp_path, capacity={"activation": True, "batch_rollouts": 1})
    h.publish(1)
    free, paid = h.node(), h.node(price=2.0)
    h.store.update_node(free.public_key, rollouts_per_s=50.0)
    h.store.update_node(paid.public_key, rollouts_per_s=50.0)
    h.core.replan()
    h.store.commits = 0
    for _ in range(10):
        assert isinstance(h.core.request_lease(paid.public_key, REQ), Standby)
    h.core.leases.expire_due()
    assert h.store.commits == 0
    assert isinstance(h.core.request_lease(free.public_key, REQ), Lease)


def test_active_lease_count_uses_the_per_node_index(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    plan = store._all(
        "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM leases WHERE state = 'active' AND node_key = ?",
        (b"k",),
    )
    assert any("leases_by_node" in str(row) for row in plan), plan


def test_example_config_documents_the_replan_interval() -> None:
    text = (
        Path(__file__).resolve().parents[2] / "coordinator/coordinator.example.toml"
    ).read_text()
    assert "replan_interval_s = 5.0" in text
    assert config(Path("/nonexistent")).capacity.replan_interval_s == 5.0


def test_fingerprints_are_memoised() -> None:
    """The trainer feed names a fingerprint per rollout: a hash per rollout is wasted work."""
    key = bytes(range(32))
    first = fingerprint_of(key)
    hits = fingerprint_of.cache_info().hits
    assert fingerprint_of(key) is first
    assert fingerprint_of.cache_info().hits == hits + 1
    with pytest.raises(ValueError, match="32 bytes"):
        fingerprint_of(b"short")  # errors are not cached away
