"""Bulk answers over direct TCP connections, off the libp2p daemon.

Why. Every chunk that crosses libp2p passes through two ``p2pd`` processes (yamux framing, Noise
encryption, a unix socket to Python at each end): on an unshaped loopback hop that is half the
CPU of moving a GiB (``bench/bulk_cpu.py``: p2pd 9.5 and Python 11.2 CPU-s per GiB on the machine
of 2026-12-08; over direct TCP, Python alone 8.5-8.9). Chunks need neither encryption nor
libp2p's authentication to be safe: every chunk is checked against the signed manifest's hash.
What they need is a sender the asker can hold to account, and that the libp2p exchange already
gives: the asker gets a *ticket* from the holder over the authenticated libp2p stream, then opens
a plain TCP connection and presents it.

Wire (all frames are ``protocol.codec.frame``'s 4-byte big-endian length prefix + bytes):

1. Over libp2p, ``TICKET_RPC`` (``/rollout-swarm/direct/1``): request ``DirectTicketRequest``,
   answer ``DirectTicket`` (``port``, ``ticket``: 16 random bytes, ``ttl_s``).
2. The asker dials the holder's IP as seen on its libp2p connection to it (the remote address of
   the ticket's stream; relayed or non-IP addresses: no direct path) at ``port`` and writes
   ``frame(ticket)``. An unknown or expired ticket: the holder closes the connection.
3. Then calls, one after another on the connection: ``frame(method name, UTF-8)`` followed by the
   method's usual exchange (:mod:`swarm.transport`: request frame, answer frame, and for a
   windowed method the asker's byte counts). Only methods registered ``windowed`` are served; any
   other name closes the connection. A connection idle for ``idle_s`` is closed by the holder.

The asker falls back to libp2p whenever the direct path fails before an answer started (no ticket
RPC on an older peer, no IP address, the dial or the ticket refused), and does not try that peer
directly again for ``retry_s``. A failure once the answer's bytes flow is the request's, as over
libp2p. Connections are kept for the next call (``max_idle_per_peer``), so a request costs no
TCP handshake and no slow start after the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from msgspec import Meta

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.schema import U32, MessageBase
from swarm.errors import DialFailed, PeerUnreachable, RemoteError, RpcTimeout, TransportError
from swarm.transport import (
    _HEADER,
    _OK,
    DEFAULT_MAX_REQUEST,
    DEFAULT_MAX_RESPONSE,
    Handler,
    HandlerError,
    P2PTransport,
    ProgressFn,
    _read_exactly,
    decode_error,
    read_answer,
)

logger = logging.getLogger(__name__)

TICKET_RPC = "/rollout-swarm/direct/1"
TICKET_BYTES = 16
MAX_NAME_BYTES = 256  # a method name frame


class DirectTicketRequest(MessageBase):
    """Ask a holder for a ticket to its direct TCP port (no fields)."""


class DirectTicket(MessageBase):
    """Where and how to reach a holder's bulk answers directly."""

    port: Annotated[int, Meta(ge=1, le=65535)]  # the holder's direct TCP port
    ticket: Annotated[bytes, Meta(min_length=TICKET_BYTES, max_length=TICKET_BYTES)]
    ttl_s: U32  # the ticket is accepted for this long after it was issued


_IP_ADDR = re.compile(r"^/ip[46]/([^/]+)/tcp/\d+")


def dial_host(maddr: str) -> str | None:
    """The IP address of a libp2p connection's remote multiaddr, or None when it is not a plain
    TCP/IP address (a relay circuit, DNS, QUIC...)."""
    if "/p2p-circuit" in maddr:
        return None
    m = _IP_ADDR.match(maddr)
    if m is None:
        return None
    try:
        return str(ipaddress.ip_address(m.group(1)))
    except ValueError:
        return None


SETTLE_S = 0.004
"""After a small read of an answer body, a direct reader waits this long before the next: a TCP
socket is readable as soon as one segment arrives, so on a shaped link a reader woke for every
few KiB and acknowledged each (p2pd hands over whole yamux frames): 58 CPU-s per GiB and hop of
Python against 28 over libp2p. A socket low-water mark would wake it less often but can hold
back bytes the writer sends only once they are acknowledged (a window under the mark): a
deadlock, where a pause cannot. The pause adds at most this much to the writer's RTT samples,
to the base delay as much as to the current one."""


@dataclass(frozen=True)
class DirectSettings:
    """Where a peer's direct server listens (:class:`DirectTransport`); port 0: any free port
    (a peer behind a firewall opens a fixed one)."""

    host: str = "0.0.0.0"
    port: int = 0


