"""Delta versions through the broadcast (in-memory transport): a node holding the base fetches
only the delta and gets the signed full checkpoint bit for bit; without the base it takes the
cheapest of chain and full; and every bad delta (base missing, reconstruction mismatch,
truncated or oversized, a chain with a gap) is refused with a reason, the serving peer scored
down where it served bad bytes, and the full checkpoint fetched instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.delta import encode_delta, tensor_infos
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, part_indices, part_size, sign_manifest
from protocol.messages import DeltaInfo, Manifest, SignedEnvelope
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.fetcher import DownloadConfig
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork
from swarm.publication import DELTA_FILE, PublishPolicy, VersionBuilder, held_base

CHUNK = 8192
FAST = DownloadConfig(
    holders_refresh=0.01,
    seed_backoff=0.01,
    busy_backoff=0.01,
    max_seed_failures=3,
    seed_grace=2.0,  # give up on a seed after 3 failures over 2 s (default 30 s)
    manifest_timeout=2.0,
)


def weights(version: int) -> dict[str, torch.Tensor]:
    """bf16 weights; each version flips ~1% of the elements of the previous one."""
    gen = torch.Generator().manual_seed(0)
    w = {
        "embed.weight": torch.randn(64, 96, generator=gen),
        "layer.weight": torch.randn(96, 96, generator=gen),
        "layer.bias": torch.randn(96, generator=gen),
        "norm.weight": torch.ones(96),
    }
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for name in ("embed.weight", "layer.weight"):
            t = w[name]
            hit = torch.rand(t.shape, generator=g) < 0.01
            w[name] = torch.where(hit, t * 1.05, t)
    return {k: t.to(torch.bfloat16) for k, t in w.items()}


def files_of(version: int) -> dict[str, bytes]:
    return state_dict_to_files(weights(version))


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.net = InMemoryNetwork()
        self.dirs = MemoryHolderDirectory()
        self.coord = Identity.generate()
        self.seed_store = ChunkStore(tmp / "seed", keep_versions=20)
        self.seed = BroadcastNode(
            self.net.endpoint("seed"), self.seed_store, self.dirs, self.coord.public_key
        )
        self.builder = VersionBuilder(
            model_config_hash="ab", tokenizer_hash="cd", chunk_size=CHUNK, policy=PublishPolicy()
        )
        self.manifests: dict[int, tuple[SignedEnvelope, Manifest, list[bytes]]] = {}
        self.nodes: list[BroadcastNode] = []

    def sign(self, manifest: Manifest) -> SignedEnvelope:
        return sign_manifest(manifest, self.coord, time.time())

    def build(self, version: int, *, keyframe: bool = False) -> tuple[SignedEnvelope, Manifest]:
        """Build ``version`` (a delta against the newest built one unless ``keyframe``)."""
        prev = max(self.manifests) if self.manifests else None
        base = None
        if prev is not None and not keyframe:
            store = ChunkStore(self.tmp / f"build-{version}")
            env, m, chunks = self.manifests[prev]
            store.seed(env, m, chunks)
            base = held_base(store, prev)
        now = time.time()
        built = self.builder.build(
            files_of(version),
            version=version,
            parent_version=prev,
            base=base,
            created_at=now,
            expires_at=now + 3600,
            force_keyframe=keyframe,
        )
        env = self.sign(built.manifest)
        self.manifests[version] = (env, built.manifest, built.chunks)
        return env, built.manifest

    def seed_version(self, version: int, manifest: Manifest | None = None) -> None:
        env, m, chunks = self.manifests[version]
        self.seed_store.seed(env, m, chunks)

    def publish(self, version: int, *, keyframe: bool = False) -> Manifest:
        self.build(version, keyframe=keyframe)
        self.seed_version(version)
        return self.manifests[version][1]

    async def node(self, name: str, cls: type[BroadcastNode] = BroadcastNode) -> BroadcastNode:
        n = cls(
            self.net.endpoint(name),
            ChunkStore(self.tmp / name, keep_versions=5),
            self.dirs,
            self.coord.public_key,
            config=FAST,
            announce_interval=0.005,
        )
        await n.start()
        self.nodes.append(n)
        return n

    async def close(self) -> None:
        for n in [*self.nodes, self.seed]:
            await n.stop()


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = World(tmp_path)
    await w.seed.start()
    yield w
    await w.close()


def codes(node: BroadcastNode) -> list[ReasonCode]:
    return [r.code for r in node.sync.refusals]


async def test_holder_of_the_base_fetches_only_the_delta(world: World) -> None:
    world.publish(1)
    m2 = world.publish(2)
    assert m2.delta is not None and m2.delta.base_version == 1
    node = await world.node("node")
    assert await node.download(1, ["seed"]) == files_of(1)
    assert node.sync.last is not None and node.sync.last.path == "full"
    files = await node.download(2, ["seed"])
    assert files == files_of(2)  # bit for bit
    last = node.sync.last
    assert last is not None and last.path == "delta"
    assert last.fetched_bytes == part_size(m2, "delta") < 0.2 * part_size(m2, "full")
    assert node.store.is_complete(2) and node.store.is_complete(2, "delta")
    assert codes(node) == []
    # the reconstructed full checkpoint is served to others: a fresh peer gets it from `node`
    world.net.disconnect("seed")
    other = await world.node("other")
    assert await other.download(2, ["node"]) == files_of(2)


async def test_node_without_the_base_fetches_the_full_checkpoint(world: World) -> None:
    world.publish(1)
    world.publish(2)
    node = await world.node("node")
    assert await node.download(2, ["seed"]) == files_of(2)
    assert node.sync.last is not None and node.sync.last.path == "full"
    assert codes(node) == [ReasonCode.DELTA_BASE_MISSING]
    assert not node.store.is_complete(2, "delta")


async def test_chain_of_deltas_from_a_held_version(world: World) -> None:
    world.publish(1)
    world.publish(2)
    m3 = world.publish(3)
    node = await world.node("node")
    await node.download(1, ["seed"])
    assert await node.download(3, ["seed"]) == files_of(3)
    last = node.sync.last
    assert last is not None and last.path == "delta"
    assert last.fetched_bytes == part_size(world.manifests[2][1], "delta") + part_size(m3, "delta")
    assert node.store.is_complete(2)  # the intermediate version is held (and servable) too


async def test_keyframe_plus_chain_when_that_is_fewer_bytes(world: World) -> None:
    m1 = world.publish(1)
    env1 = world.manifests[1][0]
    world.publish(2)
    node = await world.node("node")
    node.store.put_manifest(env1, m1)  # a resumed download: all but one chunk of v1 held
    full1 = part_indices(m1, "full")
    for i in full1[1:]:
        node.store.put_chunk(1, i, world.manifests[1][2][i])
    assert await node.download(2, ["seed"]) == files_of(2)
    last = node.sync.last
    assert last is not None and last.path == "chain"
    assert last.fetched_bytes == m1.chunks[full1[0]].size + part_size(
        world.manifests[2][1], "delta"
    )


async def test_chain_with_a_gap_falls_back_to_full(world: World) -> None:
    world.publish(1)
    world.build(2)  # v2 is never served by anyone
    world.publish(3)
    node = await world.node("node")
    await node.download(1, ["seed"])
    assert await node.download(3, ["seed"]) == files_of(3)
    assert node.sync.last is not None and node.sync.last.path == "full"
    assert codes(node) == [ReasonCode.DELTA_CHAIN_GAP]


def forged_delta(
    world: World, version: int, delta: bytes, tensors_from: dict[str, bytes]
) -> Manifest:
    """A signed delta version whose full part is the real weights of ``version`` but whose
    delta / tensor list say something else (a publisher bug or compromise)."""
    base_m = world.manifests[version - 1][1]
    now = time.time()
    manifest, chunks = build_manifest(
        {**files_of(version), DELTA_FILE: delta},
        version=version,
        parent_version=version - 1,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=now,
        expires_at=now + 3600,
        chunk_size=CHUNK,
        hash="blake3",
        tensors=tensor_infos(tensors_from, "blake3"),
        delta=DeltaInfo(
            base_version=version - 1, base_root_hash=base_m.root_hash, files=[DELTA_FILE]
        ),
    )
    world.manifests[version] = (world.sign(manifest), manifest, chunks)
    world.seed_version(version)
    return manifest


@pytest.mark.parametrize("case", ["digests", "chunks", "truncated", "oversized"])
async def test_signed_bad_delta_is_refused_and_full_is_used(world: World, case: str) -> None:
    m1 = world.publish(1)
    assert m1.tensors is not None
    real, other = files_of(2), files_of(3)
    if case == "digests":  # delta makes v3's weights; the signed digests are v2's
        forged_delta(world, 2, encode_delta(files_of(1), other, m1.tensors).data, real)
    elif case == "chunks":  # delta and digests agree, but not with the signed full checkpoint
        delta = encode_delta(files_of(1), other, tensor_infos(other, "blake3")).data
        forged_delta(world, 2, delta, other)
    else:
        good = encode_delta(files_of(1), real, tensor_infos(real, "blake3")).data
        delta = good[:-5] if case == "truncated" else good + b"\x00" * 5
        forged_delta(world, 2, delta, real)
    node = await world.node("node")
    await node.download(1, ["seed"])
    assert await node.download(2, ["seed"]) == real
    assert node.sync.last is not None and node.sync.last.path == "full"
    expected = (
        ReasonCode.DELTA_MISMATCH if case in ("digests", "chunks") else ReasonCode.DELTA_INVALID
    )
    assert codes(node) == [expected]
    assert node.scores.score("seed") > 0  # relays of signed bytes are not blamed


def lying(transform: Callable[[bytes], bytes]) -> type[BroadcastNode]:
    """A relay that serves the delta chunks it holds through ``transform``."""

    class Liar(BroadcastNode):
        async def start(self) -> None:
            self.server.load_chunk = self._serve  # type: ignore[method-assign]
            await super().start()

        def _serve(self, version: int, index: int) -> bytes | None:
            data = self.store.get_chunk(version, index)
            entry = self.store.manifest(version)
            if data is None or entry is None or index not in part_indices(entry[1], "delta"):
                return data
            return transform(data)

    return Liar


@pytest.mark.parametrize(
    "transform",
    [lambda d: d[:-1], lambda d: d + b"!", lambda d: bytes([d[0] ^ 1]) + d[1:]],
    ids=["truncated", "oversized", "altered"],
)
async def test_relay_serving_bad_delta_chunks_is_scored_down(
    world: World, transform: Callable[[bytes], bytes]
) -> None:
    world.publish(1)
    world.publish(2)
    liar = await world.node("liar", lying(transform))
    await liar.download(1, ["seed"])
    await liar.download(2, ["seed"])  # holds v2's delta and announces it
    node = await world.node("node")
    await node.download(1, ["seed"])
    assert await node.download(2, ["seed"]) == files_of(2)
    assert node.sync.last is not None and node.sync.last.path == "delta"  # delta from the seed
    assert node.scores.shunned("liar")
    assert node.downloader.last_transfer is not None
    assert node.downloader.last_transfer.bad.get("liar") == "chunk_hash_mismatch"


async def test_delta_nobody_serves_right_falls_back_to_full(world: World) -> None:
    """The only holder of the delta serves it truncated, the seed no longer serves deltas: the
    delta is refused, the relay scored down, and the full checkpoint fetched instead."""
    world.publish(1)
    m2 = world.publish(2)
    liar = await world.node("liar", lying(lambda d: d[:-1]))
    await liar.download(1, ["seed"])
    await liar.download(2, ["seed"])
    delta_chunks = set(part_indices(m2, "delta"))
    serve = world.seed.server.load_chunk

    def no_deltas(version: int, index: int) -> bytes | None:
        return None if version == 2 and index in delta_chunks else serve(version, index)

    world.seed.server.load_chunk = no_deltas  # type: ignore[method-assign]
    node = await world.node("node")
    await node.download(1, ["seed"])
    assert await node.download(2, ["seed"]) == files_of(2)
    assert node.sync.last is not None and node.sync.last.path == "full"
    assert codes(node) == [ReasonCode.DELTA_CHAIN_GAP]
    assert node.scores.shunned("liar")


async def test_base_with_another_root_is_not_used(world: World) -> None:
    """The node's v1 is not the v1 the delta was made against (a reset swarm re-published v1
    with other weights): no delta is applied to it."""
    world.publish(1)
    m2 = world.publish(2)
    node = await world.node("node")
    now = time.time()
    m1b, chunks = build_manifest(
        files_of(5),
        version=1,
        parent_version=None,
        model_config_hash="ab",
        tokenizer_hash="cd",
        created_at=now,
        expires_at=now + 3600,
        chunk_size=CHUNK,
        hash="blake3",
        tensors=tensor_infos(files_of(5), "blake3"),
    )
    node.store.seed(world.sign(m1b), m1b, chunks)
    assert await node.download(2, ["seed"]) == files_of(2)
    assert node.sync.last is not None and node.sync.last.path == "full"
    assert codes(node) == [ReasonCode.DELTA_BASE_MISSING]
    assert m2.delta is not None and m2.delta.base_root_hash != m1b.root_hash


def test_rebuilt_checkpoint_loads_as_views_equal_to_a_normal_load() -> None:
    from swarm.checkpoint_io import files_to_state_dict

    sd = {
        "bf": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(7),
        "i64": torch.arange(4),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    files = state_dict_to_files(sd)
    normal = files_to_state_dict(files)
    views = files_to_state_dict({k: bytearray(v) for k, v in files.items()})
    assert normal.keys() == views.keys() == sd.keys()
    for name, t in sd.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape, name
        assert torch.equal(views[name], normal[name]) and torch.equal(views[name], t), name


async def test_fetches_run_side_by_side_and_share_chain_links(world: World) -> None:
    """A version nobody serves yet does not hold up the next one (the coordinator fetches each
    published version as it appears), and two fetches that need the same link apply it once."""
    import asyncio

    world.publish(1)
    world.publish(2)
    world.publish(3)
    env4, m4 = world.build(4)  # signed, but nobody serves its chunks
    node = await world.node("node")
    await node.download(1, ["seed"])
    node.store.put_manifest(env4, m4)
    stuck = asyncio.create_task(node.download(4, []))
    await asyncio.sleep(0.1)
    applied: list[int] = []
    apply = node.sync._apply

    def counting(manifest: Manifest) -> dict[str, bytearray]:
        applied.append(manifest.version)
        return apply(manifest)

    node.sync._apply = counting  # type: ignore[method-assign]
    two, three = await asyncio.wait_for(
        asyncio.gather(node.download(2, ["seed"]), node.download(3, ["seed"])), 30
    )
    assert (two, three) == (files_of(2), files_of(3))
    assert sorted(applied) == [2, 3]  # v2 once, though both fetches needed it
    assert not stuck.done()
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
