"""NodeWorker against the real coordinator core, served over the in-memory transport.

No sockets and no DHT: the coordinator's RPC handlers are a thin in-test adapter around
``coordinator.core.Coordinator`` on an ``InMemoryNetwork`` endpoint, and checkpoints are seeded by
a ``BroadcastNode`` on the same endpoint. The node runs the deterministic ``fake`` backend.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from coord_harness import TOK, config

from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.store import Store
from coordinator.tasks import ReverseTask
from node.backends.base import GenerationRequest, SampleOut, SamplingConfig
from node.backends.fake import FakeBackend
from node.config import NodeConfig
from node.rollouts import to_sampling_config, wire_finish_reason
from node.status import Backoff
from node.worker import NodeWorker
from policy.sampling import prompt_seed, sample_seed
from protocol import rpc
from protocol.codec import decode, encode
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import (
    Ack,
    Heartbeat,
    Lease,
    LeaseRequest,
    Register,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    SignedEnvelope,
    Standby,
    unpack_tokens,
)
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork

Handler = Callable[[str, bytes], Awaitable[bytes]]


class MemCoordinator:
    """The coordinator core behind rswarm/* handlers on an in-memory endpoint."""

    def __init__(self, net: InMemoryNetwork, dirs: MemoryHolderDirectory, tmp: Path) -> None:
        self.net = net
        self.dirs = dirs
        self.tmp = tmp
        self.identity = Identity.generate()
        self.cfg = config(tmp)
        self.core = Coordinator(
            self.cfg,
            store=Store(self.cfg.db_path),
            task=ReverseTask(),
            tokenizer=TOK,
            publisher_key=self.identity.public_key,
        )
        self.submissions: list[RolloutSubmission] = []
        self.leases: list[Lease] = []
        self.submit_gate: asyncio.Event | None = None
        self.submit_entered = asyncio.Event()
        self.broadcast: BroadcastNode | None = None

    async def start(self) -> None:
        self.transport = self.net.endpoint("coord")
        handlers: dict[str, Handler] = {
            rpc.REGISTER: self._register,
            rpc.HEARTBEAT: self._heartbeat,
            rpc.LEASE: self._lease,
            rpc.SUBMIT: self._submit,
            rpc.RELEASE: self._release,
        }
        for name, handler in handlers.items():
            await self.transport.register(name, _answering(handler))
        self.broadcast = BroadcastNode(
            self.transport,
            ChunkStore(self.tmp / "coord-chunks", keep_versions=5),
            self.dirs,
            self.identity.public_key,
        )
        await self.broadcast.start()

    async def restart_network(self) -> None:
        """Come back on the network after ``net.disconnect("coord")``."""
        assert self.broadcast is not None
        await self.broadcast.stop()
        await self.start()

    async def publish(self, version: int) -> None:
        torch.manual_seed(version)
        now = time.time()
        manifest, chunks = build_manifest(
            state_dict_to_files({"w": torch.randn(16, 16)}),
            version=version,
            parent_version=None,
            model_config_hash="ab",
            tokenizer_hash="cd",
            created_at=now,
            expires_at=now + 3600,
            chunk_size=512,
        )
        env = sign_manifest(manifest, self.identity, now)
        self.core.publish_version(env)
        assert self.broadcast is not None
        await self.broadcast.seed_version(env, chunks)

    def _open(self, data: bytes, type_: type) -> tuple[bytes, Any]:
        return self.core.open(decode(data, SignedEnvelope), type_)

    async def _register(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, Register)
        assert msg.advert.peer_id == peer
        return encode(self.core.register(key, msg.advert))

    async def _heartbeat(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, Heartbeat)
        return encode(self.core.heartbeat(key, msg))

    async def _lease(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, LeaseRequest)
        out = self.core.request_lease(key, msg)
        if isinstance(out, Standby):  # keep the tests fast
            out = Standby(retry_after_s=0.05, reason=out.reason)
        else:
            self.leases.append(out)
        return encode(out)

    async def _submit(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, RolloutSubmission)
        self.submissions.append(msg)
        self.submit_entered.set()
        if self.submit_gate is not None:
            await self.submit_gate.wait()
        return encode(await self.core.submit(key, msg))

    async def _release(self, peer: str, data: bytes) -> bytes:
        key, msg = self._open(data, ReleaseLease)
        prompts = self.core.release(key, msg.lease_id, msg.epoch, msg.reason)
        return encode(Ack(ref=msg.lease_id, detail=f"{len(prompts)} released"))

    def lease_states(self) -> dict[str, str]:
        return {lease.lease_id: lease.state for lease in self.core.store.leases()}


def _answering(handler: Handler) -> Handler:
    async def wrapped(peer: str, data: bytes) -> bytes:
        try:
            return await handler(peer, data)
        except (Rejection, ProtocolError) as exc:
            return encode(Reject(ref="-", code=exc.code, detail=exc.detail))

    return wrapped


def node_config(coord: MemCoordinator, tmp: Path, **kw: Any) -> NodeConfig:
    data: dict[str, Any] = {
        "coordinator": "/ip4/127.0.0.1/tcp/1/p2p/coord",
        "coordinator_key": coord.identity.fingerprint,
        "backend": "fake",
        "state_dir": tmp / "node",
        "heartbeat_interval_s": 0.2,
        "status_interval_s": 0.5,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.1,
        "max_prompts": 2,
    }
    data.update(kw)
    return NodeConfig.model_validate(data)


class Swarm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.net = InMemoryNetwork()
        self.dirs = MemoryHolderDirectory()
        self.coord = MemCoordinator(self.net, self.dirs, tmp)
        self.workers: list[NodeWorker] = []

    def worker(self, backend: Any = None, name: str = "node-1", **kw: Any) -> NodeWorker:
        cfg = node_config(self.coord, self.tmp / name, **kw)
        w = NodeWorker(
            cfg,
            backend or FakeBackend(),
            Identity.generate(),
            tokenizer=TOK,
            transport=self.net.endpoint(name),
            directory=self.dirs,
        )
        self.workers.append(w)
        return w


@pytest.fixture
async def swarm(tmp_path: Path) -> AsyncIterator[Swarm]:
    s = Swarm(tmp_path)
    await s.coord.start()
    yield s
    for w in s.workers:
        await w.stop()
    if s.coord.broadcast is not None:
        await s.coord.broadcast.stop()
    s.coord.core.close()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_pulls_generates_submits_and_is_accepted(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    w = swarm.worker()
    await w.start()
    await until(lambda: w.stats.leases_accepted >= 2, "two accepted leases")
    assert w.backend.loaded_version == 1
    assert swarm.coord.core.store.rollout_count() >= 2 * 2 * 2  # leases x prompts x G
    assert w.stats.leases_rejected == 0
    assert w.checkpoints is not None and w.checkpoints.highest_accepted == 1


async def test_samples_record_the_derived_seeds(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    w = swarm.worker()
    await w.start()
    await until(lambda: len(swarm.coord.submissions) >= 1, "a submission")
    sub, lease = swarm.coord.submissions[0], swarm.coord.leases[0]
    assert sub.lease_id == lease.lease_id and sub.policy_version == 1
    replay = FakeBackend()
    replay.load_state_dict(1, {})
    for i, (prompt, group) in enumerate(zip(lease.prompts, sub.groups, strict=True)):
        seed = prompt_seed(lease.sampling.seed, i)
        assert [s.seed for s in group.samples] == [sample_seed(seed, j) for j in range(2)]
        sampling = to_sampling_config(lease)  # the lease's settings, its stop set included
        again = replay.generate(
            [GenerationRequest(unpack_tokens(prompt.token_ids), 2, seed)], sampling
        )
        assert [unpack_tokens(s.token_ids) for s in group.samples] == [
            s.token_ids for s in again[0]
        ]


async def test_switches_to_a_newly_published_version(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    w = swarm.worker()
    await w.start()
    await until(lambda: w.stats.leases_accepted >= 1, "a lease at v1")
    await swarm.coord.publish(2)
    await until(
        lambda: any(s.policy_version == 2 for s in swarm.coord.submissions), "a submission at v2"
    )
    assert w.backend.loaded_version == 2
    assert w.checkpoints is not None and w.checkpoints.highest_accepted == 2


class SlowLoadBackend(FakeBackend):
    """Loading a version takes 0.3 s (a real checkpoint's download and load do)."""

    def load_state_dict(self, version: int, state_dict: Any, changed: Any = None) -> None:
        time.sleep(0.3)
        super().load_state_dict(version, state_dict, changed)


async def test_timings_report_the_version_load_and_the_round_trips(swarm: Swarm) -> None:
    """What the capacity planner reads (Timings.load_s / overhead_s): the wait for a lease's
    version, and the time between two generations spent on the coordinator, standby waits
    excluded. The first verdict is held 0.25 s: the second lease is generated meanwhile (the
    submission runs in the background), so only the third lease, which waits for it, reports it."""
    swarm.coord.submit_gate = asyncio.Event()
    w = swarm.worker(SlowLoadBackend())
    await w.start()
    await asyncio.sleep(0.2)  # standby: no version yet (deliberate waits are not overhead)
    await swarm.coord.publish(1)
    await swarm.coord.submit_entered.wait()
    await asyncio.sleep(0.25)
    assert len(swarm.coord.submissions) == 1  # the second waits for the first's verdict
    swarm.coord.submit_gate.set()
    await until(lambda: len(swarm.coord.submissions) >= 3, "a third submission")
    first, second, third = (s.timings for s in swarm.coord.submissions[:3])
    assert first.load_s >= 0.3 and first.overhead_s == 0.0  # the first lease: nothing before
    assert second.load_s < 0.1  # the version is loaded already
    assert second.overhead_s < 0.1  # generated while the first verdict was held
    assert 0.2 <= third.overhead_s < 1.0  # its generation waited for that verdict
    await swarm.coord.publish(2)
    await until(
        lambda: any(s.policy_version == 2 for s in swarm.coord.submissions), "a submission at v2"
    )
    switched = next(s.timings for s in swarm.coord.submissions if s.policy_version == 2)
    assert switched.load_s >= 0.3 and switched.overhead_s < 0.25


async def test_standby_until_a_version_exists(swarm: Swarm) -> None:
    w = swarm.worker()
    await w.start()
    await asyncio.sleep(0.2)
    assert w.stats.leases_done == 0 and w.backend.loaded_version is None
    await swarm.coord.publish(1)
    await until(lambda: w.stats.leases_accepted >= 1, "work after the first publication")


async def test_backs_off_while_the_coordinator_is_gone_and_resumes(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    w = swarm.worker()
    await w.start()
    await until(lambda: w.stats.leases_done >= 1, "a first lease")
    swarm.net.disconnect("coord")
    await until(lambda: w.stats.coordinator_errors >= 3, "several failed requests")
    done = w.stats.leases_done
    await swarm.coord.restart_network()
    await until(lambda: w.stats.leases_done > done, "work after the coordinator came back")


class BlockingBackend(FakeBackend):
    """generate() waits on a threading.Event (a long generation in progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.entered.set()
        self.release.wait(10)
        return super().generate(requests, sampling)


class LaterBlocks(BlockingBackend):
    """The first generate() runs at once; the later ones wait like :class:`BlockingBackend`'s
    (the next lease is surely still generating when a test stops the node)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.calls += 1
        if self.calls == 1:
            return FakeBackend.generate(self, requests, sampling)
        return super().generate(requests, sampling)


async def test_stop_releases_the_lease_being_generated(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    backend = BlockingBackend()
    w = swarm.worker(backend)
    await w.start()
    await until(backend.entered.is_set, "generation to start")
    lease = swarm.coord.leases[-1]
    try:
        await asyncio.wait_for(w.stop(), 5)
    finally:
        backend.release.set()
    assert swarm.coord.lease_states()[lease.lease_id] == "released"
    assert w.stats.leases_released == 1 and swarm.coord.submissions == []
    # The coordinator hands the same prompts to the next node at once.
    other = Identity.generate()
    from coord_harness import advert

    swarm.coord.core.register(other.public_key, advert(other, time.time()))
    again = swarm.coord.core.request_lease(
        other.public_key, LeaseRequest(peer_id="x", policy_version=1, max_prompts=2)
    )
    assert isinstance(again, Lease)
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in lease.prompts]


async def test_stop_submits_results_already_in_hand(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    swarm.coord.submit_gate = asyncio.Event()
    backend = LaterBlocks()
    w = swarm.worker(backend)
    await w.start()
    await swarm.coord.submit_entered.wait()
    # the submission runs in the background: the next lease is taken and generating meanwhile
    await until(backend.entered.is_set, "the next lease's generation")
    stopping = asyncio.create_task(w.stop())
    await asyncio.sleep(0.05)
    swarm.coord.submit_gate.set()
    try:
        await asyncio.wait_for(stopping, 5)
    finally:
        backend.release.set()
    assert w.stats.leases_accepted == 1 and len(swarm.coord.submissions) == 1
    # the lease generating at the stop was handed back, not left to its deadline
    later = [lease.lease_id for lease in swarm.coord.leases[1:]]
    assert len(later) == 1 and w.stats.leases_released == 1
    assert swarm.coord.lease_states()[later[0]] == "released"


async def test_oov_misbehaviour_is_rejected(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    w = swarm.worker(misbehave=["oov_tokens"])
    await w.start()
    await until(lambda: w.stats.leases_rejected >= 1, "a rejected submission")
    assert w.stats.last_reject is not None
    assert w.stats.last_reject.startswith(ReasonCode.TOKEN_OUT_OF_VOCAB.value)
    assert w.stats.leases_accepted == 0


def test_backoff_grows_with_jitter_and_caps() -> None:
    import random

    b = Backoff(0.5, 4.0, random.Random(0))
    delays = [b.next_delay() for _ in range(8)]
    for n, d in enumerate(delays):
        cap = min(4.0, 0.5 * 2**n)
        assert cap / 2 <= d <= cap
    b.reset()
    assert b.next_delay() <= 0.5


def test_finish_reason_mapping() -> None:
    assert wire_finish_reason(SampleOut([5, 2], [-1.0, -1.0], "stop"), {2}) == "eos"
    assert wire_finish_reason(SampleOut([5, 7], [-1.0, -1.0], "stop"), {2}) == "stop"
    assert wire_finish_reason(SampleOut([5, 5], [-1.0, -1.0], "length"), {2}) == "length"


def test_prompt_seeds_are_stable_and_distinct() -> None:
    seeds = {prompt_seed(7, i) for i in range(100)}
    assert len(seeds) == 100 and prompt_seed(7, 3) == prompt_seed(7, 3)
    assert all(0 <= s < 2**63 for s in seeds)
    assert prompt_seed(7, 0) != prompt_seed(8, 0)


class FailingBackend(FakeBackend):
    """Fails ``fail`` times (with ``messages[i % len]``), then generates like the fake backend."""

    def __init__(self, fail: int, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.fail = fail
        self.messages = messages
        self.attempts = 0

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> Any:
        self.attempts += 1
        if self.attempts <= self.fail:
            raise ValueError(self.messages[(self.attempts - 1) % len(self.messages)])
        return super().generate(requests, sampling)


POSITIONS = "prompt of 300 tokens + max_new_tokens 64 exceeds the model's 256 positions"


async def test_identical_generation_failures_stop_the_node_taking_leases(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    backend = FailingBackend(fail=10**6, messages=(POSITIONS,))
    w = swarm.worker(backend, max_identical_failures=3)
    await w.start()
    await until(lambda: w.failures.gave_up, "the node to give up")
    await asyncio.sleep(0.5)  # a node that kept going would have taken many more leases by now
    assert backend.attempts == 3 and w.stats.leases_released == 3
    line = w.status_line()
    assert "status: failed" in line and "stopped taking leases after 3 identical failures" in line
    assert POSITIONS in line
    assert w.statistics()["failed"] is True
    # the coordinator knows why (/status node_problems, swarm inspect)
    (problem,) = swarm.coord.core.node_problems.values()
    assert (
        problem.startswith("stopped taking leases after 3 identical failures")
        and POSITIONS in problem
    )
    presence = w.presence  # still up and visible: heartbeats go on
    assert presence is not None
    beats = presence.heartbeats_sent
    await until(lambda: presence.heartbeats_sent > beats, "heartbeats to go on")


async def test_a_failure_that_goes_away_does_not_stop_the_node(swarm: Swarm) -> None:
    await swarm.coord.publish(1)
    backend = FailingBackend(fail=2, messages=(POSITIONS,))
    w = swarm.worker(backend, max_identical_failures=3)
    await w.start()
    await until(lambda: w.stats.leases_accepted >= 1, "an accepted lease after the failures")
    assert not w.failures.gave_up and w.failures.problem is None
    assert not swarm.coord.core.node_problems  # cleared by the accepted work


def test_failure_tracker_backs_off_and_gives_up_only_on_identical_failures() -> None:
    import random

    from node.failures import FailureTracker

    t = FailureTracker(3, 1.0, 8.0, random.Random(0))
    delays = [t.record(f"error {i}") for i in range(5)]  # all different: never gives up
    assert not t.gave_up and t.repeats == 1
    assert delays[0] <= 1.0 and delays[3] >= 4.0  # grows: uniform in [d/2, d], d doubling
    t.record("same")
    t.record("same")
    assert not t.gave_up and t.problem == "same (2x in a row)"
    t.record("same")
    assert t.gave_up and t.problem is not None and t.problem.startswith("stopped taking leases")
    t.reset()
    assert not t.gave_up and t.problem is None and t.backoff.failures == 0
