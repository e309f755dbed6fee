"""Shared pieces of the real-process integration tests: a coordinator subprocess
(``swarm coordinator launch``), a trainer-like publisher and a test-side node identity that
produces honest rollouts with the ``hf`` backend on the embedded model.

Everything runs on 127.0.0.1; every process started here is stopped by its PID (SIGTERM, then
SIGKILL), or, to simulate a crash, by SIGKILL to the process group it leads (it was started in
its own session, so the group holds exactly the coordinator and the helpers it spawned).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from node.client import CoordinatorClient
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import build_manifest
from protocol.messages import (
    AcceptedRollout,
    Ack,
    CapabilityAdvert,
    CpuInfo,
    FetchRollouts,
    Lease,
    LeaseRequest,
    ManifestResponse,
    PublishVersion,
    Reject,
    RolloutBatch,
    RolloutSubmission,
    StatusRequest,
    StatusResponse,
    Timings,
)
from swarm.broadcast import BroadcastNode
from swarm.chunks import ChunkStore
from swarm.dht import SwarmPeer
from swarm.holders import DhtHolderDirectory
from swarm.testing import start_loopback_peer
from swarm.transport import P2PTransport

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

#: ``intake.calibration_samples`` for tests about faults, restarts and stops (not about the
#: tolerance's figure): the first spot check of each version in each coordinator process
#: calibrates that version's tolerance (coordinator/logprobs.py ``tolerance_of``), and the
#: submission being checked waits for it. At the default (256 honest samples per precision and
#: path) that is ~3.7 s of CPU for the embedded model; at the minimum (8) ~0.1 s. The calibration
#: and every spot check still run; honest test nodes compute in fp32 like the verifier, so their
#: error is fp32 rounding, which the calibrated tolerance's floors (coordinator/calibration.py
#: ``FLOORS``) keep clear of however few samples were drawn. ``calibration_local`` off: no
#: second (bf16) forward per check, ~5x a check's CPU here (the local slack is tested in
#: tests/unit/test_calibrated_tolerance.py).
FAST_CALIBRATION: dict[str, object] = {"calibration_samples": 8, "calibration_local": False}


class Proc:
    """A ``swarm`` CLI child process with its output in a log file; stopped by PID."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """``prefix`` runs the command through another (e.g. ``ip netns exec NS``, which execs
        in place: the PID stays the CLI's)."""
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "swarm.shell.cli", *args],
            cwd=ROOT,
            env={**ENV, **(env or {})},
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

    def crash(self) -> None:
        """SIGKILL the process and the helpers it spawned (its own process group), no clean-up.
        Also reaps the helpers of a process that already died on its own (fault injection)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        self._out.close()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(10)
        if not self._out.closed:
            self._out.close()


async def until(
    predicate: Callable[[], Any], what: str, timeout: float, proc: Proc | None = None
) -> None:
    """Poll ``predicate`` (sync or async) until truthy; fail naming ``what`` with the log tail."""
    deadline = time.monotonic() + timeout
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{what}: process exited early\n{proc.text()[-3000:]}")
        if time.monotonic() > deadline:
            tail = proc.text()[-3000:] if proc is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        await asyncio.sleep(0.1)


@dataclass
class CoordinatorProc:
    proc: Proc
    state: Path
    maddr: str
    peer_id: str
    fingerprint: str
    public_key: bytes


def coordinator_toml(
    tmp: Path,
    trainer: Identity,
    top: dict[str, object] | None = None,
    **sections: dict[str, object],
) -> Path:
    """A small coordinator config (G=4, L=4, S=2) with ``top``-level and section overrides."""
    base_top: dict[str, object] = {
        "db_path": "state.sqlite",
        "group_size": 4,
        "staleness_bound": 2,
        "heartbeat_interval_s": 2.0,
        **(top or {}),
    }
    base: dict[str, dict[str, object]] = {
        "sampling": {"max_new_tokens": 4},
        "leases": {"min_deadline_s": 30.0, "target_lease_s": 0.5, "max_prompts_per_lease": 4},
        "intake": {"spot_check_fraction": 1.0},
        # audit copies would give a prompt a second group: tests that count groups per prompt
        # keep it off; the Byzantine suite turns it on
        "reward_audit": {"fraction": 0.0},
        "capacity": {"activation": False},
        "network": {"trainer_key": trainer.fingerprint},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = [f"{k} = {json.dumps(v)}" for k, v in base_top.items()]
    for name, values in base.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "coordinator.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def launch_coordinator(
    tmp: Path, config: Path, env: dict[str, str] | None = None
) -> CoordinatorProc:
    """Start (or restart, same state dir ``tmp/coord``) a coordinator; wait for its address.
    ``env`` adds environment variables (e.g. ``RSWARM_FAULTS``, see :mod:`swarm.faults`)."""
    proc = start_coordinator(tmp, config, env)
    try:
        await until((tmp / "coord" / "coordinator.json").exists, "coordinator.json", 60, proc)
        return coordinator_up(tmp, proc)
    except BaseException:  # not handed to the caller yet: nobody else would stop it
        proc.stop()
        raise


def start_coordinator(tmp: Path, config: Path, env: dict[str, str] | None = None) -> Proc:
    """:func:`launch_coordinator` without the wait: the process, whose address
    :func:`coordinator_up` reads once ``tmp/coord/coordinator.json`` exists."""
    info_file = tmp / "coord" / "coordinator.json"
    info_file.unlink(missing_ok=True)  # a restart rewrites it once it is listening again
    return Proc(
        ["coordinator", "launch", "--config", str(config), "--state-dir", str(tmp / "coord")],
        tmp / "coordinator.log",
        env,
    )


def coordinator_up(tmp: Path, proc: Proc) -> CoordinatorProc:
    """The coordinator ``proc`` started on ``tmp`` (its ``coordinator.json`` written)."""
    state = tmp / "coord"
    info = json.loads((state / "coordinator.json").read_text())
    key = Identity.load(state / "coordinator.key")
    assert key.fingerprint == info["fingerprint"]
    return CoordinatorProc(
        proc, state, info["multiaddrs"][0], info["peer_id"], info["fingerprint"], key.public_key
    )


@cache
def policy_state_dict(version: int) -> dict[str, Any]:
    """Weights of policy ``version`` as the test trainer publishes them (seeded random init)."""
    from policy.model import ModelSpec, build_model

    return dict(build_model(ModelSpec(), seed=version).state_dict())


class Trainer:
    """Publishes versions like the trainer does (PublishVersion -> signed manifest -> seed) and
    reads the accepted-rollout feed. Its peer also carries the test-side node identities."""

    def __init__(self, coord: CoordinatorProc, identity: Identity, tmp: Path) -> None:
        self.coord = coord
        self.identity = identity
        self.tmp = tmp
        self.peer: SwarmPeer | None = None

    async def start(self) -> None:
        self.peer = await start_loopback_peer([self.coord.maddr])
        self.transport = P2PTransport(self.peer.p2p)
        self.broadcast = BroadcastNode(
            self.transport,
            ChunkStore(self.tmp / "trainer-store", keep_versions=8),
            DhtHolderDirectory(self.peer),
            self.coord.public_key,
        )
        await self.broadcast.start()

    async def stop(self) -> None:
        await self.broadcast.stop()
        if self.peer is not None:
            await self.peer.stop()

    async def publish(
        self, version: int, *, held: bool = True, state_dict: dict[str, Any] | None = None
    ) -> None:
        """Publish ``version`` (the weights ``policy_state_dict(version)`` unless ``state_dict``
        is given); with ``held``, wait until the coordinator holds its weights."""
        from swarm.checkpoint_io import state_dict_to_files

        now = time.time()
        weights = state_dict if state_dict is not None else policy_state_dict(version)
        manifest, chunks = build_manifest(
            state_dict_to_files(weights),
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
        assert isinstance(response, ManifestResponse) and response.manifest is not None, response
        await self.broadcast.seed_version(response.manifest, chunks)
        if held:

            async def holds() -> bool:
                return version in (await self.status())["versions_held"]  # type: ignore[operator]

            await until(holds, f"the coordinator to hold v{version}", 30, self.coord.proc)

    async def fetch(
        self, after_seq: int = 0, stats: dict[str, Any] | None = None
    ) -> list[AcceptedRollout]:
        """The accepted rollouts after ``after_seq``; ``stats`` is reported as the trainer's
        figures (e.g. ``step`` and ``rollout_cursor``, which the receipt log records)."""
        msg = FetchRollouts(
            after_seq=after_seq,
            max_rollouts=4096,
            min_policy_version=None,
            wait_s=0,
            trainer_stats=stats or {},
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


class TestNode:
    """A node identity in the test process: registers, leases, and samples honestly with the
    ``hf`` backend on exactly the weights the trainer published for the lease's version."""

    __test__ = False  # not a pytest class

    def __init__(self, transport: P2PTransport, coordinator_peer_id: str) -> None:
        self.identity = Identity.generate()
        self.connect(transport, coordinator_peer_id)

    def connect(self, transport: P2PTransport, coordinator_peer_id: str) -> None:
        """Talk through ``transport`` (e.g. a fresh peer after a coordinator restart)."""
        self.transport = transport
        self.client = CoordinatorClient(transport, coordinator_peer_id, self.identity)

    async def register(self, **advert_changes: Any) -> None:
        """Register with a CPU advert; ``advert_changes`` replace its fields (forged adverts, or
        ``dtype="bfloat16"``: the backend/dtype a node registers is what it is held to)."""
        await self.client.register(self.advert(**advert_changes))

    def advert(self, **changes: Any) -> CapabilityAdvert:
        return msgspec.structs.replace(
            CapabilityAdvert(
                peer_id=self.transport.peer_id,
                node_key=self.identity.public_key,
                gpus=[],
                cpu=CpuInfo(cores=1, memory_bytes=1 << 30),
                backend="hf",
                dtype="float32",
                tokens_per_s=100.0,
                rollouts_per_s=1.0,
                price_per_hour=None,
                policy_version=None,
                reachability="unknown",
                software_version="test",
                expires_at=time.time() + 600,
            ),
            **changes,
        )

    async def lease(self, max_prompts: int = 2) -> Lease:
        got = await self.client.lease(
            LeaseRequest(
                peer_id=self.transport.peer_id, policy_version=None, max_prompts=max_prompts
            )
        )
        assert isinstance(got, Lease), got
        return got

    def rollouts(self, lease: Lease) -> RolloutSubmission:
        """Honest results of ``lease``, built exactly like :mod:`node.worker` builds them."""
        return honest_submission(lease)

    async def submit(self, sub: RolloutSubmission) -> Ack | Reject:
        return await self.client.submit(sub)

    def sealed(self, sub: RolloutSubmission) -> bytes:
        return encode(seal(self.identity, sub, now=time.time()))


