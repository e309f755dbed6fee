"""Request/response RPC between peers over libp2p binary streams.

One RPC = one libp2p stream named after the method. Wire format (both directions use the
4-byte big-endian length prefix of ``protocol.codec.frame``)::

    client -> server   frame(request bytes)
    server -> client   frame(status byte + body)   status 0: body = response bytes
                                                  status 1: body = UTF-8 "code: detail"

Handlers are ``async (peer_id, request_bytes) -> response_bytes``; raising
:class:`HandlerError` (or a ``protocol.errors.ProtocolError``) answers with that code, anything
else answers ``internal``. Every connect/read/write has a timeout. A server refuses a request
whose length prefix is over its limit without buffering the body, and after answering waits
(briefly) for the caller to close, so that the answer is not lost to a stream reset. Foreign
errors (libp2p daemon, OS, asyncio) are mapped to :mod:`swarm.errors` in exactly one place,
:func:`_translate`.
Responses are written in slices through an optional :class:`~swarm.ratelimit.TokenBucket`, which
caps this peer's upload rate smoothly; control answers (methods not registered ``windowed``) go
ahead of bulk ones waiting for it.

Bulk answers (``register(..., windowed=True)``, e.g. chunks) are paced by the caller: the caller
acknowledges the body bytes it has received (8-byte cumulative counts, :mod:`swarm.bulkwindow`)
and the server keeps at most :attr:`P2PTransport.bulk_window` bytes unacknowledged over all its
windowed streams, so DHT messages and RPC answers sharing the libp2p connection (one yamux
session over one TCP connection per peer pair) do not queue behind MiBs of chunk data. The caller
must pass ``windowed=True`` for such a method (its name says so, e.g. ``.../exchange/2``).
Windowed answers go out oldest first, and a new one is answered ``busy`` when those already
accepted would take longer than the window's horizon (``BulkWindow.crowded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from swarm.bulkwindow import BulkWindow, drain_within, read_acked, write_windowed
from swarm.errors import DialFailed, PeerUnreachable, RemoteError, RpcTimeout, TransportError
from swarm.ratelimit import TokenBucket

logger = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[bytes]]
"""An RPC handler: ``(caller peer id, request bytes) -> response bytes``."""
ProgressFn = Callable[[int, int], None]
"""``(bytes received so far, total bytes)`` of a response being read."""

_HEADER = struct.Struct(">I")  # same prefix as protocol.codec.frame
_OK, _ERR = 0, 1
_SLICE = 64 * 1024
_BIG_SLICE = 256 * 1024  # without an upload cap: fewer writes and drains per answer
#: Slowest average rate at which a caller must take an answer (bytes/s; see write_sliced).
MIN_READ_BPS = 32 * 1024
_LINGER_S = 2.0  # after answering, wait at most this long for the caller to close the stream
_MAX_LINGERING = 256  # streams waiting so at once (beyond: closed at once, as before)
DEFAULT_MAX_REQUEST = 1 << 20
DEFAULT_MAX_RESPONSE = 64 << 20


class HandlerError(Exception):
    """Raised by a handler to answer the caller with ``code: detail`` (becomes ``RemoteError``)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class Transport(Protocol):
    """What the rest of the code base needs from an RPC transport (libp2p or in-memory)."""

    @property
    def peer_id(self) -> str: ...

    async def register(
        self,
        name: str,
        handler: Handler,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        max_streams_per_peer: int | None = None,
        windowed: bool = False,
    ) -> None: ...

    async def unregister(self, name: str) -> None: ...

    async def call(
        self,
        peer_id: str,
        name: str,
        request: bytes,
        *,
        timeout: float = 10.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE,
        on_progress: ProgressFn | None = None,
        stall_timeout: float | None = None,
        connect_timeout: float | None = None,
        windowed: bool = False,
    ) -> bytes: ...


def error_body(exc: BaseException) -> tuple[str, str]:
    """(code, detail) to send back for an exception raised by a handler."""
    if isinstance(exc, HandlerError):
        return exc.code, exc.detail
    code = getattr(exc, "code", None)  # protocol.errors.ProtocolError
    if code is not None and hasattr(exc, "detail"):
        return str(code), str(exc.detail)
    return "internal", f"{type(exc).__name__} in handler"


def decode_error(body: bytes) -> RemoteError:
    code, _, detail = body.decode("utf-8", "replace").partition(": ")
    return RemoteError(code or "internal", detail or "no detail")


