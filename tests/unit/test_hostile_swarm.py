"""Checkpoint download against lying peers and a full disk (in-memory transport, no sockets)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from test_swarm_broadcast_unit import make_version, node

from protocol.identity import Identity
from swarm import keys
from swarm.broadcast import CHUNK_RPC
from swarm.errors import BroadcastError
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork
from swarm.transport import HandlerError


async def test_a_holder_that_lies_in_its_bitmap_is_asked_once_per_chunk(tmp_path: Path) -> None:
    """A peer announcing every chunk but serving none ("not_held") must not soak up requests
    each time the holder records are re-read (they would restore its claim)."""
    coord = Identity.generate()
    files, env, manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(latency=0.02), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    receiver = node(net, dirs, tmp_path, "r", coord.public_key)
    await seed.start()
    await receiver.start()
    await seed.seed_version(env, chunks)
    n = len(manifest.chunks)
    liar = net.endpoint("liar")
    asked: list[bytes] = []

    async def not_held(peer: str, request: bytes) -> bytes:
        asked.append(request)
        raise HandlerError("not_held", "sorry")

    await liar.register(CHUNK_RPC, not_held)
    await dirs.publish(manifest.version, "liar", keys.bitmap_from_indices(range(n), n), 60.0)
    try:
        assert await receiver.download(manifest.version, ["seed"]) == files
    finally:
        await receiver.stop()
        await seed.stop()
    assert 0 < len(asked) <= n


async def test_a_checkpoint_larger_than_the_free_disk_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = Identity.generate()
    _files, env, manifest, chunks = make_version(coord)
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    receiver = node(net, dirs, tmp_path, "r", coord.public_key)
    await seed.start()
    await receiver.start()
    await seed.seed_version(env, chunks)
    real = shutil.disk_usage

    def tiny(path: Any) -> Any:
        return real(path)._replace(free=manifest.total_size // 2)

    monkeypatch.setattr(shutil, "disk_usage", tiny)
    calls = net.lookup("seed").calls  # type: ignore[union-attr]
    try:
        with pytest.raises(BroadcastError, match="disk"):
            await receiver.download(manifest.version, ["seed"])
    finally:
        await receiver.stop()
        await seed.stop()
    assert net.lookup("seed").calls == calls + 1  # type: ignore[union-attr]  # the manifest only
    assert receiver.store.have(manifest.version) == frozenset()


async def test_send_counters_do_not_outlive_the_versions_held(tmp_path: Path) -> None:
    """A long run publishes thousands of versions; per-chunk counters of pruned ones must go."""
    coord = Identity.generate()
    net, dirs = InMemoryNetwork(), MemoryHolderDirectory()
    seed = node(net, dirs, tmp_path, "seed", coord.public_key)
    seed.store.keep_versions = 2
    await seed.start()
    try:
        for version in range(1, 6):
            _files, env, _manifest, chunks = make_version(coord, version)
            await seed.seed_version(env, chunks)
            receiver = node(net, dirs, tmp_path, f"r{version}", coord.public_key)
            await receiver.start()
            await receiver.download(version, ["seed"])
            await receiver.stop()
        held = sum(len(seed.store.have(v)) for v in seed.store.versions())
        assert seed.store.versions() == [4, 5]
        assert len(seed.server._sent) <= held and len(seed.server._last_sent) <= held
    finally:
        await seed.stop()
