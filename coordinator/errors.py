"""Coordinator failures.

Two families: a node's request refused with a wire :class:`~protocol.errors.ReasonCode` (sent
back as ``Reject``), and local failures of the coordinator itself (configuration, database).

Hierarchy::

    protocol.errors.ProtocolError      .code: ReasonCode, .detail: str
    └── Rejection                      a node's request refused; .strike: counts against the node
        └── IntakeRejection            a submission failed a verification check (DESIGN.md §7)
    CoordinatorError                   a local problem, never a node's fault
    ├── ConfigError (also ValueError)  invalid configuration; names the field and the fix
    └── StoreError                     SQLite failed (translated once, in coordinator.store)
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ProtocolError, ReasonCode

#: Codes that never count against a node: an honest but slow, restarted or unlucky node hits them.
NO_STRIKE: frozenset[ReasonCode] = frozenset(
    {
        ReasonCode.UNKNOWN_NODE,
        ReasonCode.BANNED,
        ReasonCode.STALE_EPOCH,
        ReasonCode.LEASE_EXPIRED,
        ReasonCode.UNKNOWN_LEASE,
        ReasonCode.TOO_STALE,
        ReasonCode.UNKNOWN_VERSION,
        ReasonCode.DUPLICATE,
        ReasonCode.TIMEOUT,
        ReasonCode.CLOSED,
        ReasonCode.INTERNAL,
        ReasonCode.SWARM_FULL,
        ReasonCode.BAD_SIGNATURE,  # cannot be attributed: the signer is not proven
        ReasonCode.REPLAYED,
        ReasonCode.CLOCK_SKEW,
    }
)


class Rejection(ProtocolError):
    """A node's request refused with a reason code; ``strike`` says whether it counts against it."""

    def __init__(
        self,
        code: ReasonCode | str,
        detail: str = "",
        *,
        strike: bool | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(code, detail)
        self.strike: bool = (self.code not in NO_STRIKE) if strike is None else strike
        #: when asking again may succeed (e.g. the end of a ban), seconds; None = no hint
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.code.value, self.detail, self.strike))


class IntakeRejection(Rejection):
    """A rollout submission failed one of the verification checks of DESIGN.md §7."""


def _rebuild(cls: type[Rejection], code: str, detail: str, strike: bool) -> Rejection:
    return cls(code, detail, strike=strike)


class CoordinatorError(Exception):
    """A local failure of the coordinator (not caused by a node)."""


class ConfigError(CoordinatorError, ValueError):
    """The configuration is invalid; the message names the field and what to do."""


class StoreError(CoordinatorError):
    """The SQLite state database failed; the message says which operation and the database path."""
