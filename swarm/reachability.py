"""Measured reachability: can other peers open a connection to this one?

A peer behind a home router can dial out (so it joins, registers, leases, submits and downloads
with no configuration), but nobody can dial it: it must not be announced as a chunk holder that
others have to dial. Guessing is not good enough (``announce_maddrs`` may be stale, a port
forward may be missing), so the answer is measured by a **dial-back**:

1. the peer sends the addresses it announces (its ``visible_maddrs``) to a dial-back server (the
   coordinator runs one) with ``DIALBACK_RPC``;
2. the server opens a *new* connection to the caller from a separate libp2p host of its own
   (:class:`DialbackServer` keeps a second p2pd with no other connections, so an existing
   connection cannot be reused), using only those addresses, within ``timeout`` seconds; the
   libp2p handshake proves it reached the caller's peer ID;
3. ``"public"`` if it connected, ``"private"`` if not. The caller publishes the result in its
   advert (``CapabilityAdvert.reachability``) and announces itself as a holder only if public.

The server only ever dials the caller itself (never a third party), at most ``MAX_ADDRS``
TCP addresses, once per caller per ``min_interval`` (later asks get the cached answer), with at
most ``max_concurrent`` probes at once: it cannot be used to scan or flood others.

What hivemind 1.1.12's p2pd offers instead, as measured in namespaces (docs/operations.md):
AutoNAT (service on every peer) and hole punching (DCUtR) are enabled, and circuit relay v2 with
the relay service on every peer with ``use_relay``; but a node learns no reachability from the
daemon, AutoNAT only concludes once an observed address is confirmed by several peers (never
behind a NAT that changes ports per connection), and auto-relay only reserves a relay slot after
AutoNAT says "private" and a 3-minute boot delay. So relays and hole punching are not relied on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from msgspec import Meta

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.schema import MessageBase, Reachability, Text
from swarm.errors import SwarmError
from swarm.transport import Transport

logger = logging.getLogger(__name__)

DIALBACK_RPC = "/rollout-swarm/dialback/1"
MAX_ADDRS = 8  # addresses a caller may ask to be dialled at
MAX_ADDR_LEN = 256

Maddr = Annotated[str, Meta(min_length=1, max_length=MAX_ADDR_LEN)]


class DialbackRequest(MessageBase):
    """Ask to be dialled back at ``maddrs`` (multiaddrs without ``/p2p/``; TCP ones are tried)."""

    maddrs: Annotated[list[Maddr], Meta(max_length=MAX_ADDRS)]


class DialbackReply(MessageBase):
    """The outcome of a dial-back."""

    reachability: Literal["public", "private"]  # public: a new connection could be opened
    detail: Text  # the address that answered, or why none did


def dialable_addrs(maddrs: list[str]) -> list[str]:
    """The TCP multiaddrs of ``maddrs`` a dial-back tries: ``/ip4|ip6|dns*/.../tcp/PORT``, no
    relay (``p2p-circuit``) addresses, the ``/p2p/<id>`` suffix removed; at most MAX_ADDRS."""
    out: list[str] = []
    for m in maddrs:
        parts = m.split("/p2p/", 1)[0].strip("/").split("/")
        if len(parts) != 4 or "p2p-circuit" in m:
            continue
        proto, _host, tcp, port = parts
        if proto not in ("ip4", "ip6", "dns", "dns4", "dns6") or tcp != "tcp" or port == "0":
            continue
        addr = "/" + "/".join(parts)
        if addr not in out:
            out.append(addr)
    return out[:MAX_ADDRS]


class DialbackServer:
    """Answers ``DIALBACK_RPC`` by dialling the caller from a separate libp2p host.

    ``host`` is the IP the prober listens on (the port is picked by the OS); give the address
    the coordinator itself uses, so the dial leaves through the same interface.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        host: str = "0.0.0.0",
        timeout: float = 6.0,
        min_interval: float = 10.0,
        max_concurrent: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.host = host
        self.timeout = timeout
        self.min_interval = min_interval
        self.clock = clock
        self._slots = asyncio.Semaphore(max_concurrent)
        self._prober: Any = None
        self._lock = asyncio.Lock()
        #: the last answer per caller peer ID: (reachability, detail, monotonic time)
        self.results: dict[str, tuple[str, str, float]] = {}

    async def start(self) -> None:
        from hivemind.p2p import P2P

        self._prober = await P2P.create(
            host_maddrs=[f"/ip4/{self.host}/tcp/0"],
            use_relay=False,  # a relayed connection would not prove the caller is dialable
            auto_nat=False,
            nat_port_map=False,
            dht_mode="client",
        )
        await self.transport.register(DIALBACK_RPC, self._on_dialback)

    async def stop(self) -> None:
        await self.transport.unregister(DIALBACK_RPC)
        prober, self._prober = self._prober, None
        if prober is not None:
            await prober.shutdown()

    def reachability_of(self, peer_id: str) -> str | None:
        """The last measured reachability of ``peer_id`` (None: never asked)."""
        entry = self.results.get(peer_id)
        return None if entry is None else entry[0]

    async def _on_dialback(self, caller: str, request: bytes) -> bytes:
        req = decode(request, DialbackRequest)
        now = self.clock()
        last = self.results.get(caller)
        if last is not None and now - last[2] < self.min_interval:
            cached: Literal["public", "private"] = "public" if last[0] == "public" else "private"
            return encode(DialbackReply(reachability=cached, detail=last[1]))
        async with self._slots:
            reach, detail = await self.probe(caller, dialable_addrs(list(req.maddrs)))
        self.results[caller] = (reach, detail, self.clock())
        logger.info("dial-back to %s: %s (%s)", caller[:16], reach, detail)
        return encode(DialbackReply(reachability=reach, detail=detail))

    async def probe(
        self, peer_id: str, maddrs: list[str]
    ) -> tuple[Literal["public", "private"], str]:
        """Open a new connection to ``peer_id`` at ``maddrs``; close it again."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        if not maddrs:
            return "private", "no TCP address announced"
        if self._prober is None:
            raise SwarmError("dial-back server is not started")
        pid = PeerID.from_base58(peer_id)
        client = self._prober._client  # hivemind's P2P has no public connect/disconnect
        try:
            async with asyncio.timeout(self.timeout):
                await client.connect(pid, [Multiaddr(m) for m in maddrs])
        except TimeoutError:
            return "private", f"no answer within {self.timeout:.0f} s at {', '.join(maddrs)}"
        except Exception as exc:  # the daemon's dial errors come as several types
            text = " ".join(str(exc).split())[:200]
            return "private", f"dial failed at {', '.join(maddrs)}: {text}"
        try:
            peers = await client.list_peers()
            used = [str(a) for p in peers if p.peer_id == pid for a in p.addrs]
            await client.disconnect(pid)
        except Exception as exc:  # closing is best effort; the answer stands
            logger.debug("dial-back clean-up for %s: %s", peer_id[:16], exc)
            used = []
        return "public", f"connected to {used[0] if used else ', '.join(maddrs)}"


async def measure_reachability(
    transport: Transport, maddrs: list[str], server: str, *, timeout: float = 15.0
) -> tuple[Reachability, str]:
    """Ask ``server`` to dial this peer back at ``maddrs`` (its ``visible_maddrs``).

    Returns ``("public" | "private", detail)``, or ``("unknown", why)`` when the server could not
    be asked (unreachable, an older version without the dial-back, a malformed answer)."""
    request = DialbackRequest(maddrs=dialable_addrs(maddrs))
    try:
        raw = await transport.call(server, DIALBACK_RPC, encode(request), timeout=timeout)
        reply = decode(raw, DialbackReply)
    except (SwarmError, ProtocolError) as exc:
        return "unknown", f"dial-back by {server[:16]} unavailable: {exc}"
    return reply.reachability, reply.detail


class ReachabilityMonitor:
    """Keeps a peer's measured reachability current: at start, then every ``interval`` seconds
    (every ``retry`` seconds while the server cannot be asked). ``on_change`` is called with the
    new value whenever it changes (the node re-announces its advert and gates its holder records).
    """

    def __init__(
        self,
        transport: Transport,
        maddrs: Callable[[], Awaitable[list[str]]],
        server: Callable[[], str],
        *,
        on_change: Callable[[Reachability], None],
        interval: float = 600.0,
        retry: float = 30.0,
    ) -> None:
        self.transport = transport
        self.maddrs = maddrs
        self.server = server
        self.on_change = on_change
        self.interval = interval
        self.retry = retry
        self.state: Reachability = "unknown"
        self.detail = "not measured yet"
        self.measured = asyncio.Event()  # set after the first answer (public or private)

    async def measure_once(self) -> Reachability:
        state, detail = await measure_reachability(
            self.transport, await self.maddrs(), self.server()
        )
        if state == "unknown" and self.state != "unknown":
            logger.info("reachability not re-measured (%s); keeping %s", detail, self.state)
            return self.state
        self.detail = detail
        if state != self.state:
            logger.info("reachability: %s (%s)", state, detail)
            self.state = state
            self.on_change(state)
        if state != "unknown":
            self.measured.set()
        return state

    async def run(self) -> None:
        while True:
            state = await self.measure_once()
            await asyncio.sleep(self.retry if state == "unknown" else self.interval)
