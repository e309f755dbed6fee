"""A whole swarm with its contributor nodes behind NAT routers, in network namespaces.

Coordinator and trainer sit on the public segment; two nodes sit each behind its own home
router (one port-preserving, one symmetric NAT: a new public port per connection), with no
special configuration. They must join, register, lease, download the checkpoints, submit
rollouts that are accepted and trained on, and be measured (by the coordinator's dial-back) as
``private``: download-only, never announced as chunk holders.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from swarm_harness import FAST_CALIBRATION, Proc, coordinator_toml

from protocol.identity import Identity
from swarm.netns import Host, Topology

STATUS = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())"


def status(host: Host, url: str) -> dict[str, Any]:
    """The coordinator's /status, fetched from inside its namespace (it binds 127.0.0.1 there)."""
    out = host.run(sys.executable, "-c", STATUS, url + "/status", check=False, timeout=30)
    try:
        doc: dict[str, Any] = json.loads(out)
    except ValueError:
        return {}
    return doc


@pytest.mark.slow
async def test_natted_nodes_join_lease_download_and_get_rollouts_accepted(
    topology: Topology, tmp_path: Path, procs: list[Proc]
) -> None:
    coord_host, trainer_host = topology.add_public("coord"), topology.add_public("trainer")
    nodes = [
        topology.add_private(f"node{i}", topology.add_nat(f"home{i}", kind))
        for i, kind in enumerate(("cone", "symmetric"))
    ]
    trainer_key = Identity.load_or_create(tmp_path / "trainer" / "trainer.key")
    # The learner runs until the test ends it. With --max-steps 3 the embedded model took its
    # three steps within 5 s, before the second node had registered; the backlog bound then
    # (rightly) stood that node by for good: the rollouts already waiting were all a learner would
    # still train, and none was training them (CI, stop 41). S = 3: the learner can go v0 -> v3 in
    # under a second while a node still samples on v0.
    config = coordinator_toml(
        tmp_path,
        trainer_key,
        top={"staleness_bound": 3},
        network={"host": coord_host.ip, "trainer_key": trainer_key.fingerprint},
        intake=FAST_CALIBRATION,  # about reachability, not the tolerance
    )
    state = tmp_path / "coord"
    procs.append(Proc(["coordinator", "launch", "--config", str(config), "--state-dir", str(state)],
                      tmp_path / "coordinator.log", prefix=coord_host.argv([])))  # fmt: skip
    info_file = state / "coordinator.json"
    deadline = time.monotonic() + 90
    while not info_file.exists():
        assert time.monotonic() < deadline, procs[0].text()[-3000:]
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.2)  # written in one go, but not atomically
    info = json.loads(info_file.read_text())
    maddr = next(m for m in info["multiaddrs"] if f"/{coord_host.ip}/" in m)
    fp = info["fingerprint"]
    (tmp_path / "trainer.toml").write_text(
        "seed = 0\nbatch_prompts = 8\ngroup_size = 4\nmax_staleness = 3\nresume = false\n"
        f'out_dir = "{tmp_path / "trainer"}"\n'
    )
    procs.append(Proc(
        ["trainer", "run", "--config", str(tmp_path / "trainer.toml"), "--coordinator", maddr,
         "--coordinator-key", fp, "--state-dir", str(tmp_path / "trainer")],
        tmp_path / "trainer.log", prefix=trainer_host.argv([]),
    ))  # fmt: skip
    for i, host in enumerate(nodes):
        cfg = tmp_path / f"node{i}.toml"
        cfg.write_text('backend = "hf"\nstatus_interval_s = 2.0\n')  # nothing about NAT
        procs.append(Proc(
            ["node", "run", "--coordinator", maddr, "--coordinator-key", fp, "--config", str(cfg),
             "--state-dir", str(tmp_path / f"node{i}")],
            tmp_path / f"node{i}.log", prefix=host.argv([]),
        ))  # fmt: skip

    def logs() -> str:
        return "\n".join(f"--- {p.log.name}\n{p.text()[-2500:]}" for p in procs)

    doc: dict[str, Any] = {}
    deadline = time.monotonic() + 240
    while True:
        doc = status(coord_host, info["http_url"])
        done = doc.get("node_leases_completed") or {}
        reach = doc.get("node_reachability") or {}
        if (
            (doc.get("trainer_step") or 0) >= 3
            and len(done) == 2
            and all(n >= 1 for n in done.values())
            and set(reach.values()) == {"private"}
        ):
            break
        for p in procs:
            assert p.popen.poll() in (None, 0), f"{p.log.name} exited\n{logs()}"
        assert time.monotonic() < deadline, f"status: {doc}\n{logs()}"
        await asyncio.sleep(1.0)
    assert doc["rollouts_accepted"] > 0
    # a node can still fall more than S versions behind a learner this fast, or a lease outlive its
    # deadline on a loaded machine: timing, not a fault (no strike); nothing else is refused
    rejected = doc.get("rejected_by_reason") or {}
    assert set(rejected) <= {"too_stale", "stale_epoch", "lease_expired"}, rejected
    assert not doc.get("nodes_banned"), doc.get("nodes_banned")
    # each node downloaded the checkpoints it generated with (a lease names a held version)
    # the coordinator knows the result as it answers the dial-back; the node's status line
    # (every 2 s) shows it a moment later
    for i in range(2):
        log = tmp_path / f"node{i}.log"
        deadline = time.monotonic() + 20
        while "reach=private" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            await asyncio.sleep(0.5)
