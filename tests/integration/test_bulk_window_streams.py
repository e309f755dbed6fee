"""Windowed answers on real streams (``swarm.bulkwindow``): over TCP on 127.0.0.1 and through
p2pd. The bytes arrive intact, the window is empty afterwards, a reader that never acknowledges
or lies about what it received cannot hold the window, and an error answer is not windowed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from swarm.bulkwindow import (
    ACK,
    BULK_SLICE,
    MIN_SLICE,
    BulkWindow,
    read_acked,
    write_windowed,
)
from swarm.dht import SwarmPeer
from swarm.errors import RemoteError
from swarm.testing import start_loopback_peer, wait_until
from swarm.transport import HandlerError, P2PTransport

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def tcp_pair(
    serve: Serve,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server]:
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return reader, writer, server


async def test_windowed_bytes_arrive_whole_and_the_window_empties() -> None:
    data = os.urandom(5 * BULK_SLICE + 123)
    window = BulkWindow(initial=2 * BULK_SLICE, min_window=BULK_SLICE)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await write_windowed(w, r, data, window=window, timeout=10.0, ack_timeout=5.0)
            done.set_result(None)
        except Exception as exc:  # reported to the test
            done.set_exception(exc)
        finally:
            w.close()

    reader, writer, server = await tcp_pair(serve)
    loop = asyncio.get_running_loop()
    got = await read_acked(reader, writer, len(data), stall_timeout=10.0,
                           deadline=loop.time() + 10.0)  # fmt: skip
    await asyncio.wait_for(done, 10.0)
    assert got == data
    stats = window.statistics()
    assert stats.inflight == 0 and stats.acked == len(data) and stats.base_rtt is not None
    writer.close()
    server.close()


async def test_streams_sharing_a_small_window_do_not_wait_on_each_other() -> None:
    """Four answers through one window of two small slices: each reader must acknowledge what
    it has, however little, or the streams holding the window wait for each other's bytes."""
    window = BulkWindow(initial=2 * MIN_SLICE, min_window=2 * MIN_SLICE, max_window=2 * MIN_SLICE)
    data = os.urandom(10 * MIN_SLICE)
    errors: list[BaseException] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await write_windowed(w, r, data, window=window, timeout=10.0, ack_timeout=2.0)
        except Exception as exc:
            errors.append(exc)
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()

    async def fetch() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await read_acked(reader, writer, len(data), stall_timeout=10.0,
                                    deadline=loop.time() + 20.0)  # fmt: skip
        finally:
            writer.close()

    t0 = loop.time()
    got = await asyncio.wait_for(asyncio.gather(*(fetch() for _ in range(4))), 30.0)
    assert all(g == data for g in got) and not errors, errors
    assert loop.time() - t0 < 2.0, "streams waited for acknowledgements held back"
    server.close()


