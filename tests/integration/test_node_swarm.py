"""Real processes on 127.0.0.1: the coordinator (``swarm coordinator launch``), contributor nodes
(``swarm node run --backend hf`` on the embedded model) and a trainer-like publisher in the test
process (signs PublishVersion with the trainer key, seeds chunks from its own BroadcastNode).

Every process started here is stopped by its PID (SIGTERM, then SIGKILL) at the end of its test.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from swarm_harness import (
    FAST_CALIBRATION,
    CoordinatorProc,
    Proc,
    TestNode,
    Trainer,
    coordinator_toml,
    launch_coordinator,
    start_node,
    until,
)

from protocol.identity import Identity
from protocol.messages import AcceptedRollout
from swarm.adverts import list_adverts


@pytest.fixture
async def swarm(
    tmp_path: Path, procs: list[Proc]
) -> AsyncIterator[tuple[CoordinatorProc, Trainer]]:
    trainer_id = Identity.generate()
    # every submission spot-checked; the tolerance's calibration at its minimum (FAST_CALIBRATION)
    config = coordinator_toml(tmp_path, trainer_id, intake=FAST_CALIBRATION)
    coord = await launch_coordinator(tmp_path, config)
    procs.append(coord.proc)
    trainer = Trainer(coord, trainer_id, tmp_path)
    await trainer.start()
    yield coord, trainer
    await trainer.stop()


def node_fingerprint(state: Path) -> str | None:
    key = state / "node.key"
    return Identity.load(key).fingerprint if key.exists() else None


@pytest.mark.slow
async def test_node_joins_advertises_submits_and_follows_new_versions(
    tmp_path: Path, swarm: tuple[CoordinatorProc, Trainer], procs: list[Proc]
) -> None:
    coord, trainer = swarm
    await trainer.publish(1)
    node = start_node(tmp_path, coord, "n1")
    procs.append(node)
    await until(lambda: node_fingerprint(tmp_path / "n1") is not None, "node key", 20, node)
    fp = node_fingerprint(tmp_path / "n1")
    assert trainer.peer is not None
    peer = trainer.peer

    async def advertised(version: int | None = None) -> bool:
        ads = await list_adverts(peer)
        ad = ads.get(fp or "")
        return ad is not None and (version is None or ad.policy_version == version)

    await until(advertised, "the node's advert in the DHT", 30, node)
    ads = await list_adverts(peer)
    assert ads[fp or ""].backend == "hf" and ads[fp or ""].dtype == "float32"

    seen: list[AcceptedRollout] = []

    async def accepted_at(version: int) -> bool:
        seen.extend(await trainer.fetch(seen[-1].seq if seen else 0))
        return any(r.policy_version == version and r.node_fingerprint == fp for r in seen)

    await until(lambda: accepted_at(1), "accepted rollouts at v1", 30, node)
    await trainer.publish(2)
    await until(lambda: accepted_at(2), "accepted rollouts at v2", 30, node)
    await until(lambda: advertised(2), "the advert to show v2", 15, node)
    status = await trainer.status()
    assert status["rejected_by_reason"] == {}  # every submission passed, spot checks included

    node.signal(signal.SIGTERM)
    assert node.wait(20) == 0
    assert "node stopped" in node.text()


@pytest.mark.slow
async def test_sigterm_releases_the_lease_and_the_coordinator_reassigns_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    trainer_id = Identity.generate()
    # group_size 32 x 64 prompts x 48 tokens: a lease takes several seconds to generate.
    config = coordinator_toml(
        tmp_path,
        trainer_id,
        {"group_size": 32},
        sampling={"max_new_tokens": 48},
        leases={"min_deadline_s": 120.0, "target_lease_s": 60.0, "max_prompts_per_lease": 64},
        intake={"spot_check_fraction": 0.0},
    )
    coord = await launch_coordinator(tmp_path, config)
    procs.append(coord.proc)
    trainer = Trainer(coord, trainer_id, tmp_path)
    await trainer.start()
    try:
        await trainer.publish(1)
        node = start_node(tmp_path, coord, "n1", 'log_level = "DEBUG"\n', max_prompts=64)
        procs.append(node)
        await until(lambda: "generating lease" in node.text(), "generation to start", 40, node)
        node.signal(signal.SIGTERM)
        assert node.wait(20) == 0
        assert "released lease" in node.text()

        status = await trainer.status()
        assert status["leases"] == {"released": 1}
        # Another node asks right away and gets the released prompts (re-queued first).
        other = TestNode(trainer.transport, coord.peer_id)
        await other.register()
        got = await other.lease(max_prompts=1)
        assert got.prompts[0].prompt_id == "reverse3:00000000"
    finally:
        await trainer.stop()


async def test_unreachable_coordinator_is_one_line_and_exit_1(tmp_path: Path) -> None:
    state = tmp_path / "n"
    state.mkdir()
    (state / "node.toml").write_text(
        'host_maddrs = ["/ip4/127.0.0.1/tcp/0"]\nprobe_budget_s = 0.05\n'
        "startup_timeout_s = 5.0\nregister_timeout_s = 3.0\n"
    )
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmPSJhrMwurpGFJhEmiamjnpUPTp33SFTL36J9fQc56U1i"
    proc = Proc(
        ["node", "run", "--coordinator", dead, "--coordinator-key", Identity.generate().fingerprint,
         "--backend", "fake", "--config", str(state / "node.toml"), "--state-dir", str(state)],
        tmp_path / "n.log",
    )  # fmt: skip
    try:
        rc = proc.wait(60)
    finally:
        proc.stop()
    errors = [line for line in proc.text().splitlines() if line.startswith("error: ")]
    assert rc == 1, proc.text()[-2000:]
    assert len(errors) == 1 and ("initial peers" in errors[0] or "coordinator" in errors[0])
