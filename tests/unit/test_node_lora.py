"""LoRA versions end to end without sockets: the real trainer publishes adapters, a node's
CheckpointManager verifies and applies them over its one base model (hf backend), switches between
held adapters per lease without reloading the base, refuses an adapter over another base; the
coordinator's spot-check loader scores with the same adapter and accepts the node's log-probs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from coord_harness import config as coord_config
from test_node_checkpoints import FAST
from test_trainer_recipe import make_rollouts

from coordinator.holding import SpotCheckModels, model_spec
from coordinator.logprobs import InProcessLogprobVerifier
from node.backends.base import GenerationRequest, SamplingConfig
from node.backends.hf import HFBackend
from node.checkpoints import CheckpointManager, CheckpointRefused
from policy.lora import AdapterState, base_fingerprint
from policy.model import ModelSpec
from policy.sampling import sample_seed
from policy.scoring import score_logprobs
from protocol.errors import ReasonCode
from protocol.identity import Identity
from protocol.manifest import sign_manifest, version_kind
from protocol.messages import LoraInfo, Manifest
from swarm.broadcast import BroadcastNode
from swarm.checkpoint_io import cast_floats, state_dict_to_files
from swarm.chunks import ChunkStore
from swarm.holders import MemoryHolderDirectory
from swarm.memtransport import InMemoryNetwork
from swarm.publication import VersionBuilder
from trainer.config import TrainerConfig
from trainer.recipe import Trainer
from trainer.swarm_client import _lora_info

torch.set_num_threads(1)
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6)
REQUESTS = [GenerationRequest([1, 4, 5, 6, 3], n=4, seed=11), GenerationRequest([1, 7, 3], 4, 12)]


def lora_trainer(tmp: Path, seed: int = 0) -> Trainer:
    cfg = TrainerConfig(
        out_dir=str(tmp / f"trainer-{seed}"), batch_prompts=4, group_size=4, minibatches=2,
        lora_rank=4, lora_alpha=8.0, lr=5e-2, seed=seed, entropy_coef=0.0,
    )  # fmt: skip
    return Trainer.setup(cfg)


def adapter_files(state: AdapterState, dtype: str = "float32") -> dict[str, bytes]:
    from policy.lora import ADAPTER_FILE

    return {ADAPTER_FILE: state_dict_to_files(cast_floats(state, dtype))["model.safetensors"]}


class Swarm:
    """A seed holding signed versions and one node (CheckpointManager + hf backend)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.net = InMemoryNetwork()
        self.dirs = MemoryHolderDirectory()
        self.coord = Identity.generate()
        self.seed_store = ChunkStore(tmp / "seed", keep_versions=10)
        self.seed = BroadcastNode(
            self.net.endpoint("seed"), self.seed_store, self.dirs, self.coord.public_key
        )
        self.builder = VersionBuilder(model_config_hash="ab", tokenizer_hash="cd", chunk_size=4096)

    async def start(self) -> None:
        await self.seed.start()
        self.node = BroadcastNode(
            self.net.endpoint("node"),
            ChunkStore(self.tmp / "node" / "checkpoints", keep_versions=3),
            self.dirs,
            bytes(32),
            config=FAST,
        )
        await self.node.start()
        self.backend = HFBackend(device="cpu")
        self.manager = CheckpointManager(
            self.node,
            self.backend,
            state_dir=self.tmp / "node",
            coordinator_fingerprint=self.coord.fingerprint,
            seeds=lambda: ["seed"],
            download_timeout_s=10.0,
            progress=False,
            keep_adapters=3,
        )

    def publish(self, version: int, state: AdapterState) -> Manifest:
        now = time.time()
        built = self.builder.build(
            adapter_files(state),
            version=version,
            parent_version=None,
            base=None,
            created_at=now,
            expires_at=now + 3600,
            lora=_lora_info(state),
        )
        self.seed_store.seed(
            sign_manifest(built.manifest, self.coord, now), built.manifest, built.chunks
        )
        return built.manifest

    async def stop(self) -> None:
        await self.node.stop()
        await self.seed.stop()


@pytest.fixture
async def swarm(tmp_path: Path) -> AsyncIterator[Swarm]:
    s = Swarm(tmp_path)
    await s.start()
    yield s
    await s.stop()


def trained_versions(tmp: Path, n: int) -> tuple[Trainer, list[AdapterState]]:
    """A LoRA trainer and its published state after 1..n steps."""
    tr = lora_trainer(tmp)
    states = []
    for step in range(n):
        tr.train_step(make_rollouts(step, 4, 4, version=tr.version))
        state = tr.state_dict_for_publish()
        assert isinstance(state, AdapterState)
        states.append(state)
    return tr, states


