"""Wide-area links and checkpoint dissemination (the distributions docs/simulation.md states).

* Links: RTT and bandwidth of each node are lognormal draws around the medians of its class
  (``network.consumer`` / ``network.datacenter``); uplink and downlink are drawn independently.
* Dissemination of version v, published at ``p_v``: a node learns of it at its next heartbeat
  after ``p_v`` (or when a lease names it), then downloads ``bytes_v`` — the full checkpoint if it
  holds no version yet, else ``version_fraction`` of it — at ``rate_i = min(down_i, sources ·
  median uplink of the pool)``, stretched by the measured peer-assisted broadcast ratio for the
  swarm's size: ``T_i = max(bytes_v / B_coord, ratio(N) · bytes_v / rate_i)``. A node's downloads
  are sequential (a version it has not finished delays the next one).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from coordinator.sim.scenario import LinkSection

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class Link:
    rtt_s: float
    down_bps: float  # bytes per second
    up_bps: float


def draw_link(rng: random.Random, spec: LinkSection) -> Link:
    return Link(
        rtt_s=spec.rtt_ms_median / 1e3 * math.exp(rng.gauss(0.0, spec.rtt_sigma)),
        down_bps=spec.down_mbit_median * MBIT * math.exp(rng.gauss(0.0, spec.bw_sigma)),
        up_bps=spec.up_mbit_median * MBIT * math.exp(rng.gauss(0.0, spec.bw_sigma)),
    )


class Dissemination:
    """Publication times of versions and each node's ready time for a version."""

    def __init__(
        self,
        *,
        full_bytes: float,
        version_fraction: float,
        coordinator_bps: float,
        heartbeat_s: float,
    ) -> None:
        self.full_bytes = full_bytes
        self.version_fraction = version_fraction
        self.coordinator_bps = coordinator_bps
        self.heartbeat_s = heartbeat_s
        #: version -> time the learner's seed started serving it (sim seconds)
        self.published: dict[int, float] = {}
        self.order: list[int] = []
        #: relay rate cap (bytes/s) and broadcast ratio, set from the pool by the world
        self.relay_bps = math.inf
        self.ratio = 1.0

    def publish(self, version: int, at: float) -> None:
        self.published[version] = at
        self.order.append(version)

    def bytes_of(self, first: bool) -> float:
        return self.full_bytes if first else self.full_bytes * self.version_fraction

    def fetch_s(self, nbytes: float, down_bps: float) -> float:
        rate = min(down_bps, self.relay_bps)
        return max(nbytes / self.coordinator_bps, self.ratio * nbytes / rate)

    def learn_at(self, version: int, hb_phase: float) -> float:
        """The first heartbeat of a node (beating at ``hb_phase + k·H``) after publication."""
        p = self.published[version]
        return p + (hb_phase - p) % self.heartbeat_s


class NodeDownloads:
    """One node's sequential download queue (lazy: evaluated when a lease needs a version)."""

    __slots__ = ("_diss", "_down", "_first", "_free_at", "_idx", "_joined", "_phase", "_ready")

    def __init__(
        self,
        diss: Dissemination,
        hb_phase: float,
        down_bps: float,
        joined: float,
        holds_base: bool = False,
    ) -> None:
        self._diss = diss
        self._phase = hb_phase
        self._down = down_bps
        self._joined = joined
        self._idx = 0  # next entry of diss.order to schedule
        self._free_at = joined
        self._ready: dict[int, float] = {0: joined} if holds_base else {}
        self._first = not holds_base

    def _learn(self, version: int, wanted: int, asked_at: float) -> float:
        learn = max(self._joined, self._diss.learn_at(version, self._phase))
        return min(learn, asked_at) if version == wanted else learn

    def ready_at(self, version: int, asked_at: float) -> float:
        """When ``version`` is on the node's disk (a lease asks for it at ``asked_at``).

        Versions are fetched in publication order; one is skipped when a newer one is already
        known before its download would start (the node fetches the newest instead)."""
        if version in self._ready:
            return self._ready[version]
        diss, order = self._diss, self._diss.order
        while self._idx < len(order):
            v = order[self._idx]
            if v in self._ready:  # held from the start (the base model)
                self._idx += 1
                continue
            learn = self._learn(v, version, asked_at)
            if v != version and learn > asked_at:
                break  # not known yet
            self._idx += 1
            start = max(self._free_at, learn)
            superseded = (
                v != version
                and self._idx < len(order)
                and self._learn(order[self._idx], version, asked_at) <= start
            )
            if superseded:
                continue  # a newer version is known before this download would start
            self._free_at = start + diss.fetch_s(diss.bytes_of(self._first), self._down)
            self._first = False
            self._ready[v] = self._free_at
            if v == version:
                return self._free_at
        # an older version than one already fetched (or one skipped): fetch it now
        start = max(self._free_at, asked_at)
        self._free_at = start + diss.fetch_s(diss.bytes_of(self._first), self._down)
        self._first = False
        self._ready[version] = self._free_at
        return self._free_at
