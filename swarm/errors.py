"""Errors raised by the swarm layer.

Every error a user can cause carries a one-line message that says what went wrong and what to try.
Foreign exceptions (hivemind, libp2p daemon, OS) are translated into these at exactly two
boundaries: :func:`swarm.dht.translate_startup_error` for peer start-up and
:meth:`swarm.transport.P2PTransport.call` for RPCs.

Hierarchy::

    SwarmError
    ├── StartupError                 the libp2p daemon / DHT could not start
    │   ├── DaemonMissing            p2pd binary not found or not executable
    │   ├── AddressInUse             a host multiaddr's port is taken
    │   ├── BadMultiaddr             a multiaddr could not be parsed / is not usable
    │   ├── BootstrapUnreachable     none of the initial peers answered
    │   └── IdentityTaken            another running peer uses the same identity file
    ├── DhtError                     a DHT get/store failed
    │   └── DhtTimeout               ... or did not finish in time
    ├── TransportError               an RPC to a peer failed
    │   ├── PeerUnreachable          could not open a stream / the stream broke
    │   │   └── DialFailed           no connection could be opened (not dialable, dial timeout)
    │   ├── RpcTimeout               connect, read or write did not finish in time
    │   └── RemoteError              the remote handler answered with an error (``.code``)
    └── BroadcastError               a checkpoint version could not be obtained
        ├── ManifestUnavailable      no peer returned a manifest that verifies
        ├── ChunkUnavailable         a chunk could not be fetched from any peer (seed included)
        └── NoDiskSpace              the version does not fit on the local disk
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of all swarm-layer errors; ``str(e)`` is one line."""


class StartupError(SwarmError):
    """The libp2p daemon or the DHT process could not start."""


class DaemonMissing(StartupError):
    """The p2pd binary shipped with hivemind is missing or not executable."""


class AddressInUse(StartupError):
    """A port in ``host_maddrs`` is already bound by another process."""


class BadMultiaddr(StartupError):
    """A multiaddr in the configuration could not be parsed or used."""


class BootstrapUnreachable(StartupError):
    """None of ``initial_peers`` could be reached."""


class IdentityTaken(StartupError):
    """Another peer in the swarm already runs with the same libp2p identity file."""


class DhtError(SwarmError):
    """A DHT operation failed."""


class DhtTimeout(DhtError):
    """A DHT operation did not finish within its timeout."""


class TransportError(SwarmError):
    """An RPC to a peer failed."""


class PeerUnreachable(TransportError):
    """A stream to the peer could not be opened, or it broke mid-call."""


class DialFailed(PeerUnreachable):
    """No connection to the peer could be opened in time: it is behind NAT, gone, or its
    addresses are wrong. Callers back off from such a peer rather than retry at once."""


class RpcTimeout(TransportError):
    """Connecting, writing the request or reading the response took too long."""


class RemoteError(TransportError):
    """The remote handler answered with an error.

    ``code`` is a short stable string (a ``protocol.errors.ReasonCode`` value, ``"busy"``,
    ``"unknown_method"`` or ``"internal"``); ``detail`` is the remote's one-line explanation.
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class BroadcastError(SwarmError):
    """A checkpoint version could not be obtained."""


class ManifestUnavailable(BroadcastError):
    """No peer returned a signed manifest that verifies against the pinned coordinator key."""


class ChunkUnavailable(BroadcastError):
    """A chunk could not be fetched from any peer, the seed included."""


class NoDiskSpace(BroadcastError):
    """The free space where chunks are stored is smaller than what the version still needs."""
