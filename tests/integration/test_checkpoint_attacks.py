"""Real processes on 127.0.0.1: hostile checkpoint holders against a node's checkpoint stack.

The victim is a separate OS process (``checkpoint_attacks_victim.py``: the node's
``BroadcastNode`` + ``CheckpointManager`` + ``hf`` backend on a real libp2p/DHT peer, wired as
``NodeWorker`` wires them). The honest seed (the coordinator's role) and the hostile holders live
in the test process, each on its own libp2p peer, and announce what they hold in the DHT.

Each attack must leave the victim with nothing loaded (same loaded version, same weights), no
data of the bad version in its store, the offending peer scored down, and the next honest version
loadable afterwards. Unit-level coverage that is not repeated here (tests/unit/
test_node_checkpoints.py): a manifest whose payload was altered under the coordinator's signature,
a first manifest signed by another key, files altered after the download, the accepted-version
record itself; tests/integration/test_swarm_broadcast.py: a corrupt holder among honest ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from checkpoint_attacks_victim import weights_digest
from swarm_harness import ENV, ROOT, policy_state_dict

from protocol.codec import decode, encode
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Manifest, ManifestRequest, ManifestResponse, SignedEnvelope
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.dht import SwarmPeer
from swarm.holders import DhtHolderDirectory
from swarm.testing import start_loopback_peer
from swarm.transport import P2PTransport

HERE = Path(__file__).resolve().parent
CHUNK = 64 * 1024  # the embedded model is ~540 KB: 9 chunks

Version = tuple[SignedEnvelope, Manifest, list[bytes]]


def sign_version(
    signer: Identity, version: int, *, weights_of: int | None = None, expired: bool = False
) -> Version:
    """A signed checkpoint ``version`` holding the weights of policy ``weights_of`` (default: its
    own); ``expired``: validly signed, but ``expires_at`` an hour in the past."""
    now = time.time()
    created = now - 7200 if expired else now
    manifest, chunks = build_manifest(
        state_dict_to_files(policy_state_dict(version if weights_of is None else weights_of)),
        version=version,
        parent_version=version - 1 if version > 1 else None,
        model_config_hash="00",
        tokenizer_hash="00",
        created_at=created,
        expires_at=created + 3600,
        chunk_size=CHUNK,
    )
    return sign_manifest(manifest, signer, created), manifest, chunks


def digest(version: int) -> str:
    return weights_digest(policy_state_dict(version))


class Victim:
    """Parent side of ``checkpoint_attacks_victim.py`` (own process group, stopped by PID)."""

    def __init__(self, state: Path, bootstrap: str, fingerprint: str, log: Path) -> None:
        self.args = [str(HERE / "checkpoint_attacks_victim.py"), "--state", str(state)]
        self.args += ["--bootstrap", bootstrap, "--coordinator-key", fingerprint]
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *self.args, cwd=ROOT, env=ENV, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
            )  # fmt: skip
        line = await self._line(90)
        assert line.startswith("READY "), f"victim did not start: {line!r}\n{self.tail()}"

    async def _line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raise AssertionError(f"victim silent for {timeout:.0f} s\n{self.tail()}") from None
        return raw.decode().strip()

    async def _ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        line = await self._line(timeout)
        assert line, f"victim exited\n{self.tail()}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def ensure(self, version: int, seeds: list[str]) -> dict[str, Any]:
        """Ask the victim to load ``version``; its reply (``ok``, error, ``state``)."""
        return await self._ask({"op": "ensure", "version": version, "seeds": seeds}, 120)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def crash(self) -> None:
        """SIGKILL the victim's process group (Python, DHT process, p2pd): no clean-up at all."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            with contextlib.suppress(ConnectionError):
                self.proc.stdin.write(b'{"op": "stop"}\n')  # EOF alone may never come (see
            self.proc.stdin.close()  # checkpoint_attacks_victim.py)
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.crash()
            await self.proc.wait()


class Holder:
    """A peer in the test process that holds and announces versions it was handed as is (no
    verification: it may hold forged or expired manifests). ``corrupt`` flips one byte of every
    chunk it serves; ``replay`` answers every manifest request with that envelope. Counts the
    requests it receives per version."""

    def __init__(self, peer: SwarmPeer, store: Path, key: bytes) -> None:
        self.peer = peer
        self.node = BroadcastNode(
            P2PTransport(peer.p2p),
            ChunkStore(store, keep_versions=8),
            DhtHolderDirectory(peer),
            key,
        )
        self.corrupt = False
        self.replay: SignedEnvelope | None = None
        self.chunk_requests: Counter[int] = Counter()
        self.manifest_requests: Counter[int] = Counter()
        original_load = self.node.server.load_chunk
        original_manifest = self.node.server._on_manifest

        def load_chunk(version: int, index: int) -> bytes | None:
            self.chunk_requests[version] += 1
            data = original_load(version, index)
            if data is None or not self.corrupt:
                return data
            return data[:-1] + bytes([data[-1] ^ 0x01])  # one flipped bit, same length

        async def on_manifest(peer_id: str, request: bytes) -> bytes:
            self.manifest_requests[decode(request, ManifestRequest).version or -1] += 1
            if self.replay is not None:
                return encode(ManifestResponse(manifest=self.replay))
            return await original_manifest(peer_id, request)

        self.node.server.load_chunk = load_chunk  # type: ignore[method-assign]
        self.node.server._on_manifest = on_manifest  # type: ignore[method-assign]

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def requests(self) -> int:
        return sum(self.chunk_requests.values()) + sum(self.manifest_requests.values())

    async def hold(self, v: Version, *, announce_as: int | None = None) -> None:
        """Hold ``v`` in full and announce every chunk (under ``announce_as`` if given)."""
        env, manifest, chunks = v
        self.node.store.seed(env, manifest, chunks)
        n = len(chunks)
        self.node.announcer.update(announce_as or manifest.version, frozenset(range(n)), n)
        await self.node.announcer.flush()


