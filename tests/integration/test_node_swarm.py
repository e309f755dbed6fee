"""Real processes on 127.0.0.1: the coordinator (``swarm coordinator launch``), contributor nodes
(``swarm node run --backend hf`` on the embedded model) and a trainer-like publisher in the test
process (signs PublishVersion with the trainer key, seeds chunks from its own BroadcastNode).

Every process started here is stopped by its PID (SIGTERM, then SIGKILL) at the end of its test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.client import CoordinatorClient
from node.model import ModelSpec, build_model
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import build_manifest
from protocol.messages import (
    AcceptedRollout,
    CapabilityAdvert,
    CpuInfo,
    FetchRollouts,
    Lease,
    LeaseRequest,
    ManifestResponse,
    PublishVersion,
    RolloutBatch,
    StatusRequest,
    StatusResponse,
)
from swarm.adverts import list_adverts
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.dht import SwarmPeer
from swarm.holders import DhtHolderDirectory
from swarm.testing import start_loopback_peer
from swarm.transport import P2PTransport

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Proc:
    """A child process with its output in a log file; stopped by PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", *args],
            cwd=ROOT,
            env=ENV,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(10)
        self._out.close()


async def until(predicate: object, what: str, timeout: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ok = predicate()  # type: ignore[operator]
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{what}: process exited early\n{proc.text()[-3000:]}")
        if time.monotonic() > deadline:
            tail = proc.text()[-3000:] if proc is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        await asyncio.sleep(0.2)


@dataclass
class Coordinator:
    proc: Proc
    state: Path
    maddr: str
    peer_id: str
    fingerprint: str
    public_key: bytes


def coordinator_toml(tmp: Path, trainer: Identity, **sections: dict[str, object]) -> Path:
    lines = [
        'db_path = "state.sqlite"',
        "group_size = 4",
        "staleness_bound = 2",
        "heartbeat_interval_s = 2.0",
    ]
    base: dict[str, dict[str, object]] = {
        "sampling": {"max_new_tokens": 4},
        "leases": {"min_deadline_s": 30.0, "target_lease_s": 0.5, "max_prompts_per_lease": 4},
        "intake": {"spot_check_fraction": 1.0},
        "capacity": {"activation": False},
        "network": {"trainer_key": trainer.fingerprint},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "coordinator.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def launch_coordinator(tmp: Path, config: Path) -> Coordinator:
    state = tmp / "coord"
    proc = Proc(
        ["coordinator", "launch", "--config", str(config), "--state-dir", str(state)],
        tmp / "coordinator.log",
    )
    info_file = state / "coordinator.json"
    await until(info_file.exists, "coordinator.json", 40, proc)
    info = json.loads(info_file.read_text())
    key = Identity.load(state / "coordinator.key")
    assert key.fingerprint == info["fingerprint"]
    return Coordinator(
        proc, state, info["multiaddrs"][0], info["peer_id"], info["fingerprint"], key.public_key
    )


def start_node(
    tmp: Path, coord: Coordinator, name: str, extra: str = "", *, max_prompts: int = 4
) -> Proc:
    state = tmp / name
    state.mkdir(parents=True, exist_ok=True)
    cfg = state / "node.toml"
    cfg.write_text(
        'host_maddrs = ["/ip4/127.0.0.1/tcp/0"]\n'
        f"probe_budget_s = 0.2\nstatus_interval_s = 2.0\nmax_prompts = {max_prompts}\n"
        "advert_period_s = 5.0\nheartbeat_interval_s = 1.0\n" + extra
    )
    args = ["node", "run", "--coordinator", coord.maddr, "--coordinator-key", coord.fingerprint]
    args += ["--backend", "hf", "--config", str(cfg), "--state-dir", str(state)]
    return Proc(args, tmp / f"{name}.log")


class Trainer:
    """Publishes versions like the trainer does: PublishVersion -> signed manifest -> seed."""

    def __init__(self, coord: Coordinator, identity: Identity, tmp: Path) -> None:
        self.coord = coord
        self.identity = identity
        self.tmp = tmp
        self.peer: SwarmPeer | None = None

    async def start(self) -> None:
        self.peer = await start_loopback_peer([self.coord.maddr])
        self.transport = P2PTransport(self.peer.p2p)
        self.broadcast = BroadcastNode(
            self.transport,
            ChunkStore(self.tmp / "trainer-store", keep_versions=5),
            DhtHolderDirectory(self.peer),
            self.coord.public_key,
        )
        await self.broadcast.start()

    async def stop(self) -> None:
        await self.broadcast.stop()
        if self.peer is not None:
            await self.peer.stop()

    async def publish(self, version: int) -> None:
        state_dict = build_model(ModelSpec(), seed=version).state_dict()
        now = time.time()
        manifest, chunks = build_manifest(
            state_dict_to_files(state_dict),
            version=version,
            parent_version=version - 1 if version > 1 else None,
            model_config_hash="00",
            tokenizer_hash="00",
            created_at=now,
            expires_at=now + 3600,
            chunk_size=64 * 1024,
        )
        request = seal(self.identity, PublishVersion(manifest=encode(manifest), source=""), now=now)
        raw = await self.transport.call(
            self.coord.peer_id, rpc.PUBLISH, encode(request), timeout=30
        )
        response = decode(raw)
        assert isinstance(response, ManifestResponse) and response.manifest is not None
        await self.broadcast.seed_version(response.manifest, chunks)

    async def fetch(self, after_seq: int = 0) -> list[AcceptedRollout]:
        msg = FetchRollouts(
            after_seq=after_seq, max_rollouts=4096, min_policy_version=None, wait_s=0
        )
        request = seal(self.identity, msg, now=time.time())
        raw = await self.transport.call(self.coord.peer_id, rpc.FETCH, encode(request), timeout=30)
        batch = decode(raw)
        assert isinstance(batch, RolloutBatch), batch
        return batch.rollouts

    async def status(self) -> dict[str, object]:
        raw = await self.transport.call(
            self.coord.peer_id, rpc.STATUS, encode(StatusRequest()), timeout=10
        )
        response = decode(raw)
        assert isinstance(response, StatusResponse)
        return dict(response.status)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture
async def swarm(tmp_path: Path, procs: list[Proc]) -> AsyncIterator[tuple[Coordinator, Trainer]]:
    trainer_id = Identity.generate()
    coord = await launch_coordinator(tmp_path, coordinator_toml(tmp_path, trainer_id))
    procs.append(coord.proc)
    trainer = Trainer(coord, trainer_id, tmp_path)
    await trainer.start()
    yield coord, trainer
    await trainer.stop()


def node_fingerprint(state: Path) -> str | None:
    key = state / "node.key"
    return Identity.load(key).fingerprint if key.exists() else None


@pytest.mark.slow
async def test_node_joins_advertises_submits_and_follows_new_versions(
    tmp_path: Path, swarm: tuple[Coordinator, Trainer], procs: list[Proc]
) -> None:
    coord, trainer = swarm
    await trainer.publish(1)
    node = start_node(tmp_path, coord, "n1")
    procs.append(node)
    await until(lambda: node_fingerprint(tmp_path / "n1") is not None, "node key", 20, node)
    fp = node_fingerprint(tmp_path / "n1")
    assert trainer.peer is not None
    peer = trainer.peer

    async def advertised(version: int | None = None) -> bool:
        ads = await list_adverts(peer)
        ad = ads.get(fp or "")
        return ad is not None and (version is None or ad.policy_version == version)

    await until(advertised, "the node's advert in the DHT", 30, node)
    ads = await list_adverts(peer)
    assert ads[fp or ""].backend == "hf" and ads[fp or ""].dtype == "float32"

    seen: list[AcceptedRollout] = []

    async def accepted_at(version: int) -> bool:
        seen.extend(await trainer.fetch(seen[-1].seq if seen else 0))
        return any(r.policy_version == version and r.node_fingerprint == fp for r in seen)

    await until(lambda: accepted_at(1), "accepted rollouts at v1", 30, node)
    await trainer.publish(2)
    await until(lambda: accepted_at(2), "accepted rollouts at v2", 30, node)
    await until(lambda: advertised(2), "the advert to show v2", 15, node)
    status = await trainer.status()
    assert status["rejected_by_reason"] == {}  # every submission passed, spot checks included

    node.signal(signal.SIGTERM)
    assert node.wait(20) == 0
    assert "node stopped" in node.text()


@pytest.mark.slow
async def test_sigterm_releases_the_lease_and_the_coordinator_reassigns_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp_path,
        trainer_id,
        sampling={"max_new_tokens": 48},
        leases={"min_deadline_s": 120.0, "target_lease_s": 60.0, "max_prompts_per_lease": 64},
        intake={"spot_check_fraction": 0.0},
    )
    # group_size 32 x 64 prompts x 48 tokens: a lease takes several seconds to generate.
    config.write_text(config.read_text().replace("group_size = 4", "group_size = 32"))
    coord = await launch_coordinator(tmp_path, config)
    procs.append(coord.proc)
    trainer = Trainer(coord, trainer_id, tmp_path)
    await trainer.start()
    try:
        await trainer.publish(1)
        node = start_node(tmp_path, coord, "n1", 'log_level = "DEBUG"\n', max_prompts=64)
        procs.append(node)
        await until(lambda: "generating lease" in node.text(), "generation to start", 40, node)
        node.signal(signal.SIGTERM)
        assert node.wait(20) == 0
        assert "released lease" in node.text()

        status = await trainer.status()
        assert status["leases"] == {"released": 1}
        # Another node asks right away and gets the released prompts (re-queued first).
        other = Identity.generate()
        client = CoordinatorClient(trainer.transport, coord.peer_id, other)
        await client.register(
            CapabilityAdvert(
                peer_id=trainer.transport.peer_id,
                node_key=other.public_key,
                gpus=[],
                cpu=CpuInfo(cores=1, memory_bytes=1 << 30),
                backend="hf",
                dtype="float32",
                tokens_per_s=100.0,
                rollouts_per_s=1.0,
                price_per_hour=None,
                policy_version=1,
                reachability="unknown",
                software_version="test",
                expires_at=time.time() + 60,
            )
        )
        me = trainer.transport.peer_id
        got = await client.lease(LeaseRequest(peer_id=me, policy_version=1, max_prompts=1))
        assert isinstance(got, Lease)
        assert got.prompts[0].prompt_id == "reverse3:00000000"
    finally:
        await trainer.stop()


async def test_unreachable_coordinator_is_one_line_and_exit_1(tmp_path: Path) -> None:
    state = tmp_path / "n"
    state.mkdir()
    (state / "node.toml").write_text(
        'host_maddrs = ["/ip4/127.0.0.1/tcp/0"]\nprobe_budget_s = 0.05\n'
        "startup_timeout_s = 5.0\nregister_timeout_s = 3.0\n"
    )
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmPSJhrMwurpGFJhEmiamjnpUPTp33SFTL36J9fQc56U1i"
    proc = Proc(
        ["node", "run", "--coordinator", dead, "--coordinator-key", Identity.generate().fingerprint,
         "--backend", "fake", "--config", str(state / "node.toml"), "--state-dir", str(state)],
        tmp_path / "n.log",
    )  # fmt: skip
    try:
        rc = proc.wait(60)
    finally:
        proc.stop()
    errors = [line for line in proc.text().splitlines() if line.startswith("error: ")]
    assert rc == 1, proc.text()[-2000:]
    assert len(errors) == 1 and ("initial peers" in errors[0] or "coordinator" in errors[0])
