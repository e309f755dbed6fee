"""A node against a broken or hostile coordinator (in-memory transport, fake backend)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_node_checkpoints import World
from test_node_worker import MemCoordinator, Swarm, until

from coordinator.config import CoordinatorConfig
from node.backends.base import GenerationRequest, SampleOut, SamplingConfig
from node.backends.fake import FakeBackend
from node.checkpoints import CheckpointUnavailable
from protocol.codec import decode, encode
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import Lease


class CountingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig
    ) -> list[list[SampleOut]]:
        self.calls += 1
        raise RuntimeError("must not be asked to generate this lease")


class HostileCoordinator(MemCoordinator):
    """Hands out leases rewritten by ``self.rewrite`` (the core still knows the real one)."""

    rewrite: Any = None

    async def _lease(self, peer: str, data: bytes) -> bytes:
        out = decode(await super()._lease(peer, data))
        if isinstance(out, Lease) and self.rewrite is not None:
            out = self.rewrite(out)
        return encode(out)


@pytest.mark.parametrize(
    "rewrite",
    [
        pytest.param(
            lambda lease: msgspec.structs.replace(lease, prompts=lease.prompts * 3),
            id="more-prompts-than-asked",
        ),
        pytest.param(
            lambda lease: msgspec.structs.replace(
                lease,
                group_size=256,
                sampling=msgspec.structs.replace(lease.sampling, max_new_tokens=131_072),
            ),
            id="results-too-big-to-submit",
        ),
    ],
)
async def test_an_oversized_lease_is_released_not_generated(tmp_path: Path, rewrite: Any) -> None:
    swarm = Swarm(tmp_path)
    swarm.coord = HostileCoordinator(swarm.net, swarm.dirs, tmp_path)
    swarm.coord.rewrite = rewrite
    await swarm.coord.start()
    await swarm.coord.publish(1)
    backend = CountingBackend()
    w = swarm.worker(backend)
    try:
        await w.start()
        await until(lambda: w.stats.leases_released >= 2, "oversized leases given back")
        assert backend.calls == 0
        assert set(swarm.coord.lease_states().values()) <= {"released", "active"}
    finally:
        await w.stop()
        assert swarm.coord.broadcast is not None
        await swarm.coord.broadcast.stop()
        swarm.coord.core.close()


def test_coordinator_never_sizes_a_lease_the_node_would_refuse(tmp_path: Path) -> None:
    from coordinator.config import LeaseSection
    from coordinator.leases import LeaseManager
    from coordinator.store import Store

    section = LeaseSection(
        max_prompts_per_lease=64, default_tokens_per_s=1e9, min_deadline_s=30.0,
        target_lease_s=1000.0,
    )  # fmt: skip
    leases = LeaseManager(
        Store(tmp_path / "s.sqlite"), section, clock=lambda: 0.0, group_size=16,
        max_new_tokens=16_384,
    )  # fmt: skip
    n = leases.lease_size(1e9, 64)
    assert n >= 1
    assert n * 16 * 16_384 * 8 < DEFAULT_LIMITS.bulk_frame  # 8 bytes per token at full length


def test_a_config_whose_single_prompt_cannot_be_submitted_fails_at_load() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        CoordinatorConfig.model_validate(
            {"group_size": 256, "sampling": {"max_new_tokens": 131_072}}
        )


async def test_a_full_disk_during_download_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while storing a chunk must not escape as OSError (it would end the work loop)."""
    world = World(tmp_path)
    await world.start()
    await world.publish(1)
    mgr, backend = await world.manager()
    assert world.node is not None

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(world.node.store, "put_chunk", full)
    try:
        with pytest.raises(CheckpointUnavailable, match="No space left"):
            await mgr.ensure(1)
        assert backend.loads == []
    finally:
        await world.close()
