"""node.work.WorkLoop built on its own (no NodeWorker, no heartbeats), against the real coordinator
core of test_node_worker on the in-memory transport, with the fake backend."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from node_parts import NodeParts
from test_node_worker import MemCoordinator, until

from node.failures import FailureTracker
from node.generation import GenerationThread
from node.status import Backoff
from node.work import WorkLoop
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork


class Loop(NodeParts):
    """A WorkLoop and what it receives; ``loaded`` counts ``on_version_loaded`` calls."""

    def __init__(self, tmp: Path, coord: MemCoordinator, net: InMemoryNetwork) -> None:
        super().__init__(tmp, coord, net, registrar_interval_s=1.0)
        (tmp / "node").mkdir()
        self.generation = GenerationThread(self.backend)
        self.loaded = 0
        self.task: asyncio.Task[None] | None = None
        self.now = 1000.0  # the loop's wall clock (lease deadlines are the coordinator's)

    def _version_loaded(self) -> None:
        self.loaded += 1

    async def start(self, dirs: MemoryHolderDirectory) -> WorkLoop:
        checkpoints = await self.checkpoints(dirs)
        rng = random.Random(0)
        self.work = WorkLoop(
            self.client,
            checkpoints,
            self.generation,
            self.registrar,
            config=self.config,
            backend=self.backend,
            stats=self.stats,
            failures=FailureTracker(3, 0.02, 0.1, rng),
            backoff=Backoff(0.02, 0.1, rng),
            stopping=self.stopping,
            peer_id=self.transport.peer_id,
            on_version_loaded=self._version_loaded,
            tokenizer=None,
            rng=rng,
            clock=lambda: self.now,
        )
        self.task = asyncio.create_task(self.work.run(), name="node-work")
        return self.work

    async def close(self) -> None:
        self.stopping.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)
        self.generation.shutdown()
        await self.stop_broadcast()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[MemCoordinator, Loop]]:
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    coord = MemCoordinator(net, dirs, tmp_path)
    await coord.start()
    loop = Loop(tmp_path, coord, net)
    await loop.start(dirs)
    yield coord, loop
    await loop.close()
    assert coord.broadcast is not None
    await coord.broadcast.stop()
    coord.core.close()


async def test_an_unregistered_node_registers_on_unknown_node_and_works(
    world: tuple[MemCoordinator, Loop],
) -> None:
    """Nobody registered this node: the first lease request is refused (unknown_node), the loop
    registers it through the registrar, and leases are then generated and accepted."""
    coord, loop = world
    await coord.publish(1)
    await until(lambda: loop.stats.leases_accepted >= 2, "two accepted leases")
    assert loop.stats.leases_rejected == 0 and loop.stats.tokens_generated > 0
    assert loop.backend.loaded_version == 1 and loop.loaded >= 1
    assert [s.policy_version for s in coord.submissions[:2]] == [1, 1]


async def test_a_stop_while_generating_releases_the_lease_in_hand(
    world: tuple[MemCoordinator, Loop],
) -> None:
    coord, loop = world
    gate = asyncio.Event()
    real = loop.backend.generate

    def generate(*args: object) -> object:  # a long generation: waits for the test
        asyncio.run_coroutine_threadsafe(gate.wait(), main).result(10)
        return real(*args)  # type: ignore[arg-type]

    main = asyncio.get_running_loop()
    loop.backend.generate = generate  # type: ignore[method-assign]
    await coord.publish(1)
    await until(lambda: loop.generation.in_flight, "a generation in flight")
    lease = loop.work.lease
    assert lease is not None and loop.work.phase.startswith("generating")
    loop.stopping.set()
    assert loop.task is not None
    await asyncio.wait_for(loop.task, 10)
    gate.set()
    assert coord.lease_states()[lease.lease_id] == "released"
    assert loop.stats.leases_released == 1 and coord.submissions == []
    assert loop.work.lease is None


async def test_the_next_lease_is_generated_while_the_verdict_is_on_its_way(
    world: tuple[MemCoordinator, Loop],
) -> None:
    """The submission runs in the background: with the first verdict held, the loop takes,
    loads and generates the second lease, then waits for that verdict before submitting again
    (one submission in flight at most)."""
    coord, loop = world
    coord.submit_gate = asyncio.Event()
    await coord.publish(1)
    await coord.submit_entered.wait()
    await until(
        lambda: (
            loop.stats.leases_done == 0
            and len(coord.leases) == 2
            and loop.work.lease is not None
            and loop.work.lease.lease_id == coord.leases[1].lease_id
            and loop.work.phase == "submitting rollouts"
        ),
        "the second lease generated, its submission waiting for the first verdict",
    )
    assert len(coord.submissions) == 1 and loop.stats.tokens_generated > 0
    coord.submit_gate.set()
    await until(lambda: loop.stats.leases_accepted >= 2, "both leases accepted")
    assert [s.lease_id for s in coord.submissions[:2]] == [x.lease_id for x in coord.leases[:2]]


async def test_a_late_lease_is_submitted_before_the_next_is_asked_for(
    world: tuple[MemCoordinator, Loop],
) -> None:
    """A lease past its deadline (here the node's clock is far ahead) is not submitted in the
    background: the next lease request would expire it at the coordinator and re-issue its
    prompts to this very node before the late result lands (which would then be refused whole,
    tests/integration/test_process_faults.py). With its verdict held, no second lease is asked."""
    coord, loop = world
    loop.now = 1e12
    coord.submit_gate = asyncio.Event()
    await coord.publish(1)
    await coord.submit_entered.wait()
    await asyncio.sleep(0.3)
    assert len(coord.leases) == 1 and loop.work.phase == "submitting rollouts"
    coord.submit_gate.set()
    await until(lambda: len(coord.leases) >= 2, "the next lease, after the verdict")
    assert loop.stats.leases_done >= 1
