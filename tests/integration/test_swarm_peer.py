"""Real libp2p daemons on 127.0.0.1: peer start-up errors, stable identity, RPC transport."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swarm.dht import PeerConfig, SwarmPeer
from swarm.errors import (
    AddressInUse,
    BadMultiaddr,
    BootstrapUnreachable,
    PeerUnreachable,
    RemoteError,
    RpcTimeout,
)
from swarm.ratelimit import TokenBucket
from swarm.testing import start_loopback_peer
from swarm.transport import HandlerError, P2PTransport

DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWSUXdQXWm3u3os3eiUu6xfkjBWpK9B4bJ6inRnTGdfGnE"


async def test_startup_failures_are_one_line_swarm_errors() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(AddressInUse, match="address already in use"):
            await SwarmPeer(PeerConfig(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"])).start()
    with pytest.raises(BadMultiaddr, match="tcpx"):
        await SwarmPeer(PeerConfig(host_maddrs=["/ip4/127.0.0.1/tcpx/0"])).start()
    with pytest.raises(BootstrapUnreachable, match="initial peers"):
        await SwarmPeer(PeerConfig(initial_peers=[DEAD_PEER])).start()


async def test_identity_path_keeps_peer_id_and_0000_listens(tmp_path: Path) -> None:
    cfg = PeerConfig(host_maddrs=["/ip4/0.0.0.0/tcp/0"], identity_path=str(tmp_path / "p2p.key"))
    first = SwarmPeer(cfg)
    await first.start()
    peer_id = first.peer_id
    assert await first.visible_maddrs()
    await first.stop()
    again = SwarmPeer(cfg)
    await again.start()
    try:
        assert again.peer_id == peer_id
    finally:
        await again.stop()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SwarmPeer, SwarmPeer]]:
    a = await start_loopback_peer()
    b = await start_loopback_peer(await a.visible_maddrs())
    yield a, b
    await asyncio.gather(a.stop(), b.stop())


async def test_rpc_roundtrip_and_error_mapping(pair: tuple[SwarmPeer, SwarmPeer]) -> None:
    a, b = pair
    server, client = P2PTransport(a.p2p), P2PTransport(b.p2p)
    gate = asyncio.Event()

    async def echo(peer: str, req: bytes) -> bytes:
        return peer.encode() + b":" + req

    async def refuse(peer: str, req: bytes) -> bytes:
        raise HandlerError("unknown_lease", "no lease 7")

    async def hang(peer: str, req: bytes) -> bytes:
        await gate.wait()
        return b""

    await server.register("/t/echo", echo)
    await server.register("/t/refuse", refuse)
    await server.register("/t/hang", hang, max_streams_per_peer=1)
    big = bytes(range(256)) * 4096  # 1 MiB, crosses many 64 KiB slices
    assert await client.call(a.peer_id, "/t/echo", big) == b.peer_id.encode() + b":" + big
    with pytest.raises(RemoteError) as info:
        await client.call(a.peer_id, "/t/refuse", b"")
    assert (info.value.code, info.value.detail) == ("unknown_lease", "no lease 7")
    with pytest.raises(RemoteError) as info:
        await client.call(a.peer_id, "/t/missing", b"")
    assert info.value.code == "unknown_method"
    slow = asyncio.create_task(client.call(a.peer_id, "/t/hang", b"", timeout=5))
    await asyncio.sleep(0.3)
    with pytest.raises(RemoteError) as info:  # second concurrent stream over the limit
        await client.call(a.peer_id, "/t/hang", b"")
    assert info.value.code == "busy"
    gate.set()
    assert await slow == b""
    gate.clear()
    with pytest.raises(RpcTimeout):
        await client.call(a.peer_id, "/t/hang", b"", timeout=0.5)
    gate.set()
    with pytest.raises(PeerUnreachable):
        await client.call("12D3KooWSUXdQXWm3u3os3eiUu6xfkjBWpK9B4bJ6inRnTGdfGnE", "/t/echo", b"")


async def test_upload_cap_is_enforced(pair: tuple[SwarmPeer, SwarmPeer]) -> None:
    a, b = pair
    server = P2PTransport(a.p2p, upload_limiter=TokenBucket(4 << 20))
    payload = b"x" * (2 << 20)

    async def blob(peer: str, req: bytes) -> bytes:
        return payload

    await server.register("/t/blob", blob)
    client = P2PTransport(b.p2p)
    t0 = time.monotonic()
    assert await client.call(a.peer_id, "/t/blob", b"", timeout=20) == payload
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 5.0, elapsed  # 2 MiB at 4 MiB/s: about 0.5 s
