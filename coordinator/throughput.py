"""Per-node capacity figures, measured lease by lease (docs/capacity.md, "Measured inputs").

For every accepted submission the node reports in its ``Timings`` how long it generated
(``generate_s``), how long the lease waited for its version (``load_s``) and how long its loop
spent on round trips since its previous generation (``overhead_s``). The coordinator itself
observed the time from issuing the lease to receiving the result, and bounds the claims by it:

* ``generate_s`` and ``load_s`` are clipped so that together they fit in the observed time;
* the per-lease overhead is at least the observed time the claims leave unexplained.

So a node that under-reports its generation time to look fast gains nothing: the rule uses
μ_i·g_i/(g_i + o_i) = samples / (g_i + o_i), and the time it hid reappears in o_i.

:class:`NodeFigures` keeps exponential moving averages (weight ``alpha`` per lease) of the samples
per lease n_i, g_i = generation seconds per lease, o_i = overhead seconds per lease, and
μ_i = n_i / g_i samples per second of generation — a ratio of the means, not a mean of each
lease's ratio: generation times that vary from lease to lease (a shared CPU) would make the mean
of ratios overstate the rate (Jensen's inequality; E[n/g] > n/E[g]), and the rule's
μ_i·g_i/(g_i + o_i) must be the samples per lease cycle;
d_i = load seconds per *version switch* (a lease on a version the node had not leased before;
a lease on the version it already holds reports no load and does not dilute d_i). The book is
soft state, rebuilt from the next leases after a restart (the durable end-to-end
``NodeRecord.rollouts_per_s`` covers the meantime).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: figures beyond this are not believed (seconds; a lease is never this long)
MAX_SECONDS = 86400.0


@dataclass
class NodeFigures:
    """Smoothed capacity figures of one node (see the module docstring)."""

    #: μ_i: samples per second of generation (= samples / lease_s)
    gen_rate: float
    #: g_i: generation seconds per lease
    lease_s: float
    #: o_i: seconds per lease on round trips (asking, submitting, the verdict)
    overhead_s: float
    #: d_i: seconds the node could not generate per version switch (None: no switch seen yet)
    load_s: float | None
    #: the version of its last measured lease
    version: int
    leases: int = 1
    #: n_i: samples per lease (0: taken as gen_rate × lease_s)
    samples: float = 0.0

    def __post_init__(self) -> None:
        if self.samples <= 0:
            self.samples = self.gen_rate * self.lease_s


def _clean(x: float) -> float:
    return min(MAX_SECONDS, x) if math.isfinite(x) and x > 0 else 0.0


class ThroughputBook:
    """:class:`NodeFigures` per node key, updated from accepted submissions."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("ThroughputBook: alpha must be in (0, 1]")
        self.alpha = alpha
        self._figures: dict[bytes, NodeFigures] = {}
        #: called with a node's key whenever its figures change (the planner's inputs follow)
        self.listeners: list[Callable[[bytes], None]] = []

    def get(self, node_key: bytes) -> NodeFigures | None:
        return self._figures.get(node_key)

    def forget(self, node_key: bytes) -> None:
        self._figures.pop(node_key, None)
        self._changed(node_key)

    def record(
        self,
        node_key: bytes,
        *,
        samples: int,
        version: int,
        generate_s: float,
        load_s: float,
        overhead_s: float,
        observed_s: float,
    ) -> NodeFigures | None:
        """Fold one accepted lease in; ``observed_s`` = receipt − issue on the coordinator's clock.

        Returns the node's figures (None when the lease carries nothing to measure)."""
        observed = _clean(observed_s)
        gen = min(_clean(generate_s), observed) if observed > 0 else _clean(generate_s)
        if samples <= 0 or gen <= 0:
            return None
        load = min(_clean(load_s), max(0.0, observed - gen)) if observed > 0 else _clean(load_s)
        overhead = max(_clean(overhead_s), observed - gen - load)
        rate = samples / gen
        old = self._figures.get(node_key)
        if old is None:  # its first load is the start-up download, not a steady-state switch
            fig = NodeFigures(rate, gen, overhead, None, version, samples=samples)
            self._figures[node_key] = fig
            self._changed(node_key)
            return fig
        a = self.alpha
        old.samples = (1 - a) * old.samples + a * samples
        old.lease_s = (1 - a) * old.lease_s + a * gen
        old.gen_rate = old.samples / old.lease_s
        old.overhead_s = (1 - a) * old.overhead_s + a * overhead
        if version != old.version:  # a version switch: its load (0 when the prefetch hid it)
            old.load_s = load if old.load_s is None else (1 - a) * old.load_s + a * load
        old.version = version
        old.leases += 1
        self._changed(node_key)
        return old

    def _changed(self, node_key: bytes) -> None:
        for fn in self.listeners:
            fn(node_key)


class LeaseLag:
    """From a version's publish call to the first lease that names it (``plan_lease_lag_s`` on
    ``/status``; docs/capacity.md, "Measured inputs").

    Beside T_bcast (publish call -> the coordinator holds the version) it shows what happens
    after: a version is leasable once held, and its first rollouts start when a node asks for
    work — after it finished the lease it was running, a fraction of a lease cycle. A lag far
    longer than that means the nodes stall before asking: in the capacity demos a node's lease
    on the version it had loaded waited 2 s behind its prefetch of the next one (fixed in
    node/checkpoints.py), which this figure showed as a lag of 0.17 s on average against a
    download of 0.09 s.

    A version that no lease ever names (the next one was leasable first) is forgotten: no rollout
    of it exists. Running mean with weight ``alpha`` per leased version; soft state (after a
    restart, the versions published before it are not measured)."""

    #: versions remembered while waiting for their first lease (older ones are forgotten)
    KEEP = 32

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._published: dict[int, float] = {}
        #: the running mean (seconds); None until a version was leased
        self.mean_s: float | None = None

    def published(self, version: int, at: float) -> None:
        self._published[version] = at
        if len(self._published) > self.KEEP:
            del self._published[min(self._published)]

    def leased(self, version: int, at: float) -> None:
        """A lease naming ``version`` was issued at ``at`` (cheap when it is not the first)."""
        first = self._published.pop(version, None)
        if first is None:
            return
        for older in [v for v in self._published if v < version]:  # skipped: never leased
            del self._published[older]
        lag = max(0.0, at - first)
        self.mean_s = (
            lag if self.mean_s is None else (1 - self.alpha) * self.mean_s + self.alpha * lag
        )
