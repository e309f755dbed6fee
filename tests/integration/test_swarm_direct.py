"""Real peers on 127.0.0.1: chunk answers over direct TCP connections (``swarm.direct``), the
ticket that binds them to a libp2p peer, and the fall-backs to libp2p."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from protocol.codec import decode, encode
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Manifest, SignedEnvelope
from swarm import keys
from swarm.broadcast import EXCHANGE_WINDOWED_RPC, BroadcastNode
from swarm.chunks import ChunkStore
from swarm.dht import SwarmPeer
from swarm.direct import TICKET_BYTES, DirectSettings, _Pool
from swarm.holders import MemoryHolderDirectory
from swarm.testing import start_loopback_peer
from swarm.transport import _HEADER, P2PTransport
from swarm.wire import ExchangeReply, ExchangeRequest

CHUNK = 64 * 1024


def version(coord: Identity, size: int = 20 * CHUNK + 17) -> tuple[
    dict[str, bytes], SignedEnvelope, Manifest, list[bytes]
]:  # fmt: skip
    files = {"model.safetensors": os.urandom(size)}
    now = time.time()
    manifest, chunks = build_manifest(
        files, version=1, parent_version=None, model_config_hash="00", tokenizer_hash="00",
        created_at=now, expires_at=now + 3600, chunk_size=CHUNK,
    )  # fmt: skip
    return files, sign_manifest(manifest, coord, now), manifest, chunks


@pytest.fixture
async def peers() -> AsyncIterator[tuple[SwarmPeer, SwarmPeer]]:
    a = await start_loopback_peer()
    b = await start_loopback_peer(await a.visible_maddrs())
    yield a, b
    await asyncio.gather(a.stop(), b.stop())


async def broadcast(
    tmp: Path, peers: tuple[SwarmPeer, SwarmPeer], *, seed_direct: bool = True, **tune: float
) -> tuple[BroadcastNode, BroadcastNode, dict[str, bytes], list[bytes]]:
    """A seed on ``peers[0]`` holding a version, a receiver on ``peers[1]`` asking directly;
    ``tune``: DirectTransport knobs set on the seed's."""
    coord = Identity.generate()
    files, env, _manifest, chunks = version(coord)
    directory = MemoryHolderDirectory()
    local = DirectSettings(host="127.0.0.1")
    seed = BroadcastNode(P2PTransport(peers[0].p2p), ChunkStore(tmp / "seed"), directory,
                         coord.public_key, direct=local if seed_direct else None)  # fmt: skip
    recv = BroadcastNode(P2PTransport(peers[1].p2p), ChunkStore(tmp / "recv"), directory,
                         coord.public_key, direct=local)  # fmt: skip
    for knob, value in tune.items():
        assert seed.direct is not None
        setattr(seed.direct, knob, value)
    await seed.start()
    await recv.start()
    await seed.seed_version(env, chunks)
    return seed, recv, files, chunks


async def test_chunks_travel_over_a_direct_connection(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers)
    seed_t, recv_t = seed.direct, recv.direct
    assert seed_t is not None and recv_t is not None
    try:
        assert await recv.download(1, [a.peer_id]) == files
        # every chunk answer came over a direct connection, none over libp2p
        assert recv_t.direct_calls == len(chunks)
        assert seed.server.chunks_served == len(chunks)
        # and the connections were reused: far fewer than one per chunk
        assert 1 <= seed_t.connections_accepted <= 8 < len(chunks)
    finally:
        for n in (recv, seed):
            await n.stop()


async def test_a_peer_without_a_direct_port_is_asked_over_libp2p(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers, seed_direct=False)
    recv_t = recv.direct
    assert recv_t is not None
    try:
        assert await recv.download(1, [a.peer_id]) == files
        assert recv_t.direct_calls == 0 and seed.server.chunks_served == len(chunks)
        assert recv_t.fallbacks >= 1  # the ticket RPC is unknown there: libp2p from then on
    finally:
        for n in (recv, seed):
            await n.stop()


async def test_an_unreachable_direct_port_falls_back_to_libp2p(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    """The holder hands out a ticket for a port nobody listens on (a firewall, a NAT): the
    asker's dial fails and it asks over libp2p, within the connect timeout."""
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers)
    seed_t, recv_t = seed.direct, recv.direct
    assert seed_t is not None and recv_t is not None and seed_t._server is not None
    seed_t._server.close()  # still answers tickets, but the port is closed
    await seed_t._server.wait_closed()
    try:
        assert await recv.download(1, [a.peer_id]) == files
        assert recv_t.direct_calls == 0 and recv_t.fallbacks >= 1
        assert seed.server.chunks_served == len(chunks)
    finally:
        for n in (recv, seed):
            await n.stop()


async def _closed_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    async with asyncio.timeout(timeout):
        return await reader.read(1 << 16) == b""


