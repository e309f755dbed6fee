"""Helpers for tests and benchmarks of the swarm layer (sample adverts, loopback peers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from protocol.messages import CapabilityAdvert, CpuInfo
from swarm.adverts import swarm_validators
from swarm.dht import PeerConfig, SwarmPeer


def sample_advert(tokens_per_s: float = 100.0) -> CapabilityAdvert:
    """A CPU-only advert with placeholder identity fields (the announcer fills them in)."""
    return CapabilityAdvert(
        peer_id="-",
        node_key=b"\0" * 32,
        gpus=[],
        cpu=CpuInfo(cores=2, memory_bytes=8 << 30),
        backend="fake",
        dtype="float32",
        tokens_per_s=tokens_per_s,
        rollouts_per_s=1.0,
        price_per_hour=None,
        policy_version=None,
        reachability="unknown",
        software_version="test",
        expires_at=0.0,
    )


async def start_loopback_peer(
    initial_peers: list[str] | None = None, *, validators: bool = True, dht_timeout: float = 5.0
) -> SwarmPeer:
    """A started peer on 127.0.0.1 with the standard validators (unless ``validators=False``)."""
    peer = SwarmPeer(
        PeerConfig(initial_peers=initial_peers or [], dht_timeout=dht_timeout),
        record_validators=swarm_validators() if validators else (),
    )
    await peer.start()
    return peer


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, timeout: float, what: str, interval: float = 0.2
) -> None:
    """Poll ``predicate`` until true; ``TimeoutError`` naming ``what`` otherwise (tests only)."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        await asyncio.sleep(interval)