def _holding(tmp: Path, broadcast: BroadcastNode) -> SpotCheckModels:
    """The coordinator's spot-check models (SpotCheckModels.load) over ``broadcast``'s chunks."""
    return SpotCheckModels(broadcast.store, model_spec(coord_config(tmp / "coord")))


async def test_lora_version_is_signed_loaded_sampled_and_rescored_alike(
    swarm: Swarm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="node.checkpoints")
    tr, (state,) = trained_versions(tmp_path, 1)
    manifest = swarm.publish(1, state)
    assert version_kind(manifest) == "lora" and manifest.delta is None
    assert manifest.lora == LoraInfo(
        base_model=state.base_model.split(":", 1)[1], rank=4, alpha=8.0
    )
    await swarm.manager.ensure(1)
    backend = swarm.backend
    assert backend.loaded_version == 1 and backend.base_reloads == 0
    assert "loaded policy v1" in caplog.text and "LoRA adapter, rank 4" in caplog.text
    outs = backend.generate(REQUESTS, SAMPLING)
    prompts = [r.prompt_token_ids for r in REQUESTS for _ in range(r.n)]
    comps = [s.token_ids for g in outs for s in g]
    claimed = [s.logprobs for g in outs for s in g]
    # the trainer's own policy (peft, unmerged, fp32 master weights): published in fp32, the
    # node's merged weights differ only by the rounding of W0 + s·BA (|Δ| ~1e-6 here)
    trainer_lp = score_logprobs(tr.model, prompts, comps)
    worst = max(
        abs(a - b)
        for x, y in zip(claimed, trainer_lp, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert worst < 1e-4
    # v1 is not the base policy: the adapter was applied
    base_lp = score_logprobs(HFBackend(device="cpu").model, prompts, comps)
    assert (
        max(
            abs(a - b)
            for x, y in zip(claimed, base_lp, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        > 1e-3
    )
    # the coordinator's spot check loads v1 as base + the same adapter and accepts the node
    holding = _holding(tmp_path, swarm.node)
    verifier = InProcessLogprobVerifier(
        holding.load, coord_config(tmp_path / "c").intake.tolerances, cache_size=2
    )
    seeds = [sample_seed(r.seed, j) for r in REQUESTS for j in range(r.n)]
    verdict = await verifier.check(
        1, prompts, comps, claimed, seeds=seeds, steps=SAMPLING.max_new_tokens
    )
    assert verdict.ok, verdict.detail
    assert verdict.figures.get("max_abs", 0.0) < 1e-4


async def test_node_switches_adapters_per_lease_without_reloading_the_base(
    swarm: Swarm, tmp_path: Path
) -> None:
    _, states = trained_versions(tmp_path, 2)
    for v, state in enumerate(states, start=1):
        swarm.publish(v, state)
    backend = swarm.backend
    model, base_weights = (
        backend.model,
        {n: p.detach().clone() for n, p in backend.model.named_parameters()},
    )
    await swarm.manager.ensure(1)
    first = backend.generate(REQUESTS, SAMPLING)
    await swarm.manager.ensure(2)
    second = backend.generate(REQUESTS, SAMPLING)
    assert [s.logprobs for g in first for s in g] != [s.logprobs for g in second for s in g]
    fetched = swarm.node.sync.last
    # a lease at v1 again: held in memory, so a switch (no download, no rollback refusal)
    await swarm.manager.ensure(1)
    assert swarm.node.sync.last is fetched and swarm.manager.switches == 1
    again = backend.generate(REQUESTS, SAMPLING)
    assert again == first  # bit for bit: the merge is recomputed from the kept base weights
    assert backend.model is model and backend.base_reloads == 0
    assert swarm.manager.loads == 2 and backend.adapters is not None
    assert backend.adapters.versions() == [1, 2]
    # back to the bare base: exactly the weights loaded at start
    backend.adapters.activate(None)
    assert all(torch.equal(p, base_weights[n]) for n, p in model.named_parameters())


async def test_an_adapter_over_another_base_is_refused_with_one_line(
    swarm: Swarm, tmp_path: Path
) -> None:
    trained = lora_trainer(tmp_path).state_dict_for_publish()
    other_base = base_fingerprint(ModelSpec(), seed=1)  # the embedded model at seed 1
    state = AdapterState(trained, base_model=other_base, rank=4, alpha=8.0)
    swarm.publish(1, state)
    with pytest.raises(CheckpointRefused) as info:
        await swarm.manager.ensure(1)
    assert info.value.code is ReasonCode.LORA_BASE_MISSING
    message = str(info.value)
    assert "\n" not in message and "model_path" in message and state.base_model[7:23] in message
    assert swarm.backend.loaded_version is None and swarm.manager.highest_accepted is None
    # a second lease at it is refused from the stored manifest, before any download
    swarm.node.sync.last = None
    with pytest.raises(CheckpointRefused):
        await swarm.manager.ensure(1)
    assert swarm.node.sync.last is None
    # the coordinator cannot score it either (its model_path is another base): not the node's fault
    from coordinator.logprobs import VerifierUnavailable

    with pytest.raises(VerifierUnavailable, match="LoRA adapter over base"):
        await asyncio.to_thread(_holding(tmp_path, swarm.node).load, 1)


async def test_a_signed_adapter_that_does_not_fit_the_base_is_refused_and_changes_nothing(
    swarm: Swarm, tmp_path: Path
) -> None:
    _, (state,) = trained_versions(tmp_path, 1)
    swarm.publish(1, state)
    await swarm.manager.ensure(1)
    before = swarm.backend.generate(REQUESTS, SAMPLING)
    misfits = {
        "no such module": {"model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
                           "model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(256, 4)},
        "not a linear layer": {"model.norm.lora_A.weight": torch.zeros(4, 64),
                               "model.norm.lora_B.weight": torch.zeros(64, 4)},
        "do not fit": {"model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 32),
                       "model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(256, 4)},
        "lacks lora_B": {"model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)},
    }  # fmt: skip
    for version, (why, tensors) in enumerate(misfits.items(), start=2):
        bad = AdapterState(tensors, base_model=state.base_model, rank=4, alpha=8.0)
        swarm.publish(version, bad)
        with pytest.raises(CheckpointRefused, match=why) as info:
            await swarm.manager.ensure(version)
        assert info.value.code is ReasonCode.MANIFEST_INVALID
        assert swarm.backend.loaded_version == 1 and not swarm.backend.holds_adapter(version)
    assert swarm.backend.generate(REQUESTS, SAMPLING) == before


async def test_a_lora_version_after_full_weights_builds_the_base_again(
    swarm: Swarm, tmp_path: Path
) -> None:
    from policy.model import build_model

    _, (state,) = trained_versions(tmp_path, 1)
    other = build_model(ModelSpec(), seed=5).state_dict()  # a full version: other weights
    swarm.backend.load_state_dict(1, other)
    # a misfit first: refused before the full weights are touched
    misfit = {"model.norm.lora_A.weight": torch.zeros(4, 64),
              "model.norm.lora_B.weight": torch.zeros(64, 4)}  # fmt: skip
    swarm.publish(2, AdapterState(misfit, base_model=state.base_model, rank=4, alpha=8.0))
    with pytest.raises(CheckpointRefused, match="not a linear layer"):
        await swarm.manager.ensure(2)
    assert swarm.backend.loaded_version == 1 and swarm.backend.base_reloads == 0
    weights = dict(swarm.backend.model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in other.items())
    swarm.publish(3, state)
    await swarm.manager.ensure(3)
    assert swarm.backend.base_reloads == 1 and swarm.backend.loaded_version == 3
    fresh = HFBackend(device="cpu")
    fresh.load_adapter(3, state, rank=4, alpha=8.0, keep=2)
    assert swarm.backend.generate(REQUESTS, SAMPLING) == fresh.generate(REQUESTS, SAMPLING)


def test_the_builder_publishes_an_adapter_as_a_lora_version_never_a_delta(tmp_path: Path) -> None:
    from swarm.publication import Base

    _, (first, second) = trained_versions(tmp_path, 2)
    builder = VersionBuilder(model_config_hash="ab", tokenizer_hash="cd", chunk_size=4096)
    one = builder.build(
        adapter_files(first), version=1, parent_version=None, base=None, created_at=1.0,
        expires_at=2.0, lora=_lora_info(first),
    )  # fmt: skip
    two = builder.build(
        adapter_files(second), version=2, parent_version=1, created_at=1.0, expires_at=2.0,
        base=Base(one.manifest, adapter_files(first), 0), lora=_lora_info(second),
    )  # fmt: skip
    for built in (one, two):
        assert built.kind == "lora" and built.manifest.delta is None
        assert version_kind(built.manifest) == "lora"
        assert {c.file for c in built.manifest.chunks} == {"adapter.safetensors"}
        assert built.manifest.tensors is not None and len(built.manifest.tensors) == 28
    assert _lora_info(dict(first)) is None  # plain weights: a full or delta version
