"""node.checkpoints: verified loading, no rollback across restarts, refusal of forged versions.

In-memory transport (no sockets): a seed BroadcastNode holds signed versions; the node's
BroadcastNode downloads them through the CheckpointManager into a recording backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from node.checkpoints import (
    ACCEPTED_FILE,
    AcceptedVersion,
    CheckpointError,
    CheckpointManager,
    CheckpointRefused,
)
from protocol.codec import encode
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, root_hash, sign_manifest
from protocol.messages import ChunkInfo, Manifest, SignedEnvelope
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.fetcher import DownloadConfig
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork

FAST = DownloadConfig(
    seed_backoff=0.01, max_seed_failures=2, seed_grace=0.1, manifest_timeout=2.0,
    manifest_deadline=1.0,
)  # fmt: skip


class RecordingBackend:
    """Just what CheckpointManager needs: loaded_version + load_state_dict."""

    def __init__(self) -> None:
        self.loaded_version: int | None = None
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.changed: list[frozenset[str] | None] = []

    def load_state_dict(
        self, version: int, state_dict: Mapping[str, Any], changed: Any = None
    ) -> None:
        self.loads.append((version, dict(state_dict)))
        self.changed.append(None if changed is None else frozenset(changed))
        self.loaded_version = version


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((8, 8), float(version)), "layer.bias": torch.arange(8.0)}


def signed(
    signer: Identity, version: int, *, chunk_size: int = 256
) -> tuple[SignedEnvelope, Manifest, list[bytes]]:
    now = time.time()
    manifest, chunks = build_manifest(
        state_dict_to_files(weights(version)),
        version=version,
        parent_version=version - 1 if version > 1 else None,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=now,
        expires_at=now + 3600,
        chunk_size=chunk_size,
    )
    return sign_manifest(manifest, signer, now), manifest, chunks


class World:
    def __init__(self, tmp: Path, *, keep_versions: int = 3) -> None:
        self.tmp = tmp
        self.net = InMemoryNetwork()
        self.dirs = MemoryHolderDirectory()
        self.coord = Identity.generate()
        self.seed_store = ChunkStore(tmp / "seed", keep_versions=10)
        self.seed = BroadcastNode(
            self.net.endpoint("seed"), self.seed_store, self.dirs, self.coord.public_key
        )
        self.keep_versions = keep_versions
        self.node: BroadcastNode | None = None

    async def start(self) -> None:
        await self.seed.start()

    async def publish(self, version: int, signer: Identity | None = None) -> None:
        env, manifest, chunks = signed(signer or self.coord, version)
        self.seed_store.seed(env, manifest, chunks)  # bypasses the seed's own verification

    async def manager(
        self, name: str = "node", config: DownloadConfig = FAST
    ) -> tuple[CheckpointManager, RecordingBackend]:
        """A fresh node process on the same state dir (a restart when called twice)."""
        if self.node is not None:
            await self.node.stop()
            self.net.disconnect("node")
        self.node = BroadcastNode(
            self.net.endpoint("node"),
            ChunkStore(self.tmp / name / "checkpoints", keep_versions=self.keep_versions),
            self.dirs,
            bytes(32),
            config=config,
        )
        await self.node.start()
        backend = RecordingBackend()
        mgr = CheckpointManager(
            self.node,
            backend,
            state_dir=self.tmp / name,
            coordinator_fingerprint=self.coord.fingerprint,
            seeds=lambda: ["seed"],
            download_timeout_s=10.0,
            progress=False,
        )
        return mgr, backend

    async def close(self) -> None:
        for n in (self.node, self.seed):
            if n is not None:
                await n.stop()


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = World(tmp_path)
    await w.start()
    yield w
    await w.close()


async def test_loads_verified_version_and_records_it(world: World) -> None:
    await world.publish(1)
    mgr, backend = await world.manager()
    await mgr.ensure(1)
    assert backend.loaded_version == 1
    version, sd = backend.loads[0]
    assert version == 1 and torch.equal(sd["layer.weight"], weights(1)["layer.weight"])
    assert mgr.highest_accepted == 1
    record = json.loads((world.tmp / "node" / ACCEPTED_FILE).read_text())
    assert record["accepted"] == {world.coord.fingerprint: 1}
    await mgr.ensure(1)  # already loaded: no second download or load
    assert len(backend.loads) == 1


async def test_switches_to_newer_versions_and_keeps_s_plus_1(world: World) -> None:
    mgr, backend = await world.manager()
    for v in (1, 2, 3, 4):
        await world.publish(v)
        await mgr.ensure(v)
        assert backend.loaded_version == v
    assert world.node is not None
    assert world.node.store.versions() == [2, 3, 4]  # keep_versions = S + 1 = 3


async def test_older_version_refused_even_after_restart(world: World) -> None:
    await world.publish(1)
    await world.publish(2)
    mgr, backend = await world.manager()
    await mgr.ensure(2)
    with pytest.raises(CheckpointRefused) as err:
        await mgr.ensure(1)
    assert err.value.code is ReasonCode.VERSION_NOT_NEWER
    assert backend.loaded_version == 2 and len(backend.loads) == 1

    mgr2, backend2 = await world.manager()  # restart: same state dir, empty backend
    with pytest.raises(CheckpointRefused, match="roll back"):
        await mgr2.ensure(1)
    assert backend2.loads == []
    await mgr2.ensure(2)  # re-loading the accepted version itself is not a rollback
    assert backend2.loaded_version == 2


async def test_tampered_manifest_is_refused_and_nothing_loaded(world: World) -> None:
    env, manifest, chunks = signed(world.coord, 1)
    evil_chunks = list(chunks)
    evil_chunks[0] = bytes([chunks[0][0] ^ 1]) + chunks[0][1:]
    infos = list(manifest.chunks)
    from protocol.manifest import chunk_digest

    infos[0] = msgspec.structs.replace(infos[0], hash=chunk_digest("sha256", evil_chunks[0]))
    evil = msgspec.structs.replace(
        manifest, chunks=infos, root_hash=root_hash("sha256", list[ChunkInfo](infos))
    )
    tampered = msgspec.structs.replace(env, payload=encode(evil))  # original signature kept
    world.seed_store.seed(tampered, evil, evil_chunks)
    mgr, backend = await world.manager()
    with pytest.raises(CheckpointError, match="bad_signature"):
        await mgr.ensure(1)
    assert backend.loads == [] and mgr.highest_accepted is None


async def test_manifest_signed_by_another_key_is_refused(world: World) -> None:
    await world.publish(1, signer=Identity.generate())
    mgr, backend = await world.manager()
    with pytest.raises(CheckpointError, match="pinned"):
        await mgr.ensure(1)
    assert backend.loads == []

    # Once the pinned key is known, a later version signed by someone else is refused too.
    world.seed_store.prune(protect=())
    await world.publish(2)
    await mgr.ensure(2)
    await world.publish(3, signer=Identity.generate())
    with pytest.raises(CheckpointError, match="pinned"):
        await mgr.ensure(3)
    assert backend.loaded_version == 2 and mgr.highest_accepted == 2


async def test_corrupt_chunks_are_never_loaded(world: World) -> None:
    await world.publish(1)

    def flip(version: int, index: int) -> bytes | None:
        data = world.seed_store.get_chunk(version, index)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]

    world.seed.server.load_chunk = flip  # type: ignore[method-assign]
    mgr, backend = await world.manager()
    with pytest.raises(CheckpointError, match="chunk"):
        await mgr.ensure(1)
    assert backend.loads == [] and mgr.highest_accepted is None


async def test_files_are_reverified_after_download(world: World) -> None:
    """Defence in depth: bytes handed back by the download path are checked again."""
    await world.publish(1)
    mgr, backend = await world.manager()
    assert world.node is not None
    original = world.node.download

    async def lying_download(version: int | None, seeds: Any, **kw: Any) -> dict[str, bytes]:
        files = await original(version, seeds, **kw)
        return {k: v[:-1] + bytes([v[-1] ^ 1]) for k, v in files.items()}

    world.node.download = lying_download  # type: ignore[method-assign]
    with pytest.raises(CheckpointRefused) as err:
        await mgr.ensure(1)
    assert err.value.code is ReasonCode.CHUNK_HASH_MISMATCH
    assert backend.loads == []


def test_accepted_version_never_decreases_and_is_per_key(tmp_path: Path) -> None:
    path = tmp_path / ACCEPTED_FILE
    a = AcceptedVersion(path, "ed25519:a")
    assert a.get() is None
    a.set(3)
    a.set(2)
    assert a.get() == 3
    b = AcceptedVersion(path, "ed25519:b")
    assert b.get() is None
    b.set(1)
    assert AcceptedVersion(path, "ed25519:a").get() == 3
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temp file


def test_unreadable_record_is_an_error_not_a_reset(tmp_path: Path) -> None:
    path = tmp_path / ACCEPTED_FILE
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable"):
        AcceptedVersion(path, "ed25519:a").get()


async def test_a_lease_on_the_loaded_version_does_not_wait_for_a_prefetch(world: World) -> None:
    """A heartbeat announced v2 and the node started prefetching it, but its seed does not hold
    v2 yet (the download retries). A lease on v1, already loaded, starts at once: in the
    capacity demos such a lease waited 2 s for the prefetch's lock."""
    await world.publish(1)
    # a node's real back-off from a seed that does not serve the version yet: 1 s, then 2 s...
    patient = DownloadConfig(seed_backoff=1.0, max_seed_failures=5, seed_grace=5.0)
    mgr, backend = await world.manager(config=patient)
    await mgr.ensure(1)
    env, manifest, _ = signed(world.coord, 2)
    world.seed_store.put_manifest(env, manifest)  # published, its chunks not there yet
    prefetch = asyncio.create_task(mgr.prefetch(2))
    await asyncio.sleep(0.2)
    assert not prefetch.done()  # still trying to download v2
    await asyncio.wait_for(mgr.ensure(1), 1.0)
    assert backend.loaded_version == 1 and len(backend.loads) == 1
    prefetch.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await prefetch