class World:
    """Bootstrap peer + honest seed (the coordinator's role) in the test process; hostile
    holders and victim processes on demand. Everything started here is stopped in ``close``."""

    def __init__(self, tmp: Path, boot_peer: SwarmPeer) -> None:
        self.tmp = tmp
        self.boot_peer = boot_peer
        self.coord = Identity.generate()
        self.seed = BroadcastNode(
            P2PTransport(boot_peer.p2p),
            ChunkStore(tmp / "seed", keep_versions=8),
            DhtHolderDirectory(boot_peer),
            self.coord.public_key,
        )
        self.seed_id = boot_peer.peer_id
        self.holders: list[Holder] = []
        self.victims: list[Victim] = []
        self.boot: list[str] = []

    async def start(self) -> None:
        self.boot = await self.boot_peer.visible_maddrs()
        await self.seed.start()

    async def publish(self, version: int) -> Version:
        """Sign ``version`` with the coordinator key and seed it in full (honestly)."""
        v = sign_version(self.coord, version)
        await self.seed.seed_version(v[0], v[2])
        return v

    async def holder(self) -> Holder:
        h = Holder(
            await start_loopback_peer(self.boot),
            self.tmp / f"holder{len(self.holders)}",
            self.coord.public_key,
        )
        self.holders.append(h)
        await h.node.start()
        return h

    async def victim(self, state: str = "victim") -> Victim:
        """A victim process; called again with the same ``state``: a restart on the same disk."""
        n = len(self.victims)
        v = Victim(self.tmp / state, self.boot[0], self.coord.fingerprint, self.tmp / f"v{n}.log")
        self.victims.append(v)
        await v.start()
        return v

    async def loaded(self, victim: Victim, version: int) -> dict[str, Any]:
        """``victim`` loads ``version`` from the seed: the honest weights, recorded as accepted."""
        reply = await victim.ensure(version, [self.seed_id])
        assert reply["ok"], f"{reply}\n{victim.tail()}"
        state: dict[str, Any] = reply["state"]
        assert state["loaded_version"] == version and state["highest_accepted"] == version
        assert state["digest"] == digest(version)
        return state

    async def close(self) -> None:
        async def stop_holder(h: Holder) -> None:
            await h.node.stop()
            await h.peer.stop()

        await asyncio.gather(
            *(v.close() for v in self.victims), *(stop_holder(h) for h in self.holders)
        )
        await self.seed.stop()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    boot = await start_loopback_peer()
    w = World(tmp_path, boot)
    try:
        await w.start()
        yield w
    finally:
        await w.close()
        await boot.stop()
    for v in w.victims:  # e.g. an abandoned chunk request whose failure nobody collected
        assert "never retrieved" not in v.log.read_text(errors="replace"), v.log.read_text()


def assert_untouched(state: dict[str, Any], loaded: int, bad_version: int | None) -> None:
    """Nothing loaded (weights and record still at ``loaded``), and no chunk of
    ``bad_version`` (None: an older version legitimately held) kept."""
    assert state["loaded_version"] == loaded and state["highest_accepted"] == loaded
    assert state["digest"] == digest(loaded)
    if bad_version is None:
        return
    assert state["store"].get(str(bad_version), []) == []
    prefix = f"v{bad_version:012d}/chunks/"
    assert not [f for f in state["files"] if f.startswith(prefix)], state["files"]


def assert_scored_down(state: dict[str, Any], bad: str, honest: str) -> None:
    scores = state["scores"]
    assert scores[bad]["bad_chunks"] >= 1 and scores[bad]["successes"] == 0, scores[bad]
    assert scores[bad]["score"] < scores[honest]["score"] / 10, scores


