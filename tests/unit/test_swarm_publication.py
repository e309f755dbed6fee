"""Publishing delta versions: the builder's keyframe policy, the coordinator's refusal of a delta
against a base it never recorded, and the trainer's SwarmPublisher end to end on the in-memory
transport (bf16 weights, keyframe then deltas, a keyframe again when the base is refused)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from coord_harness import Harness

from coordinator.errors import Rejection
from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import open_envelope
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import build_manifest, check_manifest, sign_manifest
from protocol.messages import DeltaInfo, Manifest, ManifestResponse, PublishVersion, Reject
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import cast_floats, files_to_state_dict, state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork
from swarm.publication import Base, PublishPolicy, VersionBuilder, held_base
from trainer.swarm_client import SwarmPublisher


def weights(step: int) -> dict[str, torch.Tensor]:
    """fp32 master weights after ``step`` small updates (a few bf16 elements change per step)."""
    gen = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(128, 64, generator=gen), "b.bias": torch.randn(64, generator=gen)}
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(s)
        w["a.weight"] = w["a.weight"] + 1e-4 * torch.randn(128, 64, generator=g)
    return w


def files(step: int) -> dict[str, bytes]:
    return state_dict_to_files(cast_floats(weights(step), "bfloat16"))


def builder(**policy: float) -> VersionBuilder:
    return VersionBuilder(
        model_config_hash="ab",
        tokenizer_hash="cd",
        chunk_size=4096,
        policy=PublishPolicy(**policy),  # type: ignore[arg-type]
    )


def build(b: VersionBuilder, step: int, base: Base | None, **kw: bool) -> tuple[str, str, Manifest]:
    built = b.build(
        files(step),
        version=step,
        parent_version=None,
        base=base,
        created_at=1.0,
        expires_at=2.0,
        **kw,
    )
    return built.kind, built.reason, built.manifest


def test_builder_publishes_deltas_unless_a_keyframe_is_due() -> None:
    b = builder()
    kind, reason, m1 = build(b, 1, None)
    assert (kind, reason) == ("keyframe", "no base held") and m1.delta is None
    assert m1.tensors is not None and {t.dtype for t in m1.tensors} == {"BF16"}
    base = Base(m1, files(1), 0)
    kind, _, m2 = build(b, 2, base)
    assert kind == "delta" and m2.delta is not None
    assert (m2.delta.base_version, m2.delta.base_root_hash) == (1, m1.root_hash)
    assert build(b, 2, base, force_keyframe=True)[:2] == ("keyframe", "asked for")
    assert build(builder(keyframe_every=1), 2, base)[1].startswith("deltas are off")
    assert build(builder(keyframe_every=3), 2, Base(m1, files(1), 1))[0] == "delta"
    assert build(builder(keyframe_every=3), 2, Base(m1, files(1), 2))[1] == (
        "keyframe_every = 3: 2 deltas since the last keyframe"
    )
    assert "of the full checkpoint" in build(builder(max_delta_ratio=0.001), 2, base)[1]
    other = {"x.weight": torch.zeros(3)}
    layout = b.build(
        state_dict_to_files(other),
        version=3,
        parent_version=2,
        base=base,
        created_at=1.0,
        expires_at=2.0,
    )
    assert layout.kind == "keyframe" and layout.reason.startswith("layout changed")


def test_held_base_counts_the_chain_since_the_last_keyframe(tmp_path: Path) -> None:
    b, store, signer = builder(), ChunkStore(tmp_path), Identity.generate()
    base = None
    for step in (1, 2, 3):
        built = b.build(
            files(step),
            version=step,
            parent_version=None,
            base=base,
            created_at=1.0,
            expires_at=time.time() + 60,
        )
        store.seed(sign_manifest(built.manifest, signer, 1.0), built.manifest, built.chunks)
        base = held_base(store, step)
        assert base is not None and base.chain == step - 1
        assert base.files == files(step)
    assert held_base(store, 9) is None and held_base(store, None) is None


def test_coordinator_refuses_a_delta_against_a_base_it_never_recorded(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.publish(1)
    now = h.clock()

    def delta_version(version: int, base: int, root: bytes) -> Manifest:
        info = DeltaInfo(base_version=base, base_root_hash=root, files=["delta.rsd"])
        m, _ = build_manifest(
            {"model.safetensors": b"w" * 64, "delta.rsd": b"d" * 10},
            version=version,
            parent_version=None,
            model_config_hash="ab",
            tokenizer_hash="cd",
            created_at=now,
            expires_at=now + 60,
            chunk_size=32,
            tensors=[],
            delta=info,
        )
        return m

    from protocol.codec import decode as dec
    from protocol.messages import SignedEnvelope

    raw = h.store.get_version(1)
    assert raw is not None
    root1 = dec(dec(raw, SignedEnvelope).payload, Manifest).root_hash
    for version, base, root in ((3, 1, bytes(32)), (3, 2, root1)):
        with pytest.raises(Rejection) as info:
            h.core.publish_version(
                sign_manifest(delta_version(version, base, root), h.publisher, now)
            )
        assert info.value.code is ReasonCode.DELTA_BASE_MISSING
    h.core.publish_version(sign_manifest(delta_version(3, 1, root1), h.publisher, now))
    assert h.store.latest_version() == 3


class FakeCoordinator:
    """The coordinator's ``rswarm/publish`` in miniature: open the trainer's envelope, check the
    manifest, refuse a delta whose base it does not hold (or every delta, if told to), sign."""

    def __init__(self, net: InMemoryNetwork, trainer_key: bytes) -> None:
        self.identity = Identity.generate()
        self.trainer_key = trainer_key
        self.held: dict[int, Manifest] = {}
        self.refuse_deltas = False
        self.endpoint = net.endpoint("coord")

    async def start(self) -> None:
        await self.endpoint.register(rpc.PUBLISH, self._on_publish)

    async def _on_publish(self, caller: str, request: bytes) -> bytes:
        from protocol.codec import decode as dec
        from protocol.messages import SignedEnvelope

        env = dec(request, SignedEnvelope)
        msg = open_envelope(
            env, PublishVersion, now=time.time(), replay=None, expected_signer=self.trainer_key
        )
        manifest = decode(msg.manifest, Manifest)
        check_manifest(manifest, now=time.time())
        if manifest.delta is not None and (
            self.refuse_deltas
            or (base := self.held.get(manifest.delta.base_version)) is None
            or base.root_hash != manifest.delta.base_root_hash
        ):
            return encode(Reject(ref="-", code=ReasonCode.DELTA_BASE_MISSING, detail="no base"))
        self.held[manifest.version] = manifest
        return encode(
            ManifestResponse(manifest=sign_manifest(manifest, self.identity, time.time()))
        )


async def test_swarm_publisher_sends_bf16_keyframe_then_deltas(tmp_path: Path) -> None:
    net, trainer_id = InMemoryNetwork(), Identity.generate()
    coord = FakeCoordinator(net, trainer_id.public_key)
    await coord.start()
    store = ChunkStore(tmp_path / "seed", keep_versions=10)
    broadcast = BroadcastNode(
        net.endpoint("trainer"), store, MemoryHolderDirectory(), coord.identity.public_key
    )
    pub = SwarmPublisher(
        net.endpoint("trainer-rpc"),
        broadcast,
        "coord",
        trainer_id,
        model_config_hash="ab",
        tokenizer_hash="cd",
        chunk_size=4096,
    )
    await pub.publish(0, weights(0))
    await pub.publish(1, weights(1))
    assert store.manifest(0)[1].delta is None  # type: ignore[index]
    m1 = store.manifest(1)[1]  # type: ignore[index]
    assert m1.delta is not None and m1.delta.base_version == 0
    assert store.is_complete(1) and store.is_complete(1, "delta")  # seeded: both parts
    loaded = files_to_state_dict(store.load_files(1))
    assert loaded["a.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["a.weight"], weights(1)["a.weight"].to(torch.bfloat16))
    coord.refuse_deltas = True  # e.g. a coordinator that lost its state
    await pub.publish(2, weights(2))
    assert store.manifest(2)[1].delta is None  # type: ignore[index]
    coord.refuse_deltas = False
    pub.request_keyframe()
    await pub.publish(3, weights(3))
    assert store.manifest(3)[1].delta is None  # type: ignore[index]
    await pub.publish(4, weights(4))
    assert store.manifest(4)[1].delta is not None  # type: ignore[index]


async def test_census_counts_holders_of_the_full_checkpoint_not_of_the_delta(
    tmp_path: Path,
) -> None:
    """A node that fetched a delta version in full (no base) holds it; one with only the delta
    chunks does not (the coordinator's dissemination census)."""
    from coordinator.dissemination import coordinator_census
    from protocol.manifest import part_indices
    from swarm import keys

    h = Harness(tmp_path)
    b = builder()
    built1 = b.build(
        files(1),
        version=1,
        parent_version=None,
        base=None,
        created_at=h.clock(),
        expires_at=h.clock() + 60,
    )
    h.core.publish_version(sign_manifest(built1.manifest, h.publisher, h.clock()))
    built2 = b.build(
        files(2),
        version=2,
        parent_version=1,
        base=Base(built1.manifest, files(1), 0),
        created_at=h.clock(),
        expires_at=h.clock() + 60,
    )
    m2 = built2.manifest
    h.core.publish_version(sign_manifest(m2, h.publisher, h.clock()))
    chunks = ChunkStore(tmp_path / "chunks")
    chunks.put_manifest(sign_manifest(m2, h.publisher, h.clock()), m2)
    n = len(m2.chunks)
    mem = MemoryHolderDirectory()
    await mem.publish(2, "QmFull", keys.bitmap_from_indices(part_indices(m2, "full"), n), 60)
    await mem.publish(2, "QmDelta", keys.bitmap_from_indices(part_indices(m2, "delta"), n), 60)
    census = coordinator_census(h.store, chunks, mem, keep=3)
    census.node_peers = lambda: {"QmFull", "QmDelta"}
    await census.refresh()
    assert census.counts == {2: 1} and census.by_peer == {"QmFull": [2]}
