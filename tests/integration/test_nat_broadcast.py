"""Checkpoint broadcast with peers behind NAT, in network namespaces (``swarm.netns``).

Every peer is a ``swarm.peerproc`` child inside its own namespace; the seed is public and serves
dial-backs (as the coordinator does). Checked here: a NATed node measures itself ``private`` and
is never announced as a holder others must dial, while a public one is; a downloader facing only
holders it cannot dial falls back to the seed within the connect timeout and backs off from
them, so the next version does not pay for the dials again.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from swarm.chunks import ChunkStore
from swarm.netns import Host, Topology, iptables_command
from swarm.peerproc import PeerProcess

CHUNK = 256 * 1024


def seed_versions(stores: list[Path], coord: Identity, versions: list[int], size: int) -> None:
    """The same complete, signed versions in each chunk store (what a seed or a holder has)."""
    now = time.time()
    for v in versions:
        manifest, chunks = build_manifest(
            {"model.safetensors": os.urandom(size)}, version=v, parent_version=None,
            model_config_hash="00", tokenizer_hash="00", created_at=now, expires_at=now + 3600,
            chunk_size=CHUNK,
        )  # fmt: skip
        env = sign_manifest(manifest, coord, now)
        for store in stores:
            ChunkStore(store, keep_versions=len(versions)).seed(env, manifest, chunks)


class Swarm:
    """Peer processes in a topology; all closed at the end."""

    def __init__(self, topo: Topology, tmp: Path, coord: Identity) -> None:
        self.topo, self.tmp, self.coord = topo, tmp, coord
        self.procs: list[PeerProcess] = []
        self.boot: list[str] = []

    async def start(self, host: Host, name: str, *extra: str) -> PeerProcess:
        args = ["--store", str(self.tmp / name), "--host", host.ip,
                "--coordinator-key", self.coord.public_key.hex(), *extra]  # fmt: skip
        for maddr in self.boot:
            args += ["--bootstrap", maddr]
        proc = PeerProcess(args, log_path=str(self.tmp / f"{name}.log"), prefix=host.argv([]))
        self.procs.append(proc)
        await proc.start(timeout=90)
        if not self.boot:
            self.boot = [m for m in proc.maddrs if f"/{host.ip}/" in m]
        return proc

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.procs))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.log"))


@pytest.mark.slow
async def test_natted_node_is_download_only_and_never_announced(
    topology: Topology, tmp_path: Path
) -> None:
    coord = Identity.generate()
    seed_versions([tmp_path / "seed"], coord, [1], 8 * CHUNK)
    seed_host = topology.add_public("seed")
    pub_host = topology.add_public("pub")
    nat_host = topology.add_private("nat", topology.add_nat("router", "symmetric"))
    swarm = Swarm(topology, tmp_path, coord)
    try:
        seed = await swarm.start(seed_host, "seed", "--dialback-server")
        probe = ["--seed", seed.peer_id, "--version", "1", "--probe-reachability", seed.peer_id]
        pub, nat = await asyncio.gather(
            swarm.start(pub_host, "pub", *probe), swarm.start(nat_host, "nat", *probe)
        )
        for p in (pub, nat):
            p.go()
        await asyncio.wait_for(asyncio.gather(pub.wait_done(), nat.wait_done()), 90)
        assert pub.error is None and nat.error is None, swarm.logs()
        assert pub.stats["reachability"] == "public"
        assert nat.stats["reachability"] == "private"
        # the holder records a third party reads: the seed and the public node, never the NATed
        # one (it holds all 8 chunks, but nobody could dial it to get them)
        await asyncio.sleep(1.0)  # the last debounced announcement
        holders = await seed.holders(1)
        assert holders.get(pub.peer_id) == 8, holders
        assert nat.peer_id not in holders, f"the NATed node was announced: {holders}"
    finally:
        await swarm.close()


@pytest.mark.slow
async def test_only_unreachable_holders_fall_back_to_the_seed_in_bounded_time(
    topology: Topology, tmp_path: Path
) -> None:
    """Two NATed peers hold (and announce, as a misconfigured or stale peer would) every chunk of
    v1 and v2; nobody can dial them. A new public downloader gets v1 from the seed (uplink
    1 MiB/s, so the 4 MiB take 4 s and the downloader learns of the NATed holders meanwhile)
    within the connect timeout (5 s) plus the transfer, and v2 without dialling them again."""
    coord = Identity.generate()
    size = 16 * CHUNK
    seed_versions([tmp_path / n for n in ("seed", "ghost0", "ghost1")], coord, [1, 2], size)
    seed_host = topology.add_public("seed")
    topology.shape(seed_host, 1 << 20)
    ghost_hosts = [
        topology.add_private(f"g{i}", topology.add_nat(f"r{i}", kind))
        for i, kind in enumerate(("cone", "symmetric"))
    ]
    r_host = topology.add_public("r")
    # The ghosts must not reach r either: they are DHT servers, and once r joins, their holder
    # announcements (DHT stores to the nearest peers) open connections to r that r's p2pd would
    # reuse, so r could fetch from them after all (it did, under load). A holder that cannot be
    # dialled and never dials you is what this test is about.
    ipt = iptables_command()
    assert ipt is not None  # the topology fixture checked it
    for h in ghost_hosts:
        r_host.run(ipt, "-A", "INPUT", "-s", h.public_ip, "-p", "tcp", "--syn", "-j", "DROP")
    swarm = Swarm(topology, tmp_path, coord)
    try:
        seed = await swarm.start(seed_host, "seed")
        ghosts = await asyncio.gather(
            *(swarm.start(h, f"ghost{i}") for i, h in enumerate(ghost_hosts))
        )
        ids = {g.peer_id for g in ghosts}
        deadline = time.monotonic() + 30
        while not ids <= set(await seed.holders(1)):  # their (misleading) records are out
            assert time.monotonic() < deadline, "the NATed holders never announced themselves"
            await asyncio.sleep(0.5)
        r = await swarm.start(r_host, "r", "--seed", seed.peer_id, "--version", "1")
        t0 = time.monotonic()
        r.go()
        await asyncio.wait_for(r.wait_done(), 60)
        first = time.monotonic() - t0
        assert r.error is None, swarm.logs()
        scores = r.stats["scores"]
        assert isinstance(scores, dict)
        for g in ids:  # each was dialled once, failed, and is in back-off
            assert scores.get(g, {}).get("dial_failures") == 1, scores
            assert scores[g]["successes"] == 0
        assert first < 5.0 + 4.0 + 10.0, f"v1 took {first:.1f} s"
        t0 = time.monotonic()
        r.go(2)
        await asyncio.wait_for(r.wait_done(), 60)
        second = time.monotonic() - t0
        assert r.error is None, swarm.logs()
        assert second < 4.0 + 10.0, f"v2 took {second:.1f} s"
        scores = r.stats["scores"]
        assert isinstance(scores, dict)
        assert all(scores[g]["dial_failures"] == 1 for g in ids), scores
    finally:
        await swarm.close()
