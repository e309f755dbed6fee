"""node.presence built piece by piece (no NodeWorker, no work loop), against the real coordinator
core of test_node_worker on the in-memory transport; the heartbeat pace is an injected sleep, so
each beat is stepped by the test."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from node_parts import NodeParts
from test_node_worker import MemCoordinator, until

from node.failures import FailureTracker
from node.presence import (
    Prefetcher,
    Presence,
    node_state,
    status_line,
)
from node.status import NodeStats
from protocol.codec import encode
from protocol.messages import Heartbeat, Lease, LeaseRequest
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork


class RecordingCoordinator(MemCoordinator):
    """The coordinator core, keeping the heartbeats it answered (decoded, as the core saw them)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.heartbeats: list[Heartbeat] = []

    async def _heartbeat(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, Heartbeat)
        ack = self.core.heartbeat(key, msg)  # an unknown node: Rejection, and nothing kept
        self.heartbeats.append(msg)
        return encode(ack)


class Steps:
    """An injected sleep: each ``sleep(s)`` records ``s`` and waits until the test calls
    :meth:`step` (``sleep`` calls of ``hold_s`` or more wait forever: the status line's)."""

    def __init__(self, hold_s: float = 1000.0) -> None:
        self.asked: list[float] = []
        self.hold_s = hold_s
        self._go: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        if seconds >= self.hold_s:
            await asyncio.Event().wait()
        self.asked.append(seconds)
        await self._go.get()

    def step(self) -> None:
        self._go.put_nowait(None)


class Parts(NodeParts):
    """The pieces NodeWorker.start() wires, built here one by one."""

    def __init__(
        self, tmp: Path, coord: RecordingCoordinator, net: InMemoryNetwork, **kw: Any
    ) -> None:
        super().__init__(tmp, coord, net, status_interval_s=3600.0, **kw)
        self.coord: RecordingCoordinator = coord
        self.failures = FailureTracker(3, 0.01, 0.1, random.Random(0))
        self.lease: Lease | None = None
        self.steps = Steps()
        self.presence: Presence | None = None

    async def start(self, dirs: MemoryHolderDirectory) -> Presence:
        checkpoints = await self.checkpoints(dirs)
        self.prefetcher = Prefetcher(checkpoints, self.backend, self.stopping)
        self.presence = Presence(
            self.client,
            self.registrar,
            self.advert,
            self.prefetcher,
            backend=self.backend,
            stats=self.stats,
            failures=self.failures,
            lease_in_hand=lambda: self.lease,
            stopping=self.stopping,
            status_interval_s=self.config.status_interval_s,
            sleep=self.steps.sleep,
        )
        await self.presence.start()
        return self.presence

    async def close(self) -> None:
        if self.presence is not None:
            await self.presence.stop(5.0)
        await self.prefetcher.stop(5.0)
        await self.stop_broadcast()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[RecordingCoordinator, Parts]]:
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    coord = RecordingCoordinator(net, dirs, tmp_path)
    await coord.start()
    (tmp_path / "node").mkdir()
    parts = Parts(tmp_path, coord, net)
    await parts.start(dirs)
    yield coord, parts
    await parts.close()
    assert coord.broadcast is not None
    await coord.broadcast.stop()
    coord.core.close()


async def beats(coord: RecordingCoordinator, parts: Parts, n: int) -> None:
    """Let ``n`` more heartbeats go and wait until the coordinator answered them."""
    want = len(coord.heartbeats)
    for _ in range(n):
        want += 1
        parts.steps.step()
        await until(lambda: len(coord.heartbeats) >= want, "a heartbeat answered")  # noqa: B023


async def test_heartbeats_are_paced_numbered_and_carry_the_lease_in_hand(
    world: tuple[RecordingCoordinator, Parts],
) -> None:
    coord, parts = world
    await parts.registrar.register()
    assert parts.presence is not None
    await beats(coord, parts, 2)
    assert [hb.seq for hb in coord.heartbeats] == [1, 2]
    assert all(hb.active_leases == [] and hb.policy_version is None for hb in coord.heartbeats)
    assert parts.steps.asked[:2] == [0.2, 0.2]  # the configured heartbeat_interval_s
    await coord.publish(1)
    lease = coord.core.request_lease(
        parts.identity.public_key,
        LeaseRequest(peer_id=parts.transport.peer_id, policy_version=None, max_prompts=1),
    )
    assert isinstance(lease, Lease)
    parts.lease = lease
    await beats(coord, parts, 1)
    assert coord.heartbeats[-1].active_leases == [lease.lease_id]
    assert coord.heartbeats[-1].peer_id == parts.transport.peer_id
    assert parts.presence.heartbeats_sent == 3 and parts.presence.active


