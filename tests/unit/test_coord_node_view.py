"""Per-node figures of /status (coordinator.node_view) and the holder census
(coordinator.dissemination), against the real core, store and reputation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from coord_harness import FakeClock, Harness, advert

from coordinator.dissemination import HolderCensus, coordinator_census
from coordinator.node_view import NODE_FIELDS, node_details
from coordinator.status import wire_status
from protocol.codec import decode
from protocol.identity import Identity
from protocol.messages import GpuInfo, Manifest, SignedEnvelope
from swarm import keys
from swarm.chunks import ChunkStore
from swarm.holders import HolderDirectory, MemoryHolderDirectory

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="alert(1)">'


def _register(h: Harness, peer: str, **changes: object) -> Identity:
    ident = Identity.generate()
    ad = msgspec.structs.replace(advert(ident, h.clock()), peer_id=peer, **changes)
    h.core.register(ident.public_key, ad)
    return ident


def test_node_details_carry_advert_reputation_and_holdings(tmp_path: Path) -> None:
    clock = FakeClock()
    h = Harness(tmp_path, clock, reputation={"strikes_to_ban": 2, "ban_base_s": 100.0})
    plain = _register(h, "QmPlain")
    gpu = GpuInfo(name=HOSTILE, memory_bytes=80 * 2**30, compute_capability="9.0", count=2)
    hostile = _register(
        h, "QmHostile", gpus=[gpu], cpu=None, price_per_hour=1.5,
        software_version="<b>evil</b>", backend="vllm", dtype="bfloat16",
    )  # fmt: skip
    h.core.reputation.strike(hostile.public_key, "bad_logprobs", "max_abs=3.5", clock())
    clock.advance(10)
    h.core.reputation.strike(hostile.public_key, "reward_mismatch", "claimed 1.0", clock())
    clock.advance(5)

    d = node_details(h.store, h.store.nodes(), {"QmPlain": [3, 4], "QmOther": [4]}, clock())
    assert set(d) == set(NODE_FIELDS)
    p, x = plain.fingerprint, hostile.fingerprint
    assert d["node_peer_id"] == {p: "QmPlain", x: "QmHostile"}
    assert d["node_hardware"][p] == "CPU 2 cores, 1.0 GiB"
    assert d["node_hardware"][x] == f"2× {HOSTILE} (80 GiB)"  # the node's words, unescaped
    assert d["node_software"][x] == "<b>evil</b>"
    assert d["node_backend"] == {p: "hf/float32", x: "vllm/bfloat16"}
    assert d["node_price_per_hour"] == {p: None, x: 1.5}
    assert d["node_versions_held"] == {p: [3, 4], x: []}
    assert d["node_strikes"] == {p: 0, x: 2}
    assert d["node_suspect"] == {p: False, x: True}
    assert d["node_last_error"] == {p: None, x: "reward_mismatch: claimed 1.0"}  # the latest
    assert d["node_last_error_age_s"][x] == 5.0
    assert d["node_ban_reason"][p] is None and "2 strikes" in d["node_ban_reason"][x]
    assert d["node_banned_for_s"][x] == 95.0
    clock.advance(200)  # the ban ran out: no reason shown, still a suspect
    later = node_details(h.store, h.store.nodes(), {}, clock())
    assert later["node_ban_reason"][x] is None and later["node_banned_for_s"][x] is None
    assert later["node_suspect"][x] is True


def test_node_details_fit_the_wire(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    ident = _register(h, "QmA")
    details = node_details(h.store, h.store.nodes(), {"QmA": [1, 2]}, h.clock())
    wire = wire_status(dict(details))
    assert wire["node_hardware"] == {ident.fingerprint: "CPU 2 cores, 1.0 GiB"}
    assert wire["node_versions_held"] == {ident.fingerprint: "[1, 2]"}  # scalars only in maps


class FlakyDirectory:
    """A holder directory whose lookups of some versions fail."""

    def __init__(self, inner: HolderDirectory) -> None:
        self.inner = inner
        self.failing: set[int] = set()

    async def publish(self, version: int, peer_id: str, bitmap: bytes, ttl: float) -> None:
        await self.inner.publish(version, peer_id, bitmap, ttl)

    async def lookup(self, version: int) -> dict[str, bytes]:
        if version in self.failing:
            raise TimeoutError("DHT lookup timed out")
        return await self.inner.lookup(version)


async def test_census_counts_registered_nodes_holding_every_chunk() -> None:
    mem = MemoryHolderDirectory()
    directory = FlakyDirectory(mem)
    full = keys.bitmap_from_indices(frozenset(range(10)), 10)
    part = keys.bitmap_from_indices(frozenset(range(9)), 10)
    await mem.publish(5, "QmA", full, 60)
    await mem.publish(5, "QmB", part, 60)  # still downloading: not a holder
    await mem.publish(5, "QmStranger", full, 60)  # never registered: not counted
    await mem.publish(4, "QmA", full, 60)
    await mem.publish(4, "QmB", full, 60)
    census = HolderCensus(
        directory,
        lambda: [(4, 10, range(10)), (5, 10, range(10)), (6, 10, range(10))],
        lambda: {"QmA", "QmB"},
    )
    await census.refresh()
    assert census.counts == {4: 2, 5: 1, 6: 0}
    assert census.by_peer == {"QmA": [4, 5], "QmB": [4]}
    assert census.taken_at is not None
    directory.failing = {4}  # a failed lookup keeps that version's last count
    await mem.publish(5, "QmB", full, 60)
    await census.refresh()
    assert census.counts == {4: 2, 5: 2, 6: 0}
    assert census.by_peer == {"QmA": [4, 5], "QmB": [4, 5]}


async def test_coordinator_census_follows_the_store(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    h.publish(2)
    _register(h, "QmA")
    chunks = ChunkStore(tmp_path / "chunks", keep_versions=3)
    for v in (1, 2):
        env = decode(h.store.get_version(v) or b"", SignedEnvelope)
        chunks.put_manifest(env, decode(env.payload, Manifest))
    mem = MemoryHolderDirectory()
    n = len(decode(decode(h.store.get_version(2) or b"", SignedEnvelope).payload, Manifest).chunks)
    await mem.publish(2, "QmA", keys.bitmap_from_indices(frozenset(range(n)), n), 60)
    census = coordinator_census(h.store, chunks, mem, keep=3)
    census.period = 0.01
    census.start()
    try:
        for _ in range(200):
            if census.taken_at is not None:
                break
            await asyncio.sleep(0.01)
    finally:
        await census.stop()
    assert census.counts == {1: 0, 2: 1}