def encode_error(code: str, detail: str) -> bytes:
    """The wire body of an error answer; :func:`decode_error` reads it back."""
    return f"{code}: {detail}".encode()


# Refusals a serving peer answers before its handler runs; every transport uses these.
BUSY = ("busy", "too many concurrent streams from this peer")
CROWDED = ("busy", "this holder's uplink is booked for the next seconds; ask another holder")


def request_too_large(size: int, max_request_bytes: int) -> tuple[str, str]:
    return "frame_too_large", f"request of {size} B > {max_request_bytes} B"


def unknown_method(name: str) -> RemoteError:
    return RemoteError("unknown_method", f"peer does not serve {name!r}")


def _translate(exc: BaseException, peer_id: str, name: str, stage: str) -> TransportError:
    """The single boundary mapping foreign exceptions of a call to swarm errors."""
    if isinstance(exc, TransportError):
        return exc
    where = f"{name} on {peer_id[:16]}... ({stage})"
    text = " ".join(str(exc).split())
    if stage == "connect" and "protocols not supported" not in text:
        why = f"{type(exc).__name__}: {text[:200]}"
        if isinstance(exc, TimeoutError):
            why = "timed out"
        return DialFailed(f"{where}: could not connect ({why}); the peer is behind NAT or gone")
    if isinstance(exc, TimeoutError):
        return RpcTimeout(f"{where} timed out; the peer is slow or gone, try another peer")
    if "protocols not supported" in text:
        return unknown_method(name)
    if isinstance(exc, asyncio.IncompleteReadError):
        return PeerUnreachable(f"{where}: stream closed early; the peer went away")
    return PeerUnreachable(f"{where}: {type(exc).__name__}: {text[:200]}")


async def _read_exactly(
    reader: asyncio.StreamReader,
    n: int,
    *,
    stall_timeout: float,
    deadline: float,
    on_progress: ProgressFn | None = None,
) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray(n)  # one buffer, filled in place (no regrowth copies)
    got = 0
    while got < n:
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError
        async with asyncio.timeout(min(stall_timeout, left)):  # no task per read, as wait_for
            piece = await reader.read(min(n - got, 1 << 20))
        if not piece:
            raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
        buf[got : got + len(piece)] = piece
        got += len(piece)
        if on_progress is not None:
            on_progress(got, n)
    return bytes(buf)


async def _discard(reader: asyncio.StreamReader, n: int, deadline: float) -> None:
    """Read and drop up to ``n`` bytes until the caller closes or ``deadline`` passes.

    Called after the answer is written. Closing a stream with input still unread, or before the
    caller has read the answer, can reset it (p2pd tears both directions down) and the reset can
    overtake the answer: the caller would see "stream closed" instead of, say,
    ``frame_too_large`` for a request over the limit (whose body is dropped here, never buffered).
    Memory stays at one read buffer whatever ``n`` is.
    """
    loop = asyncio.get_running_loop()
    with contextlib.suppress(TimeoutError, OSError):
        while n > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            piece = await asyncio.wait_for(reader.read(min(n, _SLICE)), left)
            if not piece:
                return
            n -= len(piece)


async def write_sliced(
    writer: asyncio.StreamWriter,
    data: bytes,
    *,
    timeout: float,
    limiter: TokenBucket | None,
    urgent: bool = False,
) -> None:
    """Write ``data`` in slices (64 KiB through ``limiter``, 256 KiB without), each drain
    bounded by timeout.

    The reader must also take the whole of ``data`` at :data:`MIN_READ_BPS` on average (time spent
    waiting for the upload limiter is not counted): a peer reading a byte now and then cannot
    hold a stream (and the answer's memory) for ``timeout`` per slice. ``urgent`` (control
    answers) passes the limiter's queue of bulk writers (its bytes still count)."""
    loop = asyncio.get_running_loop()
    budget = timeout + len(data) / MIN_READ_BPS
    view = memoryview(data)
    step = _SLICE if limiter is not None else _BIG_SLICE  # the cap is smooth only in small steps
    for start in range(0, len(view), step):
        piece = view[start : start + step]
        if limiter is not None:
            await limiter.acquire(len(piece), urgent=urgent)
        writer.write(piece)
        t0 = loop.time()
        await drain_within(writer, min(timeout, budget))
        budget -= loop.time() - t0
        if budget <= 0:
            raise TimeoutError(f"the reader took {len(data)} bytes slower than {MIN_READ_BPS} B/s")


