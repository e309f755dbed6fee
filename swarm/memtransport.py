"""An in-memory :class:`swarm.transport.Transport` for unit tests (no sockets, no daemon).

    net = InMemoryNetwork()
    a, b = net.endpoint("peer-a"), net.endpoint("peer-b")
    await b.register("echo", handler)
    await a.call("peer-b", "echo", b"hi")

Errors follow the libp2p transport: unknown peer -> ``PeerUnreachable``, unknown method ->
``RemoteError("unknown_method")``, handler failure -> ``RemoteError(code)``, slow handler ->
``RpcTimeout``. ``net.disconnect(peer_id)`` makes a peer vanish; ``net.set_private(peer_id)``
puts it behind a NAT: calls to it succeed only over a "connection" it opened itself (it called
the caller before), others wait ``dial_delay`` (at most the call's connect timeout) and raise
``DialFailed``, as a dial to a NATed libp2p peer does.
"""

from __future__ import annotations

import asyncio

from swarm.errors import DialFailed, PeerUnreachable, RemoteError, RpcTimeout
from swarm.transport import (
    BUSY,
    DEFAULT_MAX_REQUEST,
    DEFAULT_MAX_RESPONSE,
    Handler,
    ProgressFn,
    error_body,
    request_too_large,
    unknown_method,
)


class InMemoryNetwork:
    """A registry of in-memory endpoints addressed by peer id."""

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency  # seconds added to every call (emulates transfer time)
        self._endpoints: dict[str, InMemoryTransport] = {}
        self._private: dict[str, float] = {}  # NATed peer -> seconds a failing dial takes
        self._links: set[frozenset[str]] = set()  # pairs with an open "connection"

    def set_private(self, peer_id: str, dial_delay: float = 5.0) -> None:
        """``peer_id`` cannot be dialled: only peers it has called can reach it."""
        self._private[peer_id] = dial_delay

    def dialable(self, caller: str, peer_id: str) -> float | None:
        """None if ``caller`` can reach ``peer_id``, else how long the failing dial takes."""
        if peer_id not in self._private or frozenset((caller, peer_id)) in self._links:
            return None
        return self._private[peer_id]

    def link(self, a: str, b: str) -> None:
        self._links.add(frozenset((a, b)))

    def endpoint(self, peer_id: str) -> InMemoryTransport:
        ep = InMemoryTransport(self, peer_id)
        self._endpoints[peer_id] = ep
        return ep

    def disconnect(self, peer_id: str) -> None:
        self._endpoints.pop(peer_id, None)

    def lookup(self, peer_id: str) -> InMemoryTransport | None:
        return self._endpoints.get(peer_id)


class InMemoryTransport:
    """One peer's endpoint on an :class:`InMemoryNetwork`."""

    def __init__(self, network: InMemoryNetwork, peer_id: str) -> None:
        self._network = network
        self._peer_id = peer_id
        self._handlers: dict[str, tuple[Handler, int, int | None]] = {}
        self._active: dict[tuple[str, str], int] = {}
        self.calls = 0

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def register(
        self,
        name: str,
        handler: Handler,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        max_streams_per_peer: int | None = None,
        windowed: bool = False,
    ) -> None:
        # windowed (bulk pacing by acknowledgements) changes nothing in memory: no queues
        self._handlers[name] = (handler, max_request_bytes, max_streams_per_peer)

    async def unregister(self, name: str) -> None:
        self._handlers.pop(name, None)

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
        remote = self._network.lookup(peer_id)
        if remote is None:
            raise PeerUnreachable(f"{name} on {peer_id}: no such peer")
        dial_delay = self._network.dialable(self._peer_id, peer_id)
        if dial_delay is not None:
            bound = min(timeout, stall_timeout or timeout, connect_timeout or timeout)
            await asyncio.sleep(min(dial_delay, bound))
            raise DialFailed(f"{name} on {peer_id}: could not connect; the peer is behind NAT")
        self._network.link(self._peer_id, peer_id)
        entry = remote._handlers.get(name)
        if entry is None:
            raise unknown_method(name)
        handler, max_request, limit = entry
        if len(request) > max_request:
            raise RemoteError(*request_too_large(len(request), max_request))
        slot = (name, self._peer_id)
        if limit is not None and remote._active.get(slot, 0) >= limit:
            raise RemoteError(*BUSY)
        remote.calls += 1
        remote._active[slot] = remote._active.get(slot, 0) + 1
        try:
            if self._network.latency:
                await asyncio.sleep(self._network.latency)
            response = await asyncio.wait_for(handler(self._peer_id, bytes(request)), timeout)
        except TimeoutError as exc:
            raise RpcTimeout(f"{name} on {peer_id} timed out") from exc
        except Exception as exc:
            code, detail = error_body(exc)
            raise RemoteError(code, detail) from exc
        finally:
            remote._active[slot] -= 1
        if self._network.lookup(peer_id) is None:
            raise PeerUnreachable(f"{name} on {peer_id}: stream closed early; the peer went away")
        if len(response) > max_response_bytes:
            raise PeerUnreachable(f"{name}: response of {len(response)} B too large")
        if on_progress is not None:
            on_progress(len(response), len(response))
        return response
