"""Broadcast logic on the in-memory transport: no sockets, no DHT."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import pytest

from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Manifest, SignedEnvelope
from swarm.broadcast import CHUNK_RPC, EXCHANGE_RPC, EXCHANGE_WINDOWED_RPC, BroadcastNode
from swarm.chunks import ChunkStore
from swarm.errors import ChunkUnavailable, ManifestUnavailable
from swarm.fetcher import DownloadConfig
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork

CHUNK = 4096


def make_version(
    coord: Identity, version: int = 1, size: int = 10 * CHUNK + 123
) -> tuple[dict[str, bytes], SignedEnvelope, Manifest, list[bytes]]:
    files = {"model.safetensors": os.urandom(size), "extra.bin": os.urandom(CHUNK + 7)}
    now = time.time()
    manifest, chunks = build_manifest(
        files,
        version=version,
        parent_version=None,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=now,
        expires_at=now + 3600,
        chunk_size=CHUNK,
    )
    return files, sign_manifest(manifest, coord, now), manifest, chunks


class CorruptNode(BroadcastNode):
    """Serves every chunk with one byte flipped."""

    async def start(self) -> None:
        self.server.load_chunk = self._corrupt  # type: ignore[method-assign]
        await super().start()

    def _corrupt(self, version: int, index: int) -> bytes | None:
        data = self.store.get_chunk(version, index)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


def node(
    net: InMemoryNetwork,
    dirs: MemoryHolderDirectory,
    tmp: Path,
    name: str,
    key: bytes,
    cls: type[BroadcastNode] = BroadcastNode,
) -> BroadcastNode:
    cfg = DownloadConfig(
        holders_refresh=0.01, seed_backoff=0.01, busy_backoff=0.01, seed_parallel=1,
        seed_grace=0.2, manifest_deadline=1.0,
    )  # fmt: skip
    return cls(
        net.endpoint(name), ChunkStore(tmp / name), dirs, key, config=cfg, announce_interval=0.005
    )


async def test_peers_and_bad_peer(tmp_path: Path) -> None:
    coord = Identity.generate()
    files, env, manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(latency=0.02), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    bad = node(net, dirs, tmp_path, "bad", coord.public_key, CorruptNode)
    receivers = [node(net, dirs, tmp_path, f"r{i}", coord.public_key) for i in range(3)]
    for n in (seed, bad, *receivers):
        await n.start()
    await seed.seed_version(env, chunks)
    await bad.seed_version(env, chunks)  # claims every chunk, serves garbage
    progress: list[tuple[int, int]] = []
    results = await asyncio.gather(
        receivers[0].download(1, ["seed"], on_progress=lambda d, t: progress.append((d, t))),
        *(r.download(1, ["seed"]) for r in receivers[1:]),
    )
    for got in results:
        assert got == files
    assert progress[-1] == (manifest.total_size, manifest.total_size)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(progress))
    for r in receivers:
        stats = r.scores.stats("bad")
        assert stats.bad_chunks >= 1 and stats.successes == 0
        assert r.scores.score("bad") < r.scores.score("seed")
    relayed = sum(
        count
        for r in receivers
        if r.downloader.last_transfer is not None
        for peer, count in r.downloader.last_transfer.sources.items()
        if peer.startswith("r")
    )
    assert relayed > 0, "receivers never fetched from each other"
    for n in (seed, bad, *receivers):
        await n.stop()


async def test_resume_from_verified_chunks_on_disk(tmp_path: Path) -> None:
    coord = Identity.generate()
    files, env, manifest, chunks = make_version(coord)
    store = ChunkStore(tmp_path / "r")
    store.put_manifest(env, manifest)
    for i in (0, 1, 2):
        store.put_chunk(1, i, chunks[i])
    # a corrupted file on disk and a torn temp file are discarded on reopen
    chunk_dir = tmp_path / "r" / "v000000000001" / "chunks"
    (chunk_dir / "000003.bin").write_bytes(b"junk")
    (chunk_dir / "000004.bin.tmp").write_bytes(b"torn")
    reopened = ChunkStore(tmp_path / "r")
    assert reopened.have(1) == {0, 1, 2}
    assert not (chunk_dir / "000003.bin").exists()

    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    await seed.start()
    await seed.seed_version(env, chunks)
    receiver = BroadcastNode(net.endpoint("r"), reopened, dirs, coord.public_key)
    await receiver.start()
    assert await receiver.download(1, ["seed"]) == files
    assert seed.server.chunks_served == len(chunks) - 3
    await receiver.stop()
    await seed.stop()


async def test_wrong_key_and_missing_seed(tmp_path: Path) -> None:
    coord, other = Identity.generate(), Identity.generate()
    _files, env, _manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    await seed.start()
    await seed.seed_version(env, chunks)
    victim = node(net, dirs, tmp_path, "v", other.public_key)  # pinned the wrong key
    with pytest.raises(ManifestUnavailable, match="pinned"):
        await victim.download(1, ["seed"])
    # the seed vanishes after the manifest: the receiver gives up with a clear error
    r = node(net, dirs, tmp_path, "r", coord.public_key)
    r.store.put_manifest(*await r.downloader.fetch_manifest(1, ["seed"]))
    net.disconnect("seed")
    dirs.bitmaps.clear()
    with pytest.raises(ChunkUnavailable, match="seed failed"):
        await r.download(1, ["seed"])
    await seed.stop()


def test_retention_keeps_last_k(tmp_path: Path) -> None:
    coord = Identity.generate()
    store = ChunkStore(tmp_path, keep_versions=2)
    for v in (1, 2, 3):
        _f, env, manifest, chunks = make_version(coord, version=v, size=100)
        store.seed(env, manifest, chunks)
    assert store.prune() == [1]
    assert store.versions() == [2, 3]
    assert ChunkStore(tmp_path, keep_versions=2).versions() == [2, 3]


async def test_endgame_hedges_a_stuck_peer(tmp_path: Path) -> None:
    """A holder that accepts the request and then says nothing must not hold the download for the
    whole stall timeout: after ``hedge_after`` the chunk is also asked of the seed."""
    coord = Identity.generate()
    files, env, _, chunks = make_version(coord, size=CHUNK // 2)  # a few small chunks
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    stuck = node(net, dirs, tmp_path, "stuck", coord.public_key)
    for n in (seed, stuck):
        await n.start()
    await seed.seed_version(env, chunks)
    await stuck.seed_version(env, chunks)
    for rpc in (CHUNK_RPC, EXCHANGE_RPC, EXCHANGE_WINDOWED_RPC):  # accepts, never answers
        await stuck.server.transport.register(rpc, _never_answer)
    cfg = DownloadConfig(holders_refresh=0.01, stall_timeout=30.0, hedge_after=0.2)
    receiver = BroadcastNode(
        net.endpoint("r"), ChunkStore(tmp_path / "r"), dirs, coord.public_key, config=cfg
    )
    await receiver.start()
    t0 = time.monotonic()
    got = await asyncio.wait_for(receiver.download(1, ["seed"]), 10.0)
    assert got == files
    assert time.monotonic() - t0 < 5.0, "the stuck peer held the download"
    transfer = receiver.downloader.last_transfer
    assert transfer is not None and transfer.hedged, "no chunk was hedged"
    assert transfer.sources["seed"] >= 1 and transfer.sources["stuck"] == 0
    for n in (receiver, seed, stuck):
        await n.stop()


async def _never_answer(peer_id: str, request: bytes) -> bytes:
    await asyncio.sleep(3600)
    return b""


async def test_a_lone_receiver_asks_the_seed_for_no_chunk_twice(tmp_path: Path) -> None:
    """The seed is asked for *any* chunk of the leftover, ``seed_parallel`` requests at a time.
    At the tail, fewer chunks are left than requests could be opened: asking for "any of {a}"
    twice made the seed send chunk a twice, one chunk of the seed's uplink wasted per receiver
    and version. No more "any" requests are open than chunks are left to ask for."""
    coord = Identity.generate()
    files, env, _manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(latency=0.01), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    cfg = DownloadConfig(holders_refresh=0.01, seed_parallel=4, manifest_deadline=1.0)
    receiver = BroadcastNode(
        net.endpoint("r"), ChunkStore(tmp_path / "r"), dirs, coord.public_key, config=cfg
    )
    for n in (seed, receiver):
        await n.start()
    await seed.seed_version(env, chunks)
    assert await receiver.download(1, ["seed"]) == files
    assert seed.server.chunks_served == len(chunks)
    for n in (seed, receiver):
        await n.stop()


class SlowDirectory(MemoryHolderDirectory):
    """A DHT whose holder lookups take ``delay`` seconds (a real one: 0.4-1.0 s at GO)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def lookup(self, version: int) -> dict[str, bytes]:
        await asyncio.sleep(self.delay)
        return await super().lookup(version)


