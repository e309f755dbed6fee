"""What the simulation's processes share: the world interface, pool entries, counters, the
nodes' reference model. (Kept apart so nodes, learner and world import it, not each other.)"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy

from coordinator.core import Coordinator
from coordinator.sim.catalogue import GpuKind
from coordinator.sim.network import Dissemination, Link
from coordinator.sim.scenario import Scenario
from policy.model import CharTokenizer
from protocol.messages import Lease, RolloutSubmission

#: A SimPy process body.
Gen = Generator[Any, Any, Any]


def reference_logprob(version: int, position: int, token: int) -> float:
    """The simulation's "model": the log-prob of ``token`` at ``position`` under ``version``
    (deterministic; honest nodes report it, the verifier recomputes it)."""
    return -0.05 - 0.01 * ((token * 31 + position * 17 + version * 7) % 97)


@dataclass(frozen=True)
class PoolNode:
    """A node of the pool before the run (the same draws serve every policy)."""

    gpu: GpuKind
    price: float | None
    tps: float  # generated tokens per second for the scenario's model
    link: Link
    cheat: str | None  # None, "garbage" or "forger"


@dataclass
class Stats:
    """Counters the processes update during a run."""

    #: operation -> [calls, CPU seconds] of the coordinator
    cpu: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    verdicts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    departures: dict[str, int] = field(default_factory=dict)
    stalls: int = 0
    joins: int = 0
    registrations_refused: int = 0  # registrations refused (swarm full, verification budget)
    lost_in_flight: int = 0  # samples of leases abandoned by a departing node
    lost_refused: int = 0  # samples of honest submissions refused as late (expired / fenced)
    refused_too_stale: int = 0  # samples refused because their version fell out of S
    submitted: dict[str, int] = field(default_factory=dict)  # lease_id -> honest samples sent
    acked: set[str] = field(default_factory=set)  # lease ids answered Ack
    acked_by: dict[str, bytes] = field(default_factory=dict)  # lease id -> node key
    bad_leases: set[str] = field(default_factory=set)  # lease ids whose submission was a cheat
    queue_wait_s: float = 0.0
    verify_busy_s: float = 0.0
    spot_checked: int = 0
    max_queue: int = 0
    dissemination: list[float] = field(default_factory=list)  # ready − publish, per version load
    #: GPU kind -> figures within the window: seconds of its leases started there by phase
    #: (``download_s``, ``load_s``, ``generate_s``, ``transfer_s``, ``verdict_s``) and rollouts
    #: (``accepted``, ``trained``, ``dropped``: too stale);
    #: :func:`coordinator.sim.results.gpu_figures` reads them
    by_gpu: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    #: node fingerprint -> its GPU kind (the learner's rollouts name their node by fingerprint)
    gpu_of: dict[str, str] = field(default_factory=dict)
    #: width of one stretch of the timeline (seconds); figure -> per-stretch sums
    bucket_s: float = 60.0
    timeline: dict[str, list[float]] = field(default_factory=dict)

    def book(self, figure: str, at: float, value: float) -> None:
        """Add ``value`` to ``figure`` in the stretch of time holding ``at``."""
        i = int(at // self.bucket_s) if self.bucket_s > 0 else 0
        row = self.timeline.setdefault(figure, [])
        if len(row) <= i:
            row.extend([0.0] * (i + 1 - len(row)))
        row[i] += value

    def book_span(self, figure: str, start: float, end: float) -> None:
        """Add the seconds of [start, end) to ``figure``, split over the stretches they cover."""
        t = start
        while t < end:
            edge = (int(t // self.bucket_s) + 1) * self.bucket_s
            self.book(figure, t, min(end, edge) - t)
            t = edge


class WorldApi(Protocol):
    """The parts of :class:`coordinator.sim.world.World` the node and learner processes use."""

    env: simpy.Environment
    rng: random.Random
    scenario: Scenario
    stats: Stats
    core: Coordinator
    diss: Dissemination
    tokenizer: CharTokenizer
    heartbeat_s: float
    token_unit: float
    window: tuple[float, float]

    def clock(self) -> float: ...

    def call(self, op: str, fn: Callable[..., Any], *args: Any, tokens: float = 0.0) -> Any: ...

    def reply_lag(self) -> float: ...

    def billed(self, price: float | None, since: float, until: float) -> float: ...

    def draw_tokens(self, n: int) -> float: ...

    def draw_stall(self) -> float: ...

    def replace(self, gone: Any) -> None: ...

    def intake(
        self, node: Any, lease: Lease, sub: RolloutSubmission, n: int, tokens: float, bad: bool
    ) -> Gen: ...

    def record_verdict(self, node: Any, lease: Lease, verdict: Any, n: int, bad: bool) -> None: ...

    def wait_for_rollouts(self) -> simpy.Event: ...

    def publish(self, version: int) -> Gen: ...