def serve_windowed(data: bytes, outcome: asyncio.Future[BaseException | None], **kw: Any) -> Serve:
    """A server that answers ``data`` through ``write_windowed(**kw)`` and settles ``outcome``
    with what ended it (None when all was acknowledged)."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await write_windowed(w, r, data, **kw)
            outcome.set_result(None)
        except Exception as exc:
            outcome.set_result(exc)
        finally:
            w.close()

    return serve


@pytest.mark.parametrize("lie", [False, True])
async def test_a_reader_that_does_not_acknowledge_cannot_hold_the_window(lie: bool) -> None:
    """Never acknowledging ends the stream after ``ack_timeout``; acknowledging bytes that were
    never sent ends it at once. Either way the window is released for the other streams."""
    data = os.urandom(8 * BULK_SLICE)
    window = BulkWindow(initial=2 * BULK_SLICE, min_window=BULK_SLICE)
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    serve = serve_windowed(data, outcome, window=window, timeout=10.0, ack_timeout=0.5)
    reader, writer, server = await tcp_pair(serve)
    await reader.readexactly(BULK_SLICE)  # reads (so TCP is not what blocks) ...
    if lie:
        writer.write(ACK.pack(len(data)))  # ... and claims everything, or says nothing
    exc = await asyncio.wait_for(outcome, 10.0)
    assert isinstance(exc, ValueError if lie else TimeoutError), exc
    assert window.inflight == 0
    writer.close()
    server.close()


@pytest.mark.parametrize("reader_kind", ["repeats", "trickles", "keeps up"])
async def test_a_reader_must_acknowledge_progress_to_hold_the_window(reader_kind: str) -> None:
    """A reader that repeats its last count, or advances it by a trickle, is ended after
    ``ack_timeout`` like one that says nothing (each acknowledgement used to restart the clock,
    so it could hold its bytes of the window for as long as the writer's whole timeout); one that
    keeps up is served whole."""
    data = os.urandom(16 * BULK_SLICE)
    window = BulkWindow(initial=4 * BULK_SLICE, min_window=BULK_SLICE)
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()
    serve = serve_windowed(data, outcome, window=window, timeout=30.0, ack_timeout=0.6,
                           min_progress=4 * BULK_SLICE)  # fmt: skip
    reader, writer, server = await tcp_pair(serve)
    started = loop.time()
    got = 0
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # the writer quit
        while not outcome.done() and got < len(data):
            if reader_kind == "keeps up":
                got += len(await reader.read(1 << 20))
            elif reader_kind == "trickles":  # 1 KiB every 0.1 s: 6 KiB per ack_timeout
                got += len(await reader.readexactly(1024))
            elif got == 0:
                got = len(await reader.readexactly(BULK_SLICE))
            writer.write(ACK.pack(got))
            if reader_kind != "keeps up":
                await asyncio.sleep(0.1)
    exc = await asyncio.wait_for(outcome, 30.0)
    if reader_kind == "keeps up":
        assert exc is None and got == len(data)
    else:
        assert isinstance(exc, TimeoutError) and "acknowledged in" in str(exc), exc
        assert loop.time() - started < 5.0  # ack_timeout, not the writer's 30 s timeout
    assert window.inflight == 0 and window.statistics().answers == 0
    writer.close()
    server.close()


class OffsetClock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SwarmPeer, SwarmPeer]]:
    a = await start_loopback_peer()
    b = await start_loopback_peer(await a.visible_maddrs())
    yield a, b
    await asyncio.gather(a.stop(), b.stop())


async def test_windowed_rpc_through_p2pd(pair: tuple[SwarmPeer, SwarmPeer]) -> None:
    a, b = pair
    # three answers always accepted, and a horizon no loaded machine reaches: the three
    # concurrent answers are all accepted; a clock the test can move on
    clock = OffsetClock()
    window = BulkWindow(horizon=3600.0, min_answers=3, clock=clock)
    server = P2PTransport(a.p2p, bulk_window=window)
    client = P2PTransport(b.p2p)
    payload = os.urandom(3 << 20)

    async def bulk(peer: str, req: bytes) -> bytes:
        if req == b"no":
            raise HandlerError("not_held", "nothing here")
        return payload

    await server.register("/t/bulk/2", bulk, windowed=True)
    got = await asyncio.gather(*(client.call(a.peer_id, "/t/bulk/2", b"", timeout=60.0,
                                             windowed=True) for _ in range(3)))  # fmt: skip
    assert all(g == payload for g in got)

    async def settled() -> bool:
        # the last acknowledgements reach the server just after the caller has every byte, and
        # each answer is closed just after its last acknowledgement (the writer's task ends)
        stats = server.bulk_window.statistics()
        return stats.inflight == 0 and stats.answers == 0

    await wait_until(settled, timeout=5.0, what="the last acknowledgements and answers closed")
    stats = server.bulk_window.statistics()
    assert stats.inflight == 0 and stats.acked == 3 * len(payload)
    with pytest.raises(RemoteError, match="not_held"):  # an error answer is not windowed
        await client.call(a.peer_id, "/t/bulk/2", b"no", timeout=10.0, windowed=True)
    assert server.bulk_window.inflight == 0
    assert stats.answers == 0 and stats.queued == 0  # every answer closed
    # A holder whose accepted answers book its uplink for longer than the horizon refuses a
    # new one at once ("busy": the asker tries another holder) instead of queueing it.
    window.horizon = 0.001
    booked = [window.open_answer(8 << 20) for _ in range(3)]
    clock.offset += window.rate_window  # open that long, nothing acknowledged: rate 0
    with pytest.raises(RemoteError, match="busy"):
        await client.call(a.peer_id, "/t/bulk/2", b"", timeout=10.0, windowed=True)
    for answer in booked:
        window.close_answer(answer)
    got_again = await client.call(a.peer_id, "/t/bulk/2", b"", timeout=60.0, windowed=True)
    assert got_again == payload
