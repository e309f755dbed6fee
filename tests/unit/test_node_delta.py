"""Nodes and delta versions: the checkpoint manager tells the backend which tensors changed
(from the signed digests), the hf backend updates only those, and the result equals a full load;
rollback protection is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_node_checkpoints import RecordingBackend
from test_swarm_delta import FAST, World, weights

from node.backends.hf import HFBackend
from node.checkpoints import CheckpointManager, CheckpointRefused
from policy.model import ModelSpec, build_model
from swarm.broadcast import BroadcastNode
from swarm.chunks import ChunkStore


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = World(tmp_path)
    await w.seed.start()
    yield w
    await w.close()


async def manager(world: World) -> tuple[CheckpointManager, RecordingBackend]:
    node = BroadcastNode(
        world.net.endpoint("node"),
        ChunkStore(world.tmp / "node" / "ckpt", keep_versions=3),
        world.dirs,
        bytes(32),
        config=FAST,
    )
    await node.start()
    world.nodes.append(node)
    backend = RecordingBackend()
    mgr = CheckpointManager(
        node,
        backend,
        state_dir=world.tmp / "node",
        coordinator_fingerprint=world.coord.fingerprint,
        seeds=lambda: ["seed"],
        download_timeout_s=10.0,
        progress=False,
    )
    return mgr, backend


async def test_manager_loads_delta_versions_and_names_the_changed_tensors(world: World) -> None:
    world.publish(1)
    world.publish(2)
    world.publish(3)
    mgr, backend = await manager(world)
    await mgr.ensure(1)
    await mgr.ensure(3)  # two deltas from v1
    assert mgr.broadcast.sync.last is not None and mgr.broadcast.sync.last.path == "delta"
    assert [v for v, _ in backend.loads] == [1, 3]
    assert backend.changed == [None, frozenset({"embed.weight", "layer.weight"})]
    for name, tensor in weights(3).items():
        assert torch.equal(backend.loads[1][1][name], tensor), name
    with pytest.raises(CheckpointRefused, match="roll back"):
        await mgr.ensure(2)


def test_hf_backend_updates_only_changed_tensors_like_a_full_load() -> None:
    base = build_model(ModelSpec(), seed=0)
    target = build_model(ModelSpec(), seed=1).state_dict()
    start = {k: v.clone() for k, v in base.state_dict().items()}
    changed = {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"}
    mixed = {k: (target[k] if k in changed else start[k]) for k in start}

    partial = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=0))
    partial.load_state_dict(1, start)
    ptrs = [p.data_ptr() for p in partial.model.parameters()]
    partial.load_state_dict(2, mixed, changed=changed)
    full = HFBackend(ModelSpec(), device="cpu", model=build_model(ModelSpec(), seed=0))
    full.load_state_dict(2, mixed)
    got, want = partial.model.state_dict(), full.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [p.data_ptr() for p in partial.model.parameters()] == ptrs
    assert partial.loaded_version == 2
    with pytest.raises(ValueError, match="does not fit"):
        partial.load_state_dict(3, mixed, changed={"bogus.weight"})
