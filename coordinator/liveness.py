"""Soft liveness: when each node was last heard from, and how often it is asked to say so.

A heartbeat or lease request raises a node's ``last_seen``. A durable commit per message would
cost an fsync each (~4 ms on ext4 with ``synchronous=FULL``; 10,000 nodes send ~2,000 such
messages per second), so :class:`Liveness` keeps the new times in memory and :meth:`flush` writes
them for all nodes in one transaction (every upkeep tick, and before any query that reads
``last_seen``). A crash loses at most one tick of ``last_seen``, far inside the liveness horizon.

How often nodes beat (:class:`HeartbeatSchedule`). A heartbeat carries almost no work, yet each
costs the coordinator a libp2p stream, a signature check and a decode (~0.4 ms of Python and
~0.3 ms of ``p2pd`` here, bench/service_rate.py): at 10,000 nodes beating every 10 s they were
89 % of its requests. So the coordinator asks for at most ``heartbeat_rate_max`` heartbeats per
second from the whole swarm: with ``n`` nodes alive the interval it hands out (in every
``RegisterAck``, ``HeartbeatAck`` and standby answer) is ``max(heartbeat_interval_s, n /
heartbeat_rate_max)``, rounded up to a quarter octave of ``heartbeat_interval_s`` so that it
does not change with every node that joins (at most 86,400 s, what the wire allows). BOINC's
scheduler does the same with its ``request_delay``. The price is slower failure detection
(``misses`` intervals), a later prefetch of a new version by nodes that learn of it from their
heartbeat, and a later start of a standby node the planner activates (it asks for work again
after the interval).

The liveness horizon follows what was handed out: a node told an interval ``I`` may stay silent
for ``misses × I`` after the last answer that told it so, so the horizon is ``misses`` times the
largest interval any node may still be following (a shrinking swarm does not declare the nodes
that were told a long interval dead before they were due). What was handed out is soft state: a
restarted coordinator assumes the interval its registered nodes could have been told
(:meth:`HeartbeatSchedule.resume`).
"""

from __future__ import annotations

import math

from coordinator.config import CoordinatorConfig
from coordinator.store import Store

#: Interval steps per octave (a quarter octave: 19 % apart)
STEPS_PER_OCTAVE = 4
#: The longest interval the wire allows (``HeartbeatAck.heartbeat_interval_s``), seconds
MAX_INTERVAL_S = 86400.0


class HeartbeatSchedule:
    """The heartbeat interval the coordinator asks for and the liveness horizon it implies
    (module docstring). ``rate_max`` None: the interval stays ``interval_s``."""

    def __init__(self, interval_s: float, misses: int, rate_max: float | None = None) -> None:
        if interval_s <= 0 or misses < 1 or (rate_max is not None and rate_max <= 0):
            raise ValueError("HeartbeatSchedule needs interval_s > 0, misses >= 1, rate_max > 0")
        self.base_s, self.misses, self.rate_max = interval_s, misses, rate_max
        self._interval = interval_s
        #: intervals no longer handed out: (when the last answer naming it left, interval)
        self._past: list[tuple[float, float]] = []
        #: after a restart, the interval handed out stays at least this until then (resume)
        self._floor: tuple[float, float] = (-math.inf, interval_s)

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> HeartbeatSchedule:
        rate = config.heartbeat_rate_max
        return cls(config.heartbeat_interval_s, config.heartbeat_misses, rate if rate > 0 else None)

    @property
    def interval_s(self) -> float:
        """The interval handed out now (seconds)."""
        return self._interval

    def target_s(self, alive: int) -> float:
        """The interval for ``alive`` nodes: ``max(base, alive / rate_max)`` rounded up to a
        quarter octave of the base."""
        if self.rate_max is None or alive <= self.rate_max * self.base_s:
            return self.base_s
        octaves = math.log2(alive / self.rate_max / self.base_s)
        steps = math.ceil(octaves * STEPS_PER_OCTAVE - 1e-9)
        return float(min(MAX_INTERVAL_S, self.base_s * 2.0 ** (steps / STEPS_PER_OCTAVE)))

    def observe(self, alive: int, now: float) -> float:
        """``alive`` nodes are alive at ``now``: set the interval handed out from here on;
        returns it."""
        interval = self.target_s(alive)
        until, floor = self._floor
        if now < until:  # nodes not yet heard from since a restart are not counted yet
            interval = max(interval, floor)
        if interval != self._interval:
            self._past.append((now, self._interval))
            self._interval = interval
        self._past = [(t, i) for t, i in self._past if t + self.misses * i >= now]
        return interval

    def resume(self, registered: int, now: float) -> None:
        """After a restart: nodes may still follow an interval handed out before it, at most
        the one ``registered`` nodes alive would have been told, so that interval binds the
        horizon for ``misses`` times itself, and the interval handed out stays at least that
        long meanwhile (a count taken before every node has beaten again is short, and a short
        interval named to a reconnecting swarm would surge past the cap)."""
        longest = self.target_s(registered)
        if longest > self._interval:
            self._past.append((now, longest))
            self._floor = (now + self.misses * longest, longest)
            self._interval = longest

    def horizon_s(self, now: float) -> float:
        """How long a node may stay silent before it counts as gone: ``misses`` times the
        largest interval a node may still follow."""
        longest = max((i for t, i in self._past if t + self.misses * i >= now), default=0.0)
        return self.misses * max(self._interval, longest)

    def horizon(self, now: float) -> float:
        """Nodes last heard from before this time are not alive."""
        return now - self.horizon_s(now)


class Liveness:
    """``last_seen`` not yet written to ``store`` (soft state; see the module docstring), and
    the :class:`HeartbeatSchedule` that says how old it may be."""

    def __init__(self, store: Store, schedule: HeartbeatSchedule) -> None:
        self.store = store
        self.schedule = schedule
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

    @property
    def interval_s(self) -> float:
        """The heartbeat interval handed out now."""
        return self.schedule.interval_s

    def horizon(self, now: float) -> float:
        """Nodes last heard from before this time are not alive."""
        return self.schedule.horizon(now)

    def alive(self, now: float) -> int:
        """Nodes alive at ``now`` (registered, heard from within the horizon, not banned)."""
        self.flush()
        return self.store.live_node_count(self.horizon(now), now)

    def recount(self, now: float) -> int:
        """Count the nodes alive and set the interval handed out from it (every upkeep tick:
        one count, a scan of the nodes table: ~2 ms at 10,000 nodes here)."""
        alive = self.alive(now)
        self.schedule.observe(alive, now)
        return alive