@cache
def _backend(version: int) -> Any:
    import torch

    from node.backends.hf import HFBackend
    from policy.model import ModelSpec, build_model, load_weights

    torch.set_num_threads(1)
    model = build_model(ModelSpec())
    load_weights(model, policy_state_dict(version))
    return HFBackend(model=model, device="cpu")


def honest_submission(lease: Lease) -> RolloutSubmission:
    """Sample ``lease`` at its version and package it as the node worker does."""
    from node.rollouts import build_submission, lease_requests, to_sampling_config

    backend = _backend(lease.policy_version)
    requests = lease_requests(lease)
    outs = backend.generate(requests, to_sampling_config(lease))
    now = time.time()
    return build_submission(
        lease,
        requests,
        outs,
        set(backend.eos_token_ids),
        backend="hf",
        dtype="float32",
        timings=Timings(started_at=now, finished_at=now, generate_s=0.01),
    )


def tampered(envelope_bytes: bytes, **changes: Any) -> bytes:
    """A signed submission envelope whose payload was altered after signing."""
    from protocol.messages import SignedEnvelope

    env = decode(envelope_bytes, SignedEnvelope)
    sub = decode(env.payload, RolloutSubmission)
    return encode(
        msgspec.structs.replace(env, payload=encode(msgspec.structs.replace(sub, **changes)))
    )