def settings_for(listen_maddrs: Sequence[str], port: int) -> DirectSettings | None:
    """The direct server of a peer whose libp2p host listens on ``listen_maddrs`` (on the first
    one's IP address; any address when it has none) at ``port``; None for port -1 (off)."""
    if port < 0:
        return None
    host = next((h for m in listen_maddrs if (h := dial_host(m)) is not None), "0.0.0.0")
    return DirectSettings(host=host, port=port)


@dataclass
class _Ticket:
    host: str
    port: int
    ticket: bytes
    expires: float


@dataclass
class _Pool:
    """Idle connections to one peer, newest last: (reader, writer, idle since)."""

    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = field(
        default_factory=list
    )


class DirectTransport:
    """A :class:`~swarm.transport.Transport` that carries windowed (bulk) calls over direct TCP
    connections and everything else over ``inner`` (libp2p); see the module doc.

    ``host``/``port``: where the direct server listens (port 0: any free port). ``serve=False``
    only asks others directly; while ``serve_when()`` is False (a peer others cannot dial: its
    reachability says so) tickets are refused ``unavailable`` and askers use libp2p at once,
    instead of timing out on a dial. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        inner: P2PTransport,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        serve: bool = True,
        ticket_ttl: float = 600.0,
        hello_timeout: float = 5.0,
        idle_s: float = 30.0,
        retry_s: float = 60.0,
        max_connections: int = 256,
        max_idle_per_peer: int = 4,
        settle: float = SETTLE_S,
        dial_timeout: float = 2.0,
        serve_when: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.host, self.port, self.serve = host, port, serve
        self.serve_when = serve_when
        self.dial_timeout = dial_timeout
        self.ticket_ttl, self.hello_timeout, self.idle_s = ticket_ttl, hello_timeout, idle_s
        self.retry_s, self.max_connections = retry_s, max_connections
        self.max_idle_per_peer = max_idle_per_peer
        self.settle = settle
        self.clock = clock
        self._server: asyncio.Server | None = None
        #: windowed methods served directly: name -> (handler, max request bytes, stream limit)
        self._bulk: dict[str, tuple[Handler, int, int]] = {}
        self._issued: dict[bytes, tuple[str, float]] = {}  # ticket -> (peer id, expiry)
        self._by_peer: dict[str, bytes] = {}  # the ticket issued to each peer (one each)
        self._tickets: dict[str, _Ticket] = {}  # tickets we hold, by holder
        self._asking: dict[str, asyncio.Task[_Ticket]] = {}  # ticket requests under way
        self._no_direct: dict[str, float] = {}  # peer -> until when not to try directly
        self._pools: dict[str, _Pool] = {}
        self._conns: set[asyncio.Task[None]] = set()
        self.direct_calls = 0  # calls answered OK over a direct connection (for benchmarks)
        self.fallbacks = 0  # times a peer's direct path failed and libp2p was used instead
        self.connections_accepted = 0  # direct connections that presented a ticket issued here
        self.refused = 0  # direct connections closed for a bad hello, ticket or method

    # -- Transport ------------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    async def start(self) -> None:
        """Listen on the direct port and answer ticket requests (when serving)."""
        if not self.serve or self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._on_connection, self.host, self.port, limit=1 << 20
        )
        self.port = self._server.sockets[0].getsockname()[1]
        await self.inner.register(TICKET_RPC, self._on_ticket, max_request_bytes=256)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self.inner.unregister(TICKET_RPC)
            self._server = None
        tasks = [*self._conns, *self._asking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in self._pools.values():
            for _r, w, _t in pool.idle:
                w.close()
        self._pools.clear()

    async def register(
        self,
        name: str,
        handler: Handler,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        max_streams_per_peer: int | None = None,
        windowed: bool = False,
    ) -> None:
        await self.inner.register(name, handler, max_request_bytes=max_request_bytes,
                                  max_streams_per_peer=max_streams_per_peer,
                                  windowed=windowed)  # fmt: skip
        if windowed:
            limit = self.inner.max_streams_per_peer
            self._bulk[name] = (handler, max_request_bytes, max_streams_per_peer or limit)

    async def unregister(self, name: str) -> None:
        self._bulk.pop(name, None)
        await self.inner.unregister(name)

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
        """As :meth:`P2PTransport.call`; a windowed call goes directly when it can."""
        kw: dict[str, Any] = {
            "timeout": timeout, "max_response_bytes": max_response_bytes,
            "on_progress": on_progress, "stall_timeout": stall_timeout,
            "connect_timeout": connect_timeout, "windowed": windowed,
        }  # fmt: skip
        if windowed and self.clock() >= self._no_direct.get(peer_id, 0.0):
            try:
                conn = await self._connection(peer_id, timeout, connect_timeout)
            except (TransportError, ProtocolError) as exc:
                self.fallbacks += 1
                self._no_direct[peer_id] = self.clock() + self.retry_s
                logger.debug("no direct path to %s (%s); over libp2p", peer_id[:12], exc)
            else:
                return await self._call_direct(peer_id, conn, name, request, **kw)
        return await self.inner.call(peer_id, name, request, **kw)

    # -- asking ---------------------------------------------------------------------------------
    async def _ticket(self, peer_id: str, timeout: float) -> _Ticket:
        """The ticket held for ``peer_id``, or a new one; concurrent callers share one ask (the
        holder keeps one ticket per peer: a second ask would void the first)."""
        held = self._tickets.get(peer_id)
        if held is not None and held.expires > self.clock():
            return held
        task = self._asking.get(peer_id)
        if task is None:
            task = asyncio.create_task(self._ask_ticket(peer_id, timeout), name="direct-ticket")
            self._asking[peer_id] = task
            task.add_done_callback(lambda _t: self._asking.pop(peer_id, None))
        return await asyncio.shield(task)

    async def _ask_ticket(self, peer_id: str, timeout: float) -> _Ticket:
        now = self.clock()
        try:
            raw = await self.inner.call(peer_id, TICKET_RPC, encode(DirectTicketRequest()),
                                        timeout=timeout, max_response_bytes=256)  # fmt: skip
        except RemoteError as exc:  # unknown_method: an older peer, or one that does not serve
            raise PeerUnreachable(f"no direct ticket: {exc}") from exc
        msg = decode(raw, DirectTicket)
        host = dial_host(self.inner.remote_addrs.get(peer_id, ""))
        if host is None:
            raise PeerUnreachable("no IP address for a direct connection")
        # renewed a little early: a ticket must not expire between taking and presenting it
        ticket = _Ticket(host, msg.port, msg.ticket, now + 0.9 * msg.ttl_s)
        self._tickets[peer_id] = ticket
        return ticket

    async def _connection(
        self, peer_id: str, timeout: float, connect_timeout: float | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """An idle connection to ``peer_id`` (reused: True) or a new one that presented its
        ticket. Raises ``TransportError`` when there is no direct path."""
        pool = self._pools.get(peer_id)
        now = self.clock()
        while pool is not None and pool.idle:
            reader, writer, since = pool.idle.pop()
            # the holder closes connections idle for idle_s: do not race it
            if now - since < self.idle_s / 2 and not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()
        dial = min(timeout, connect_timeout if connect_timeout is not None else timeout)
        ticket = await self._ticket(peer_id, dial)
        dial = min(dial, self.dial_timeout)  # a firewalled port must not stall a chunk long
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ticket.host, ticket.port, limit=1 << 20), dial
            )
        except (OSError, TimeoutError) as exc:
            raise DialFailed(f"direct dial {ticket.host}:{ticket.port}: {exc!r}") from exc
        writer.write(_HEADER.pack(len(ticket.ticket)) + ticket.ticket)
        return reader, writer, False

    async def _call_direct(
        self,
        peer_id: str,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter, bool],
        name: str,
        request: bytes,
        **kw: Any,
    ) -> bytes:
        reader, writer, reused = conn
        loop = asyncio.get_running_loop()
        deadline = loop.time() + kw["timeout"]
        stall = kw["timeout"] if kw["stall_timeout"] is None else kw["stall_timeout"]
        rk: dict[str, Any] = {"stall_timeout": stall, "deadline": deadline}
        keep = False
        status, got_answer = _OK, False
        try:
            head = name.encode()
            writer.write(_HEADER.pack(len(head)) + head + _HEADER.pack(len(request)) + request)
            await asyncio.wait_for(writer.drain(), max(deadline - loop.time(), 0.001))
            (size,) = _HEADER.unpack(await _read_exactly(reader, _HEADER.size, **rk))
            got_answer = True
            status, body = await read_answer(
                reader, writer, size, f"{name} from {peer_id[:16]}... (direct)",
                max_response_bytes=kw["max_response_bytes"], windowed=True,
                on_progress=kw["on_progress"], settle=self.settle, **rk,
            )  # fmt: skip
            keep = True
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if not got_answer and reused:
                # the holder closed an idle connection as we took it: not the request's fault
                writer.close()
                try:
                    fresh = await self._connection(peer_id, kw["timeout"], kw["connect_timeout"])
                except (TransportError, ProtocolError):
                    pass  # no direct path any more: over libp2p, below
                else:
                    return await self._call_direct(peer_id, fresh, name, request, **kw)
            if not got_answer:  # the ticket or the dial failed: not a direct path
                self.fallbacks += 1
                self._tickets.pop(peer_id, None)
                self._no_direct[peer_id] = self.clock() + self.retry_s
                writer.close()
                return await self.inner.call(peer_id, name, request, **kw)
            if isinstance(exc, TimeoutError):
                raise RpcTimeout(f"{name} to {peer_id[:16]}... (direct): {exc!r}") from exc
            raise PeerUnreachable(f"{name} to {peer_id[:16]}... (direct): {exc!r}") from exc
        finally:
            if keep:
                self._keep(peer_id, reader, writer)
            else:
                writer.close()
        if status != _OK:
            raise decode_error(body)
        self.direct_calls += 1
        return body

    def _keep(
        self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        pool = self._pools.setdefault(peer_id, _Pool())
        pool.idle.append((reader, writer, self.clock()))
        while len(pool.idle) > self.max_idle_per_peer:
            pool.idle.pop(0)[1].close()

    # -- serving --------------------------------------------------------------------------------
    async def _on_ticket(self, peer_id: str, request: bytes) -> bytes:
        decode(request, DirectTicketRequest)
        if not self.serve_when():
            raise HandlerError("unavailable", "this peer serves no direct connections now")
        now = self.clock()
        self._expire(now)
        old = self._by_peer.pop(peer_id, None)
        if old is not None:
            self._issued.pop(old, None)
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._issued[ticket] = (peer_id, now + self.ticket_ttl)
        self._by_peer[peer_id] = ticket
        return encode(DirectTicket(port=self.port, ticket=ticket, ttl_s=int(self.ticket_ttl)))

    def _expire(self, now: float) -> None:
        for ticket, (peer, expires) in list(self._issued.items()):
            if expires <= now:
                del self._issued[ticket]
                self._by_peer.pop(peer, None)

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is None or len(self._conns) >= self.max_connections:
            writer.close()
            return
        self._conns.add(task)
        try:
            await self._serve_connection(reader, writer)
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            logger.debug("direct connection ended: %r", exc)
        except asyncio.CancelledError:
            # stop() ends the connections so; asyncio's stream protocol reads this task's
            # exception in a callback, and a cancelled one would be logged there as an error
            logger.debug("direct connection ended by stop()")
        finally:
            self._conns.discard(task)
            writer.close()

    async def _frame(self, reader: asyncio.StreamReader, limit: int, timeout: float) -> bytes:
        async with asyncio.timeout(timeout):
            (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            if size > limit:
                raise ValueError(f"a frame of {size} B where at most {limit} B belong")
            return await reader.readexactly(size)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            ticket = await self._frame(reader, TICKET_BYTES, self.hello_timeout)
        except (TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            self.refused += 1
            logger.debug("direct connection without a ticket (%r): closed", exc)
            return
        issued = self._issued.get(ticket)
        if issued is not None and issued[1] <= self.clock():  # expired (dropped on the next ask)
            issued = None
        if issued is None:
            self.refused += 1
            logger.debug("direct connection with an unknown or expired ticket: closed")
            return
        self.connections_accepted += 1
        caller = issued[0]
        loop = asyncio.get_running_loop()
        while True:
            try:
                raw = await self._frame(reader, MAX_NAME_BYTES, self.idle_s)
            except (TimeoutError, asyncio.IncompleteReadError):
                return  # idle, or the asker closed: both normal
            name = raw.decode("utf-8", "replace")
            if name not in self._bulk:
                self.refused += 1
                logger.debug("direct call of %r (not a bulk method) from %s: closed", name,
                             caller[:12])  # fmt: skip
                return
            handler, max_request, limit = self._bulk[name]
            # the request is read here, whole, before any answer: a "busy" answer must not leave
            # it unread on a connection that carries the next call (too large: closed)
            request = await self._frame(reader, max_request, self.inner.io_timeout)
            deadline = loop.time() + self.inner.io_timeout
            ok = await self.inner.answer(caller, name, handler, max_request, limit, reader,
                                         writer, deadline, windowed=True,
                                         request=request)  # fmt: skip
            if not ok:
                return
