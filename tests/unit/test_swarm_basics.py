"""Unit tests of swarm pieces that need no sockets: key schema, token bucket, error translation,
in-memory transport."""

from __future__ import annotations

import asyncio

import pytest

from swarm import keys
from swarm.dht import PeerConfig, translate_startup_error
from swarm.errors import (
    AddressInUse,
    BadMultiaddr,
    BootstrapUnreachable,
    DaemonMissing,
    IdentityTaken,
    PeerUnreachable,
    RemoteError,
    RpcTimeout,
    StartupError,
)
from swarm.memtransport import InMemoryNetwork
from swarm.ratelimit import TokenBucket
from swarm.transport import HandlerError


def test_bitmap_roundtrip() -> None:
    idx = {0, 3, 8, 9, 63}
    bm = keys.bitmap_from_indices(idx, 64)
    assert len(bm) == 8
    assert keys.indices_from_bitmap(bm, 64) == frozenset(idx)
    assert keys.indices_from_bitmap(bm, 9) == frozenset({0, 3, 8})
    with pytest.raises(ValueError):
        keys.bitmap_from_indices({64}, 64)


def test_keys_are_namespaced() -> None:
    assert keys.holders_key(7) == "rollout-swarm/v1/holders/7"
    assert len({keys.ADVERTS, keys.POLICY_VERSION, keys.COORDINATOR}) == 3
    with pytest.raises(ValueError):
        keys.holders_key(-1)


# Messages hivemind 1.1.12 produces for each start-up failure (observed on this machine).
@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "p2pd binary not found at /x/p2pd. This may indicate a failed installation.",
            DaemonMissing,
        ),
        (
            "Daemon failed to start: 2026/11/29 failed to listen on any addresses: "
            "[listen tcp4 127.0.0.1:35203: bind: address already in use]",
            AddressInUse,
        ),
        (
            'Daemon failed to start: failed to parse multiaddr "/ip4/1/tcpx/0": unknown protocol',
            BadMultiaddr,
        ),
        (
            "Daemon failed to start: 2026/11/29 failed to connect to bootstrap peers",
            BootstrapUnreachable,
        ),
        ("Identity from `/k` is already taken by another peer", IdentityTaken),
        ("something else\nentirely", StartupError),
    ],
)
def test_startup_errors_are_translated(message: str, expected: type[Exception]) -> None:
    err = translate_startup_error(
        RuntimeError(message), PeerConfig(initial_peers=["/ip4/1.2.3.4/tcp/1"])
    )
    assert type(err) is expected
    assert "\n" not in str(err)


async def test_token_bucket_caps_rate_on_fake_clock() -> None:
    now = [0.0]

    async def fake_sleep(dt: float) -> None:
        now[0] += dt

    bucket = TokenBucket(1000.0, burst=100.0, clock=lambda: now[0], sleep=fake_sleep)
    for _ in range(50):
        await bucket.acquire(100)
    # 5000 bytes at 1000 B/s with a 100 B burst: about 4.9 s of fake time.
    assert now[0] == pytest.approx(4.9, abs=1e-6)
    assert bucket.total_bytes == 5000


async def test_memory_transport_semantics() -> None:
    net = InMemoryNetwork()
    a, b = net.endpoint("a"), net.endpoint("b")

    async def echo(peer: str, req: bytes) -> bytes:
        return peer.encode() + req

    async def fail(peer: str, req: bytes) -> bytes:
        raise HandlerError("busy", "try later")

    async def slow(peer: str, req: bytes) -> bytes:
        await asyncio.sleep(10)
        return b""

    await b.register("echo", echo)
    await b.register("fail", fail)
    await b.register("slow", slow)
    assert await a.call("b", "echo", b"!") == b"a!"
    with pytest.raises(RemoteError) as info:
        await a.call("b", "fail", b"")
    assert info.value.code == "busy"
    with pytest.raises(RemoteError) as info:
        await a.call("b", "nope", b"")
    assert info.value.code == "unknown_method"
    with pytest.raises(RpcTimeout):
        await a.call("b", "slow", b"", timeout=0.01)
    net.disconnect("b")
    with pytest.raises(PeerUnreachable):
        await a.call("b", "echo", b"")
