"""Soft liveness: when each node was last heard from, written to the store in batches.

A heartbeat or lease request raises a node's ``last_seen``. A durable commit per message would
cost an fsync each (~4 ms on ext4 with ``synchronous=FULL``; 10,000 nodes send ~2,000 such
messages per second), so :class:`Liveness` keeps the new times in memory and :meth:`flush` writes
them for all nodes in one transaction (every upkeep tick, and before any query that reads
``last_seen``). A crash loses at most one tick of ``last_seen``, far inside the liveness horizon.
"""

from __future__ import annotations

import math

from coordinator.store import Store


class Liveness:
    """``last_seen`` not yet written to ``store`` (soft state; see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: node_key -> last_seen not yet written to the store
        self._seen: dict[bytes, float] = {}

    def saw(self, node_key: bytes, at: float) -> None:
        """``node_key`` was heard from at ``at`` (Unix seconds)."""
        self._seen[node_key] = at

    def unwritten(self, node_key: bytes) -> float:
        """The node's ``last_seen`` held here and not yet written (-inf when there is none)."""
        return self._seen.get(node_key, -math.inf)

    def forget(self, node_key: bytes) -> None:
        """Drop a node's unwritten time (its row is being deleted)."""
        self._seen.pop(node_key, None)

    def flush(self) -> None:
        """Write the ``last_seen`` of every node heard from since the last flush (one commit)."""
        if self._seen:
            seen, self._seen = self._seen, {}
            self.store.touch_nodes(seen.items())