async def test_the_direct_port_answers_only_a_ticket_it_issued_and_only_bulk_methods(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    a, _b = peers
    seed, recv, _files, _chunks = await broadcast(tmp_path, peers, hello_timeout=0.5)
    seed_t, recv_t = seed.direct, recv.direct
    assert seed_t is not None and recv_t is not None
    served = seed.server.chunks_served

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", seed_t.port)

    def frame(data: bytes) -> bytes:
        return _HEADER.pack(len(data)) + data

    try:
        # a ticket nobody issued: closed, the request never reaches the handler
        r, w = await dial()
        name = EXCHANGE_WINDOWED_RPC.encode()
        w.write(frame(os.urandom(TICKET_BYTES)) + frame(name) + frame(b"\x80"))
        assert await _closed_within(r, 2.0)
        w.close()
        # silence: closed after hello_timeout
        r, w = await dial()
        assert await _closed_within(r, 2.0)
        w.close()
        # an oversized hello: closed without reading it
        r, w = await dial()
        w.write(_HEADER.pack(1 << 30))
        assert await _closed_within(r, 2.0)
        w.close()
        # a real ticket (taken over libp2p), then a method that is not bulk: closed
        ticket = await recv_t._ticket(a.peer_id, 5.0)
        r, w = await dial()
        w.write(frame(ticket.ticket) + frame(b"/rollout-swarm/manifest/1") + frame(b"\x80"))
        assert await _closed_within(r, 2.0)
        w.close()
        assert seed.server.chunks_served == served
        assert seed_t.refused == 4
    finally:
        for n in (recv, seed):
            await n.stop()


async def test_a_connection_the_holder_closed_while_idle_is_replaced(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    """The holder closes a connection idle for ``idle_s``; the asker's next call on it finds it
    closed before any answer and retries on a new connection, not failing the request."""
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers, idle_s=0.3)
    seed_t, recv_t = seed.direct, recv.direct
    assert seed_t is not None and recv_t is not None
    try:
        assert await recv.download(1, [a.peer_id]) == files
        first = seed_t.connections_accepted
        await asyncio.sleep(0.8)  # every pooled connection is now closed at the holder
        request = ExchangeRequest(version=1, wanted=keys.bitmap_from_indices({3}, len(chunks)),
                                  have=b"", dialable=True)  # fmt: skip
        raw = await recv_t.call(a.peer_id, EXCHANGE_WINDOWED_RPC, encode(request), windowed=True,
                                max_response_bytes=1 << 20)  # fmt: skip
        assert decode(raw, ExchangeReply).data == chunks[3]
        assert recv_t.direct_calls == len(chunks) + 1
        assert seed_t.connections_accepted > first
        assert recv_t.fallbacks == 0
    finally:
        for n in (recv, seed):
            await n.stop()


async def test_a_peer_that_is_not_dialable_refuses_tickets(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    """Behind NAT a holder's direct port cannot be dialled: it refuses tickets (``unavailable``)
    and its askers use libp2p at once instead of waiting for a dial to time out."""
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers)
    seed.dialable = False
    assert recv.direct is not None
    try:
        t0 = time.monotonic()
        assert await recv.download(1, [a.peer_id]) == files
        # the requests in flight when the refusal came (seed_parallel, 2) fell back; the rest
        # never tried: the peer is left out of direct attempts for retry_s
        assert recv.direct.direct_calls == 0 and 1 <= recv.direct.fallbacks <= 2
        assert seed.server.chunks_served == len(chunks)
        assert time.monotonic() - t0 < recv.direct.dial_timeout + 5.0
    finally:
        for n in (recv, seed):
            await n.stop()


async def test_stopping_with_connections_open_logs_no_error(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer], caplog: pytest.LogCaptureFixture
) -> None:
    """stop() ends the holder's open connections (here: one idle between calls); none of them
    may surface as an error in asyncio's stream callback (Python 3.11 logs a cancelled
    connection handler's CancelledError there, with a traceback)."""
    a, _b = peers
    seed, recv, files, _chunks = await broadcast(tmp_path, peers)
    assert seed.direct is not None
    assert await recv.download(1, [a.peer_id]) == files
    assert seed.direct._conns  # the receiver keeps its connections for the next version
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await seed.stop()
        await asyncio.sleep(0.2)  # the stream protocol's callbacks run
    await recv.stop()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


async def test_a_closed_connection_whose_port_is_gone_falls_back_to_libp2p(
    tmp_path: Path, peers: tuple[SwarmPeer, SwarmPeer]
) -> None:
    """A kept connection that turns out closed at its first read (the holder closed it as the
    asker took it), and the holder's direct port is gone too: the asker cannot dial a new one
    and asks over libp2p instead of failing the request."""
    a, _b = peers
    seed, recv, files, chunks = await broadcast(tmp_path, peers)
    seed_t, recv_t = seed.direct, recv.direct
    assert seed_t is not None and recv_t is not None and seed_t._server is not None
    try:
        assert await recv.download(1, [a.peer_id]) == files
        seed_t._server.close()  # no new direct connections
        await seed_t._server.wait_closed()
        dead = asyncio.StreamReader()  # alive when taken, end of stream at the first read

        class ClosedByTheHolder:
            def write(self, data: bytes) -> None:
                asyncio.get_running_loop().call_soon(dead.feed_eof)

            async def drain(self) -> None:
                return None

            def close(self) -> None:
                return None

            def is_closing(self) -> bool:
                return False

        recv_t._pools[a.peer_id] = _Pool(idle=[(dead, ClosedByTheHolder(), recv_t.clock())])  # type: ignore[list-item]
        request = ExchangeRequest(version=1, wanted=keys.bitmap_from_indices({5}, len(chunks)),
                                  have=b"", dialable=True)  # fmt: skip
        raw = await recv_t.call(a.peer_id, EXCHANGE_WINDOWED_RPC, encode(request), windowed=True,
                                max_response_bytes=1 << 20)  # fmt: skip
        assert decode(raw, ExchangeReply).data == chunks[5]
        assert recv_t.direct_calls == len(chunks) and recv_t.fallbacks == 1
    finally:
        for n in (recv, seed):
            await n.stop()