@pytest.mark.parametrize("delay", [0.05, 5.0])
async def test_a_transfer_marks_its_start_up_steps(tmp_path: Path, delay: float) -> None:
    """The benchmark's "where the time went" reads these marks: the request waits for the first
    lookup (at most ``first_lookup``), the first byte comes after it, and a lookup the transfer
    cancelled on its way out is no mark."""
    coord = Identity.generate()
    files, env, _manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(latency=0.01), SlowDirectory(delay)
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    cfg = DownloadConfig(holders_refresh=0.01, first_lookup=0.3, manifest_deadline=1.0)
    receiver = BroadcastNode(
        net.endpoint("r"), ChunkStore(tmp_path / "r"), dirs, coord.public_key, config=cfg
    )
    for n in (seed, receiver):
        await n.start()
    await seed.seed_version(env, chunks)
    assert await receiver.download(1, ["seed"]) == files
    marks = receiver.downloader.last_transfer.marks  # type: ignore[union-attr]
    assert marks["start"] <= marks["request"] <= marks["byte"]
    if delay < 0.3:
        assert marks["start"] + delay <= marks["lookup"] <= marks["request"]
    else:  # waited first_lookup, then asked; the lookup was still running at the end
        assert marks["request"] >= marks["start"] + 0.3 and "lookup" not in marks
    for n in (seed, receiver):
        await n.stop()
