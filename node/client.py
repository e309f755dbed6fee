"""Typed async client for the coordinator RPCs a node calls (see :mod:`protocol.rpc`).

Each call seals the request with the node identity, sends it over a
:class:`swarm.transport.Transport` with the method's timeout, decodes the response and checks
its type. Foreign failures are translated here, once::

    CoordinatorError                    base; str(e) is one line
    ├── CoordinatorUnavailable          network trouble: unreachable, timeout, busy, internal
    │                                   error on the coordinator -- retry with back-off
    ├── BadResponse                     undecodable bytes or an unexpected message type
    └── Rejected                        the coordinator refused: .code (ReasonCode), .detail,
                                        .retry_after_s (None = retrying the same will not help)

``submit`` returns the verdict (``Ack`` or ``Reject``) instead of raising on ``Reject``: a
rejected submission is a normal outcome the worker counts, not a failure of the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec

from protocol import rpc
from protocol.codec import decode, encode
from protocol.envelope import seal
from protocol.errors import ProtocolError, ReasonCode
from protocol.identity import Identity
from protocol.messages import (
    Ack,
    CapabilityAdvert,
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    Register,
    RegisterAck,
    Reject,
    ReleaseLease,
    RolloutSubmission,
    Standby,
)
from swarm.errors import RemoteError, TransportError
from swarm.transport import Transport

__all__ = [
    "BadResponse",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "Rejected",
]

T = TypeVar("T")
_REASONS = frozenset(c.value for c in ReasonCode)


class CoordinatorError(Exception):
    """A coordinator RPC failed (see the module docstring for the tree)."""


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached or answered in time; retrying later may help."""


class BadResponse(CoordinatorError):
    """The coordinator answered something this node cannot use."""


class Rejected(CoordinatorError):
    """The coordinator refused the request with a stable reason code."""

    def __init__(self, code: ReasonCode, detail: str, retry_after_s: float | None = None) -> None:
        self.code = code
        self.detail = " ".join(detail.split())
        self.retry_after_s = retry_after_s
        super().__init__(f"{code.value}: {self.detail}")


class CoordinatorClient:
    """Calls ``rswarm/*`` methods on ``coordinator_peer_id`` as ``identity``."""

    def __init__(
        self,
        transport: Transport,
        coordinator_peer_id: str,
        identity: Identity,
        *,
        clock: Callable[[], float] = time.time,
        timeouts: Mapping[str, float] | None = None,
    ) -> None:
        self.transport = transport
        self.coordinator_peer_id = coordinator_peer_id
        self.identity = identity
        self.clock = clock
        self.timeouts = {**rpc.DEFAULT_TIMEOUTS, **(timeouts or {})}

    async def _call(
        self, method: str, msg: msgspec.Struct, expected: tuple[type, ...], timeout: float | None
    ) -> object:
        request = encode(seal(self.identity, msg, now=self.clock()))
        limit = self.timeouts[method] if timeout is None else timeout
        try:
            raw = await self.transport.call(
                self.coordinator_peer_id, method, request, timeout=limit
            )
        except RemoteError as exc:
            if exc.code in _REASONS and exc.code not in ("internal", "timeout", "closed"):
                raise Rejected(ReasonCode(exc.code), exc.detail) from exc
            raise CoordinatorUnavailable(f"{method}: coordinator answered {exc}") from exc
        except TransportError as exc:
            raise CoordinatorUnavailable(f"{method}: {exc}") from exc
        try:
            response = decode(raw)
        except ProtocolError as exc:
            raise BadResponse(f"{method}: undecodable response ({exc})") from exc
        if isinstance(response, Reject):
            raise Rejected(response.code, response.detail, response.retry_after_s)
        if not isinstance(response, expected):
            names = " or ".join(t.__name__ for t in expected)
            raise BadResponse(f"{method}: expected {names}, got {type(response).__name__}")
        return response

    async def register(
        self, advert: CapabilityAdvert, *, timeout: float | None = None
    ) -> RegisterAck:
        """Join the swarm; ``advert.node_key`` must be this node's public key."""
        out = await self._call(rpc.REGISTER, Register(advert=advert), (RegisterAck,), timeout)
        assert isinstance(out, RegisterAck)
        return out

    async def heartbeat(self, hb: Heartbeat, *, timeout: float | None = None) -> HeartbeatAck:
        out = await self._call(rpc.HEARTBEAT, hb, (HeartbeatAck,), timeout)
        assert isinstance(out, HeartbeatAck)
        return out

    async def lease(self, req: LeaseRequest, *, timeout: float | None = None) -> Lease | Standby:
        """Ask for work: a :class:`Lease`, or :class:`Standby` with a retry delay."""
        out = await self._call(rpc.LEASE, req, (Lease, Standby), timeout)
        assert isinstance(out, (Lease, Standby))
        return out

    async def submit(self, sub: RolloutSubmission, *, timeout: float | None = None) -> Ack | Reject:
        """Send a lease's results; the verdict comes back as ``Ack`` or ``Reject``."""
        try:
            out = await self._call(rpc.SUBMIT, sub, (Ack,), timeout)
        except Rejected as exc:
            return Reject(
                ref=sub.lease_id, code=exc.code, detail=exc.detail, retry_after_s=exc.retry_after_s
            )
        assert isinstance(out, Ack)
        return out

    async def release(
        self, lease_id: str, epoch: int, reason: str, *, timeout: float | None = None
    ) -> Ack:
        """Give a lease back unfinished, so its prompts are reassigned at once."""
        msg = ReleaseLease(lease_id=lease_id, epoch=epoch, reason=reason[:200])
        out = await self._call(rpc.RELEASE, msg, (Ack,), timeout)
        assert isinstance(out, Ack)
        return out
