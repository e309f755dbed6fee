"""Admission (check 2's last part): a known node with no ban in force.

:func:`admission_refusal` is the pure rule over what was loaded (the node's row, its ban in
force); :class:`Admission` loads both and applies it for the coordinator's handlers. The
submission pipeline applies the same rule to its own one-read snapshot
(:mod:`coordinator.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.errors import Rejection
from coordinator.reputation import Ban, Reputation
from coordinator.store import NodeRecord, Store
from protocol.errors import ReasonCode
from protocol.identity import fingerprint_of


def admission_refusal(
    node_key: bytes, node: NodeRecord | None, ban: Ban | None, now: float
) -> Rejection | None:
    """Why ``node_key`` is refused (unregistered, or banned at ``now``); None: admitted."""
    if node is None:
        return Rejection(ReasonCode.UNKNOWN_NODE, f"{fingerprint_of(node_key)} must register first")
    if ban is not None:
        left = max(0.0, ban.until - now)
        return Rejection(
            ReasonCode.BANNED,
            f"banned for {left:.0f}s more (ban #{ban.count}: {ban.reason})",
            retry_after_s=left,
        )
    return None


class Admission:
    """Known, unbanned nodes only (reads the node row and the ban, both at the injected time)."""

    def __init__(self, store: Store, reputation: Reputation, clock: Callable[[], float]) -> None:
        self.store = store
        self.reputation = reputation
        self.clock = clock

    def admit(self, node_key: bytes) -> NodeRecord:
        """The node's record; a :class:`Rejection` if it is unknown or banned."""
        node = self.store.get_node(node_key)
        ban = None if node is None else self.reputation.banned(node_key, self.clock())
        refusal = admission_refusal(node_key, node, ban, self.clock())
        if refusal is not None:
            raise refusal
        assert node is not None
        return node