async def test_a_heartbeat_the_coordinator_does_not_know_registers_again(
    world: tuple[RecordingCoordinator, Parts],
) -> None:
    coord, parts = world
    assert parts.presence is not None
    parts.steps.step()  # never registered: the core answers unknown_node, and nothing is kept
    await until(lambda: len(parts.steps.asked) >= 2, "the first beat to end")
    assert coord.heartbeats == []
    assert parts.stats.coordinator_errors == 0  # a refusal, not a network failure
    await beats(coord, parts, 1)  # registered again by the refused beat: this one is answered
    assert [hb.seq for hb in coord.heartbeats] == [2]


@contextlib.asynccontextmanager
async def configured_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> AsyncIterator[tuple[RecordingCoordinator, Parts, MemoryHolderDirectory, InMemoryNetwork]]:
    """A coordinator with these config ``overrides`` and a node that takes its interval from
    the coordinator (none configured); the node's pieces are not started."""
    import test_node_worker
    from coord_harness import config

    monkeypatch.setattr(test_node_worker, "config", lambda tmp: config(tmp, **overrides))
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    coord = RecordingCoordinator(net, dirs, tmp_path)
    await coord.start()
    (tmp_path / "node").mkdir()
    parts = Parts(tmp_path, coord, net, heartbeat_interval_s=None)
    try:
        yield coord, parts, dirs, net
    finally:
        await parts.close()
        assert coord.broadcast is not None
        await coord.broadcast.stop()
        coord.core.close()


async def test_the_interval_learned_at_registration_paces_the_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # not the node's fallback of 10 s: the node must take the coordinator's word
    async with configured_world(tmp_path, monkeypatch, heartbeat_interval_s=2.5) as world:
        coord, parts, dirs, _net = world
        await parts.registrar.register()
        assert parts.registrar.heartbeat_interval_s == coord.cfg.heartbeat_interval_s == 2.5
        await parts.start(dirs)
        await until(lambda: bool(parts.steps.asked), "the heartbeat task to wait")
        assert parts.steps.asked == [2.5]


async def test_the_interval_named_by_a_heartbeat_answer_paces_the_next_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator asks a growing swarm for fewer heartbeats (issue 35): at 0.1 heartbeats/s
    at most, one node alive beats every 10 s, not 2.5 (2.5 · 2^2); the node follows the
    answer's interval from its next beat on. A node that configured its interval keeps it."""
    async with configured_world(
        tmp_path, monkeypatch, heartbeat_interval_s=2.5, heartbeat_rate_max=0.1
    ) as world:
        coord, parts, dirs, net = world
        await parts.registrar.register()  # nobody was alive at the last count: the base
        assert parts.registrar.heartbeat_interval_s == 2.5
        await parts.start(dirs)
        await until(lambda: bool(parts.steps.asked), "the heartbeat task to wait")
        coord.core.tick()  # counts the one node alive: 1 / 0.1 = 10 s
        await beats(coord, parts, 1)
        await until(lambda: len(parts.steps.asked) >= 2, "the next wait")
        assert parts.steps.asked == [2.5, 10.0]
        configured = Parts(tmp_path, coord, net, heartbeat_interval_s=4.0).registrar
        configured.follow(10.0)
        assert configured.heartbeat_interval_s == 4.0


async def test_a_newer_version_named_by_the_ack_is_prefetched_not_loaded(
    world: tuple[RecordingCoordinator, Parts],
) -> None:
    coord, parts = world
    await parts.registrar.register()
    await coord.publish(1)
    await beats(coord, parts, 1)
    assert parts.broadcast is not None
    store = parts.broadcast.store
    await until(lambda: store.is_complete(1), "v1 fetched in the background")
    assert parts.backend.loaded_version is None  # a lease loads it, not the heartbeat


async def test_no_prefetch_while_stopping(world: tuple[RecordingCoordinator, Parts]) -> None:
    coord, parts = world
    await parts.registrar.register()
    await coord.publish(1)
    parts.stopping.set()
    await beats(coord, parts, 1)
    await asyncio.sleep(0.1)
    assert parts.broadcast is not None and not parts.broadcast.store.is_complete(1)


def test_state_and_status_line() -> None:
    failures = FailureTracker(2, 0.01, 0.1, random.Random(0))
    assert node_state(failures, stopping=False, active=True) == "active"
    assert node_state(failures, stopping=False, active=False) == "standby"
    assert node_state(failures, stopping=True, active=True) == "stopping"
    failures.record("boom")
    failures.record("boom")
    assert node_state(failures, stopping=True, active=True) == "failed"  # says why it stopped
    stats = NodeStats(leases_done=3, leases_accepted=2, leases_rejected=1, tokens_per_s=41.6)
    line = status_line(stats, 4, "active", "public", None)
    assert line == (
        "status: active v=4 leases=3 tok/s=42 accepted=2 rejected=1 released=0 reach=public"
    )
    assert status_line(NodeStats(), None, "failed", "unknown", "x").endswith(
        "tok/s=- accepted=0 rejected=0 released=0 reach=unknown problem: x"
    )
