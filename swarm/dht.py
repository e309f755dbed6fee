"""A swarm peer: one hivemind DHT (in its own process) plus a libp2p handle in this process.

``SwarmPeer`` owns the DHT process and the libp2p daemon it starts. All start-up failures of the
daemon are translated into :class:`swarm.errors.StartupError` subclasses by
:func:`translate_startup_error`, the single boundary for foreign start-up errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import (
    AddressInUse,
    BadMultiaddr,
    BootstrapUnreachable,
    DaemonMissing,
    DhtError,
    DhtTimeout,
    IdentityTaken,
    StartupError,
    SwarmError,
)

logger = logging.getLogger(__name__)

# Values hivemind can store: msgpack-serialisable scalars and containers.
DhtValue = bytes | str | int | float | bool | list[Any] | dict[str, Any] | None


@dataclass(frozen=True)
class PeerConfig:
    """How a swarm peer joins the libp2p network and the DHT."""

    initial_peers: Sequence[str] = ()
    """Multiaddrs (with /p2p/<peer id>) of running peers to bootstrap from; empty = first peer."""
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    """Multiaddrs to listen on; use /ip4/0.0.0.0/tcp/PORT to accept connections from other hosts."""
    announce_maddrs: Sequence[str] = ()
    """Public multiaddrs to announce (e.g. behind port forwarding); explicit ports only."""
    identity_path: str | None = None
    """libp2p private key file; keeps the peer ID stable across restarts (created if absent)."""
    client_mode: bool = False
    """Dial out only: do not serve DHT requests (volunteers behind NAT)."""
    use_relay: bool = True
    """Allow reaching peers behind NAT through libp2p circuit relays."""
    use_auto_relay: bool = False
    """Look for relays to become reachable when this peer is behind NAT."""
    startup_timeout: float = 15.0
    """Seconds to wait for the libp2p daemon and the DHT to come up."""
    dht_timeout: float = 10.0
    """Default timeout in seconds of one DHT get/store."""


@dataclass(frozen=True)
class DhtEntry:
    """One DHT value and its absolute expiration time (seconds since the epoch)."""

    value: Any
    expiration_time: float


def _one_line(text: str) -> str:
    return " ".join(text.split())


def translate_startup_error(exc: BaseException, config: PeerConfig) -> SwarmError:
    """Map a foreign start-up exception to a ``StartupError`` whose message says what to try."""
    if isinstance(exc, SwarmError):
        return exc
    msg = _one_line(str(exc))
    low = msg.lower()
    if "p2pd binary" in low or "format incompatible" in low:
        return DaemonMissing(
            f"libp2p daemon unavailable ({msg}); "
            "try: pip install --force-reinstall hivemind==1.1.12"
        )
    if "address already in use" in low:
        return AddressInUse(
            f"cannot listen on {list(config.host_maddrs)}: address already in use; "
            "pick a free port or use tcp/0"
        )
    if "multiaddr" in low or "unknown protocol" in low:
        return BadMultiaddr(
            f"bad multiaddr ({msg}); expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
        )
    if "bootstrap" in low or "initial_peers" in low:
        return BootstrapUnreachable(
            f"none of the initial peers {list(config.initial_peers)} answered; check that they "
            "run and that the address and /p2p/ peer id are right"
        )
    if "already taken" in low:
        return IdentityTaken(
            f"identity {config.identity_path} is used by another running peer; "
            "stop it or use a different identity_path"
        )
    if isinstance(exc, TimeoutError):
        return StartupError(
            f"swarm peer did not start within {config.startup_timeout:.0f} s; "
            "raise startup_timeout or check the network"
        )
    return StartupError(f"swarm peer failed to start: {type(exc).__name__}: {msg}")


def _check_maddrs(config: PeerConfig) -> None:
    from hivemind.utils.multiaddr import Multiaddr

    groups = {
        "initial_peers": config.initial_peers,
        "host_maddrs": config.host_maddrs,
        "announce_maddrs": config.announce_maddrs,
    }
    for name, addrs in groups.items():
        if isinstance(addrs, str):
            raise BadMultiaddr(f"{name} must be a list of multiaddrs, got the string {addrs!r}")
        for addr in addrs:
            try:
                Multiaddr(addr)
            except Exception as exc:  # multiaddr raises several unrelated types
                raise BadMultiaddr(
                    f"{name}: cannot parse {addr!r} ({_one_line(str(exc))}); "
                    "expected e.g. /ip4/127.0.0.1/tcp/31337"
                ) from exc
    if config.identity_path is not None and not Path(config.identity_path).parent.is_dir():
        raise StartupError(
            f"identity_path {config.identity_path}: directory does not exist; create it first"
        )


class SwarmPeer:
    """A DHT participant with a libp2p handle usable from the current event loop.

    ``record_validators`` (hivemind ``RecordValidatorBase`` instances) run inside the DHT process
    on every record stored on or fetched by this peer. ``clock`` returns DHT time (epoch seconds).
    """

    def __init__(
        self,
        config: PeerConfig | None = None,
        *,
        record_validators: Iterable[Any] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or PeerConfig()
        self.record_validators = list(record_validators)
        self.clock = clock
        self._dht: Any = None
        self._p2p: Any = None

    async def start(self) -> None:
        """Start the DHT process and the libp2p daemon; raises ``StartupError`` on failure."""
        import hivemind

        _check_maddrs(self.config)
        cfg = self.config
        dht = hivemind.DHT(
            initial_peers=list(cfg.initial_peers) or None,
            start=False,
            host_maddrs=list(cfg.host_maddrs),
            announce_maddrs=list(cfg.announce_maddrs) or None,
            identity_path=cfg.identity_path,
            client_mode=cfg.client_mode,
            use_relay=cfg.use_relay,
            use_auto_relay=cfg.use_auto_relay,
            startup_timeout=cfg.startup_timeout,
            record_validators=list(self.record_validators),
        )
        try:
            dht.start()
            await asyncio.to_thread(dht.wait_until_ready, cfg.startup_timeout + 5.0)
            self._dht = dht
            self._p2p = await dht.replicate_p2p()
        except Exception as exc:
            self._dht = None
            await asyncio.to_thread(dht.shutdown)
            raise translate_startup_error(exc, cfg) from exc
        logger.info("swarm peer %s started on %s", self.peer_id, await self.visible_maddrs())

    async def stop(self) -> None:
        """Stop the libp2p handle and the DHT process (idempotent)."""
        dht, p2p = self._dht, self._p2p
        self._dht = self._p2p = None
        if p2p is not None:
            await p2p.shutdown()
        if dht is not None:
            await asyncio.to_thread(dht.shutdown)
            logger.info("swarm peer stopped")

    @property
    def started(self) -> bool:
        return self._dht is not None

    @property
    def dht(self) -> Any:
        """The underlying ``hivemind.DHT`` (for advanced use)."""
        if self._dht is None:
            raise SwarmError("swarm peer is not started; call await peer.start() first")
        return self._dht

    @property
    def p2p(self) -> Any:
        """The ``hivemind.P2P`` replica living in this process (stream handlers go here)."""
        if self._p2p is None:
            raise SwarmError("swarm peer is not started; call await peer.start() first")
        return self._p2p

    @property
    def peer_id(self) -> str:
        """This peer's libp2p peer ID in base58 (``12D3KooW...``)."""
        return str(self.p2p.peer_id.to_base58())

    async def visible_maddrs(self) -> list[str]:
        """Multiaddrs (ending in /p2p/<peer id>) other peers can use as ``initial_peers``."""
        maddrs = await self.p2p.get_visible_maddrs(latest=True)
        return [str(m) for m in maddrs]

    async def store(
        self,
        key: str,
        value: DhtValue,
        *,
        expiration_time: float,
        subkey: str | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``.

        Returns hivemind's verdict, which is the answer of the *last* replica to reply: False when
        that one refused it (a validator, or it holds a value with a later expiration), even if
        others stored it; True does not mean every replica did.
        """
        fut = self.dht.store(key, value, expiration_time, subkey=subkey, return_future=True)
        return bool(await self._await(fut, f"store {key!r}", timeout))

    async def get_value(self, key: str, *, timeout: float | None = None) -> DhtEntry | None:
        """The latest plain value under ``key``, or None when absent or expired."""
        found = await self._await(
            self.dht.get(key, latest=True, return_future=True), f"get {key!r}", timeout
        )
        if found is None:
            return None
        return DhtEntry(found.value, float(found.expiration_time))

    async def get_subkeys(self, key: str, *, timeout: float | None = None) -> dict[str, DhtEntry]:
        """All live subkeys under ``key`` (subkeys decoded to ``str``); empty when absent."""
        entry = await self.get_value(key, timeout=timeout)
        if entry is None or not isinstance(entry.value, dict):
            return {}
        out: dict[str, DhtEntry] = {}
        for sub, item in entry.value.items():
            name = sub.decode("utf-8", "replace") if isinstance(sub, bytes) else str(sub)
            out[name] = DhtEntry(item.value, float(item.expiration_time))
        return out

    async def _await(self, fut: Any, what: str, timeout: float | None) -> Any:
        limit = self.config.dht_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(fut, limit)
        except TimeoutError as exc:
            fut.cancel()
            raise DhtTimeout(f"DHT {what} did not finish in {limit:.1f} s") from exc
        except Exception as exc:
            raise DhtError(f"DHT {what} failed: {_one_line(str(exc))}") from exc