async def read_answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    size: int,
    what: str,
    *,
    max_response_bytes: int,
    windowed: bool,
    on_progress: ProgressFn | None,
    stall_timeout: float,
    deadline: float,
    settle: float = 0.0,
) -> tuple[int, bytes]:
    """(status, body) of an answer frame whose length prefix ``size`` the caller read; a
    windowed OK body is acknowledged as it arrives (``read_acked``, with its ``settle``)."""
    kw: dict[str, Any] = {"stall_timeout": stall_timeout, "deadline": deadline}
    if size == 0 or size > max_response_bytes + 1:
        raise PeerUnreachable(f"bad response size {size}: {what}")
    status = (await _read_exactly(reader, 1, **kw))[0]
    if status == _OK and windowed:
        body = await read_acked(reader, writer, size - 1, on_progress=on_progress,
                                settle=settle, **kw)  # fmt: skip
    else:
        prog = on_progress if status == _OK else None
        body = await _read_exactly(reader, size - 1, on_progress=prog, **kw)
    return status, body


class P2PTransport:
    """RPC over a hivemind ``P2P`` handle (see :attr:`swarm.dht.SwarmPeer.p2p`)."""

    def __init__(
        self,
        p2p: Any,
        *,
        upload_limiter: TokenBucket | None = None,
        max_streams_per_peer: int = 16,
        io_timeout: float = 30.0,
        bulk_window: BulkWindow | None = None,
        ack_timeout: float = 10.0,
    ) -> None:
        self._p2p = p2p
        self.upload_limiter = upload_limiter
        #: bytes of windowed answers in flight, over all streams (swarm.bulkwindow)
        self.bulk_window = bulk_window if bulk_window is not None else BulkWindow()
        self.ack_timeout = ack_timeout
        self.max_streams_per_peer = max_streams_per_peer
        self.io_timeout = io_timeout
        self._active: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._lingering = 0
        #: the remote multiaddr of the last stream opened to each peer (``swarm.direct`` dials
        #: its IP: the address this peer's libp2p connection actually reached)
        self.remote_addrs: dict[str, str] = {}

    @property
    def peer_id(self) -> str:
        return str(self._p2p.peer_id.to_base58())

    async def register(
        self,
        name: str,
        handler: Handler,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        max_streams_per_peer: int | None = None,
        windowed: bool = False,
    ) -> None:
        """Serve ``name``; a caller with more than ``max_streams_per_peer`` (default: the
        transport's) concurrent streams of this method is answered ``busy`` at once.
        ``windowed``: a bulk method, answered through :attr:`bulk_window` (callers acknowledge:
        ``call(..., windowed=True)``); other answers are control and go first."""
        limit = self.max_streams_per_peer if max_streams_per_peer is None else max_streams_per_peer

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: Any) -> None:
            caller = str(info.peer_id.to_base58())
            args = (caller, name, handler, max_request_bytes, limit, reader, writer)
            await self._serve(*args, windowed=windowed)

        await self._p2p.add_binary_stream_handler(name, on_stream)

    async def unregister(self, name: str) -> None:
        await self._p2p.remove_binary_stream_handler(name)

    async def _serve(
        self,
        caller: str,
        name: str,
        handler: Handler,
        max_request_bytes: int,
        limit: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        windowed: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.io_timeout
        try:
            args = (caller, name, handler, max_request_bytes, limit, reader, writer, deadline)
            if await self.answer(*args, windowed=windowed) and self._lingering < _MAX_LINGERING:
                # Let the caller close first: closing our end while the answer is still in flight
                # can reset the stream (p2pd tears both directions down) and lose the answer.
                # The caller's slot is free already; the global cap bounds idle open streams.
                self._lingering += 1
                try:
                    await _discard(reader, _SLICE, min(deadline, loop.time() + _LINGER_S))
                finally:
                    self._lingering -= 1
        finally:
            writer.close()

    async def answer(
        self,
        caller: str,
        name: str,
        handler: Handler,
        max_request_bytes: int,
        limit: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        deadline: float,
        *,
        windowed: bool = False,
        request: bytes | None = None,
    ) -> bool:
        """Read one request (unless given: ``request``, read by the caller) and write its
        answer, holding one of the caller's ``limit`` slots of this method meanwhile; False when
        the stream failed or timed out first. Also serves :mod:`swarm.direct`'s connections."""
        slot = (name, caller)
        self._active[slot] += 1
        try:
            unread = 0
            if self._active[slot] > limit:
                status, body = _ERR, encode_error(*BUSY)
            elif windowed and self.bulk_window.crowded():
                # the answers accepted already fill the uplink for a while: queued behind them
                # this one would get no byte for seconds (its asker would give us up as slow)
                status, body = _ERR, encode_error(*CROWDED)
            else:
                status, body, unread = await self._handle(
                    caller, handler, max_request_bytes, reader, deadline, request
                )
            writer.write(_HEADER.pack(len(body) + 1) + bytes([status]))
            if windowed and status == _OK:  # the caller acknowledges the body as it arrives
                await write_windowed(
                    writer, reader, body, window=self.bulk_window, timeout=self.io_timeout,
                    ack_timeout=self.ack_timeout, limiter=self.upload_limiter,
                )  # fmt: skip
            else:
                # only a small answer is control traffic: a large one on an unwindowed method
                # (the per-chunk RPCs, exchange/1) is bulk and waits its turn under the cap
                limiter = self.upload_limiter
                await write_sliced(writer, body, timeout=self.io_timeout, limiter=limiter,
                                   urgent=not windowed and len(body) <= _SLICE)  # fmt: skip
            if unread:  # the rest of a refused request: let the caller finish writing it
                await _discard(reader, unread, deadline)
            return True
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            logger.debug("stream %s from %s ended: %r", name, caller, exc)
            return False
        finally:
            self._active[slot] -= 1
            if self._active[slot] <= 0:
                del self._active[slot]

    async def _handle(
        self,
        caller: str,
        handler: Handler,
        max_request_bytes: int,
        reader: asyncio.StreamReader,
        deadline: float,
        request: bytes | None = None,
    ) -> tuple[int, bytes, int]:
        """(status, body, bytes of the request left unread) for one request (read here unless
        given)."""
        if request is None:
            kw: dict[str, Any] = {"stall_timeout": self.io_timeout, "deadline": deadline}
            (size,) = _HEADER.unpack(await _read_exactly(reader, _HEADER.size, **kw))
            if size > max_request_bytes:  # refused on the prefix: the body is never buffered
                return _ERR, encode_error(*request_too_large(size, max_request_bytes)), size
            request = await _read_exactly(reader, size, **kw)
        try:
            return _OK, await handler(caller, request), 0
        except Exception as exc:  # answered to the caller, logged here
            code, detail = error_body(exc)
            if code == "internal":
                logger.exception("handler failed for %s", caller)
            return _ERR, encode_error(code, detail), 0

    async def call(
        self,
        peer_id: str,
        name: str,
        request: bytes,
        *,
        timeout: float = 10.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE,
        on_progress: ProgressFn | None = None,
        stall_timeout: float | None = None,
        connect_timeout: float | None = None,
        windowed: bool = False,
    ) -> bytes:
        """Call ``name`` on ``peer_id``; whole call bounded by ``timeout``, opening the stream
        (dialling the peer if there is no connection yet) by ``connect_timeout``, each read by
        ``stall_timeout`` (both default: ``timeout``). A stream that cannot be opened raises
        ``DialFailed``. ``windowed``: ``name`` is a bulk method (registered ``windowed``) whose
        answer this caller acknowledges as it arrives. Raises ``TransportError`` subclasses
        only."""
        from hivemind.p2p import PeerID

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stall = timeout if stall_timeout is None else stall_timeout
        dial = min(timeout, stall if connect_timeout is None else connect_timeout)
        stage, writer = "connect", None
        try:
            pid = PeerID.from_base58(peer_id)
            info, reader, writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(pid, name), dial
            )
            self.remote_addrs[peer_id] = str(info.addr)
            stage = "write"
            writer.write(_HEADER.pack(len(request)) + request)
            await asyncio.wait_for(writer.drain(), max(deadline - loop.time(), 0.001))
            stage = "read"
            kw: dict[str, Any] = {"stall_timeout": stall, "deadline": deadline}
            (size,) = _HEADER.unpack(await _read_exactly(reader, _HEADER.size, **kw))
            status, body = await read_answer(
                reader, writer, size, f"{name} from {peer_id[:16]}...",
                max_response_bytes=max_response_bytes, windowed=windowed,
                on_progress=on_progress, **kw,
            )  # fmt: skip
        except Exception as exc:
            raise _translate(exc, peer_id, name, stage) from exc
        finally:
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
        if status != _OK:
            raise decode_error(body)
        return body