def start_node(
    tmp: Path, coord: CoordinatorProc, name: str, extra: str = "", *, max_prompts: int = 4
) -> Proc:
    """A real ``swarm node run --backend hf`` process (state in ``tmp/name``, log ``name.log``)
    joining ``coord``; ``extra`` adds lines to its node.toml."""
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


def lease_keys(lease: Lease) -> set[tuple[str, str, int]]:
    """(lease, prompt, sample) of every sample a whole answer to ``lease`` carries."""
    return {
        (lease.lease_id, p.prompt_id, j) for p in lease.prompts for j in range(lease.group_size)
    }


async def until_in_feed(
    trainer: Trainer, keys: set[tuple[str, str, int]], wait_s: float = 60.0
) -> list[AcceptedRollout]:
    """The trainer's feed once every (lease, prompt, sample) of ``keys`` is in it: a lease drawn
    for the re-score is acknowledged before it, its rows held until it passes (issue 34)."""
    deadline = time.monotonic() + wait_s
    while True:
        feed = await trainer.fetch(0)
        missing = keys - {(r.lease_id, r.prompt_id, r.sample_index) for r in feed}
        if not missing:
            return feed
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} acknowledged samples not in the feed")
        await asyncio.sleep(0.05)


async def settled(
    trainer: Trainer,
    node: TestNode,
    sub: RolloutSubmission,
    first: Ack | Reject,
    wait_s: float = 60.0,
) -> Ack | Reject:
    """The verdict of ``sub`` once its re-score, if it was drawn for one, has run: the ack does
    not wait for it (issue 34). Final once the lease's rows are in the trainer's feed (accepted)
    or a re-send of the same submission gets the stored refusal (after a ban at once, the ban's
    detail names the refusal's code: that code is returned)."""
    import re

    from protocol.errors import ReasonCode

    if not isinstance(first, Ack):
        return first
    deadline = time.monotonic() + wait_s
    while True:
        if any(r.lease_id == sub.lease_id for r in await trainer.fetch(0)):
            return first
        again = await node.submit(sub)
        if isinstance(again, Reject):
            named = [
                c
                for c in ReasonCode
                if c is not ReasonCode.BANNED and re.search(rf"\b{c.value}\b", again.detail)
            ]
            if again.code is ReasonCode.BANNED and named:  # "(ban #1: <code> far beyond ...)"
                return Reject(ref=sub.lease_id, code=named[0], detail=again.detail)
            return again
        if time.monotonic() > deadline:
            raise AssertionError(f"lease {sub.lease_id}: its re-score never ended")
        await asyncio.sleep(0.05)