@pytest.mark.slow
async def test_corrupt_chunks_are_refused_and_the_holder_is_not_asked_again(world: World) -> None:
    victim, _ = await asyncio.gather(world.victim(), world.publish(1))
    await world.loaded(victim, 1)
    # v2 is signed and its manifest is at the seed, but only a corrupt holder has the chunks
    # (the window between the coordinator signing a version and the trainer seeding it).
    v2 = sign_version(world.coord, 2)
    world.seed.store.put_manifest(v2[0], v2[1])
    bad = await world.holder()
    bad.corrupt = True
    await bad.hold(v2)

    reply = await victim.ensure(2, [world.seed_id])
    assert not reply["ok"] and reply["error"] == "CheckpointUnavailable", reply
    # The one-line error says why: bad chunks from that peer, not only "the seed failed".
    assert "chunk_hash_mismatch" in reply["detail"] and bad.peer_id[:12] in reply["detail"]
    assert_untouched(reply["state"], 1, 2)
    assert reply["state"]["store"]["2"] == []  # the signed manifest is kept to resume from
    assert_scored_down(reply["state"], bad.peer_id, world.seed_id)
    asked = bad.chunk_requests[2]
    assert asked >= 1

    # The seed now holds v2: the victim loads the honest bytes, and never asks the peer that
    # served garbage again (it still announces every chunk, and is not a seed).
    await world.seed.seed_version(v2[0], v2[2])
    await world.loaded(victim, 2)
    assert bad.chunk_requests[2] == asked


@pytest.mark.slow
async def test_forged_or_expired_manifests_are_refused(world: World) -> None:
    victim, _ = await asyncio.gather(world.victim(), world.publish(1))
    await world.loaded(victim, 1)
    mallory = Identity.generate()
    forger = await world.holder()
    await forger.hold(sign_version(mallory, 2, weights_of=66))  # other weights, mallory's key

    reply = await victim.ensure(2, [world.seed_id])  # the seed does not hold v2 yet
    assert not reply["ok"] and reply["error"] == "CheckpointUnavailable", reply
    assert "bad_signature" in reply["detail"] and forger.peer_id[:12] in reply["detail"]
    assert forger.manifest_requests[2] == 1 and forger.chunk_requests[2] == 0
    assert_untouched(reply["state"], 1, 2)
    assert "2" not in reply["state"]["store"]
    assert_scored_down(reply["state"], forger.peer_id, world.seed_id)

    # Another holder replays a v2 manifest the coordinator did sign, but that has expired.
    replayer = await world.holder()
    await replayer.hold(sign_version(world.coord, 2, expired=True))
    reply = await victim.ensure(2, [world.seed_id])
    assert not reply["ok"] and reply["error"] == "CheckpointUnavailable", reply
    assert "manifest_invalid" in reply["detail"] and "expired" in reply["detail"]
    assert replayer.manifest_requests[2] == 1 and replayer.chunk_requests[2] == 0
    assert forger.manifest_requests[2] == 1  # not asked again
    assert_untouched(reply["state"], 1, 2)
    assert "2" not in reply["state"]["store"]
    assert_scored_down(reply["state"], replayer.peer_id, world.seed_id)

    # The coordinator's own v2 loads; both holders still announce theirs and are not asked.
    await world.publish(2)
    await world.loaded(victim, 2)
    assert forger.requests == 1 and replayer.requests == 1


@pytest.mark.slow
async def test_rollback_is_refused_before_and_after_a_crash(world: World) -> None:
    victim, v1 = await asyncio.gather(world.victim(), world.publish(1))
    await world.publish(2)
    await world.loaded(victim, 1)
    await world.loaded(victim, 2)
    replayer = await world.holder()
    await replayer.hold(v1)  # the genuine, validly signed v1

    # Asked outright for the older version: refused before any peer is contacted.
    reply = await victim.ensure(1, [replayer.peer_id])
    assert not reply["ok"] and reply["code"] == "version_not_newer", reply
    assert replayer.requests == 0
    assert_untouched(reply["state"], 2, None)

    # Asked for v3, a holder answers with the validly signed v1 manifest: refused, scored down.
    replayer.replay = v1[0]
    n = len(v1[2])
    replayer.node.announcer.update(3, frozenset(range(n)), n)
    await replayer.node.announcer.flush()
    reply = await victim.ensure(3, [world.seed_id])
    assert not reply["ok"] and reply["error"] == "CheckpointUnavailable", reply
    assert "manifest_invalid" in reply["detail"] and "asked v3, got v1" in reply["detail"]
    assert_untouched(reply["state"], 2, 3)
    assert "3" not in reply["state"]["store"]
    assert_scored_down(reply["state"], replayer.peer_id, world.seed_id)

    # A crash (SIGKILL, no clean-up) and a restart on the same disk: still no rollback.
    victim.crash()
    await victim.close()
    victim = await world.victim()
    asked = replayer.requests
    reply = await victim.ensure(1, [replayer.peer_id])
    assert not reply["ok"] and reply["code"] == "version_not_newer", reply
    assert reply["state"]["loaded_version"] is None and reply["state"]["highest_accepted"] == 2
    assert replayer.requests == asked
    await world.loaded(victim, 2)  # re-loading the accepted version itself is allowed
    await world.publish(3)
    await world.loaded(victim, 3)
