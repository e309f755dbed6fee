"""A simulated pipeline around the real coordinator core, for the capacity tests and benchmarks.

Discrete events on a fake clock: N nodes and a learner, and between them the real
:class:`~coordinator.core.Coordinator` (in-memory SQLite): its leases (sizing, deadlines,
standby answers of the capacity planner), its intake (every submission is an honest one of the
embedded reverse task and goes through the full verification), its staleness refusals, its
rollout feed with the learner's ``min_policy_version``, its per-node figures and its plan.

* A node asks for a lease; on ``Standby`` it asks again after ``retry_after_s`` (unpaid); on a
  lease it loads the lease's version if it holds another one (``load_s``), generates
  ``samples / rate`` seconds, and its result reaches the coordinator ``overhead_s`` later (the
  round trips); then it asks again. It reports what the node worker reports (``Timings``).
* The learner takes ``batch`` admissible rollouts (staleness ≤ S) oldest first, trains
  ``t_train`` seconds, and every κ steps publishes: the version is leasable ``t_bcast`` seconds
  after the step that made it. It waits whenever fewer than ``batch`` admissible rollouts are
  there; that wait, over the measured window, is the *measured* idle fraction.

Nothing here evaluates the capacity formula: the prediction comes from the coordinator's own
plan (:attr:`Coordinator.plan`), fed by what its components measured during the run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from coord_harness import TOK, FakeClock, advert, submission

from coordinator.config import CoordinatorConfig
from coordinator.core import Coordinator
from coordinator.store import Store
from coordinator.tasks import ReverseTask
from protocol.identity import Identity
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Lease, LeaseRequest, Standby, Timings

#: tokens of one sample of the reverse task (3 characters + EOS)
TOKENS_PER_SAMPLE = 4


@dataclass
class SimNode:
    """One simulated contributor."""

    name: str
    #: μ: samples per second of generation
    rate: float
    #: seconds per lease on round trips (asking, submitting, the verdict)
    overhead_s: float = 0.0
    #: seconds to switch to a new version (its version-load delay)
    load_s: float = 0.0
    #: price per hour (None: free volunteer)
    price: float | None = None
    # run state
    ident: Identity = field(default_factory=Identity.generate)
    loaded: int | None = None
    paid_s: float = 0.0
    leases: int = 0
    standby_answers: int = 0


@dataclass
class SimLearner:
    """The learner's side."""

    batch: int
    t_train: float
    kappa: int
    staleness_bound: int
    t_bcast: float = 0.0
    #: each step takes t_train × U(1 − j, 1 + j) (a learner sharing its machine); the trainer
    #: reports the coefficient of variation, j/√3, as ``t_train_cv``
    t_train_jitter: float = 0.0


@dataclass
class SimResult:
    measured_idle: float
    predicted_idle: float
    pool_idle: float
    steps: int
    trained: int
    accepted: int
    dropped_stale: int
    refused_stale: int
    cost: float
    seconds: float
    active: int
    standby: int

    @property
    def cost_per_rollout(self) -> float:
        return self.cost / self.trained if self.trained else float("inf")


class PipelineSim:
    """See the module docstring."""

    def __init__(
        self,
        nodes: list[SimNode],
        learner: SimLearner,
        *,
        group_size: int = 8,
        max_prompts: int = 4,
        activation: bool = False,
        headroom: float = 0.2,
        jitter: float = 0.3,
        ewma: float = 0.3,
        seed: int = 0,
        start: float = 1_000_000.0,
    ) -> None:
        self.nodes = nodes
        #: each lease's generation and round trips take their nominal time × U(1 − j, 1 + j):
        #: real nodes do not tick like clocks (and identical clocks phase-lock to the learner)
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.steps_rng = random.Random(seed + 1)
        self.learner = learner
        self.clock = FakeClock(start)
        self.start = start
        self.cfg = CoordinatorConfig.model_validate(
            {
                "db_path": ":memory:",
                "group_size": group_size,
                "staleness_bound": learner.staleness_bound,
                "publish_every": learner.kappa,
                "heartbeat_interval_s": 2.0,
                "sampling": {"max_new_tokens": TOKENS_PER_SAMPLE},
                "leases": {
                    "min_deadline_s": 120.0,
                    "max_prompts_per_lease": max_prompts,
                    "target_lease_s": 1e6,  # lease size = max_prompts
                    "throughput_ewma": ewma,
                },
                "intake": {"spot_check_fraction": 0.0},
                "capacity": {
                    "activation": activation,
                    "headroom": headroom,
                    "batch_rollouts": learner.batch,
                    "t_train_s": learner.t_train,
                    "t_bcast_s": learner.t_bcast,
                },
                "reputation": {"strikes_to_ban": 1000},
            }
        )
        self.publisher = Identity.generate()
        self.core = Coordinator(
            self.cfg,
            store=Store(":memory:"),
            task=ReverseTask(),
            tokenizer=TOK,
            clock=self.clock,
            publisher_key=self.publisher.public_key,
        )
        self._events: list[tuple[float, int, Callable[[], Awaitable[None]]]] = []
        self._seq = itertools.count()
        # learner state
        self.version = 0
        self.published = 0
        self.cursor = 0
        self.pending: list[Any] = []
        self.training = False
        self.waiting_since: float | None = start
        self.idle_s = 0.0
        self.window_start = start
        self.steps = 0
        self.trained = 0
        self.dropped_stale = 0
        self.refused_stale = 0

    # --- event machinery ---
    def at(self, t: float, fn: Callable[[], Awaitable[None]]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    async def run(self, seconds: float, *, warmup: float = 0.0) -> SimResult:
        """Simulate ``warmup + seconds``; measure over the last ``seconds``."""
        self._publish(0)
        for i, node in enumerate(self.nodes):
            ad = advert(node.ident, self.clock(), node.price, node.rate)
            ad = msgspec.structs.replace(ad, tokens_per_s=node.rate * TOKENS_PER_SAMPLE)
            self.core.register(node.ident.public_key, ad)
            self.at(self.start + 0.001 * i, self._asker(node))
        self.core.t_train_s = self.learner.t_train  # what the trainer reports
        self.core.t_train_cv = self.learner.t_train_jitter / 3**0.5
        self.at(self.start, self._learner_try)
        self.at(self.start + 1.0, self._tick)
        end = self.start + warmup + seconds
        self.window_start = self.start + warmup
        paid_at_window = {n.name: 0.0 for n in self.nodes}
        measured_from = False
        while self._events and self._events[0][0] <= end:
            t, _, fn = heapq.heappop(self._events)
            if not measured_from and t >= self.window_start:
                measured_from = True
                self._enter_window()
                paid_at_window = {n.name: n.paid_s for n in self.nodes}
            self.clock.t = max(self.clock.t, t)
            await fn()
        self.clock.t = end
        if self.waiting_since is not None:
            self.idle_s += end - max(self.waiting_since, self.window_start)
        self.core.replan()
        plan = self.core.plan
        assert plan is not None
        cost = sum(
            (n.paid_s - paid_at_window[n.name]) * (n.price or 0.0) / 3600 for n in self.nodes
        )
        return SimResult(
            measured_idle=self.idle_s / seconds,
            predicted_idle=plan.predicted_idle,
            pool_idle=plan.pool_idle,
            steps=self.steps,
            trained=self.trained,
            accepted=self.core.store.rollout_count(),
            dropped_stale=self.dropped_stale,
            refused_stale=self.refused_stale,
            cost=cost,
            seconds=seconds,
            active=len(plan.active),
            standby=len(plan.standby),
        )

    def _enter_window(self) -> None:
        self.idle_s = 0.0
        if self.waiting_since is not None:
            self.waiting_since = self.window_start
        self.steps = self.trained = self.dropped_stale = self.refused_stale = 0

    async def _tick(self) -> None:
        self.core.tick()
        self.at(self.clock() + 1.0, self._tick)

    # --- versions ---
    def _publish(self, version: int) -> None:
        now = self.clock()
        manifest, _ = build_manifest(
            {"model.safetensors": b"w" * 64},
            version=version,
            parent_version=version - 1 if version > 0 else None,
            model_config_hash="ab",
            tokenizer_hash="cd",
            created_at=now,
            expires_at=now + 86400,
            chunk_size=32,
        )
        self.core.publish_version(sign_manifest(manifest, self.publisher, now))

    # --- nodes ---
    def _asker(self, node: SimNode) -> Callable[[], Awaitable[None]]:
        async def ask() -> None:
            got = self.core.request_lease(
                node.ident.public_key,
                LeaseRequest(peer_id="peer", policy_version=node.loaded, max_prompts=64),
            )
            if isinstance(got, Standby):
                node.standby_answers += 1
                self.at(self.clock() + got.retry_after_s, ask)
                return
            assert isinstance(got, Lease)
            load = node.load_s if got.policy_version != node.loaded else 0.0
            node.loaded = got.policy_version
            gen = len(got.prompts) * got.group_size / node.rate * self._jitter()
            overhead = node.overhead_s * self._jitter()
            cycle = load + gen + overhead
            node.paid_s += cycle
            node.leases += 1
            timings = Timings(
                started_at=self.clock() + load,
                finished_at=self.clock() + load + gen,
                generate_s=gen,
                load_s=load,
                overhead_s=overhead,
            )
            sub = msgspec.structs.replace(submission(got), timings=timings)

            async def submit() -> None:
                verdict = await self.core.submit(node.ident.public_key, sub)
                if getattr(verdict, "code", None) is not None:
                    self.refused_stale += 1
                await self._learner_try()
                await ask()

            self.at(self.clock() + cycle, submit)

        return ask

    def _jitter(self) -> float:
        return 1.0 + self.jitter * (2 * self.rng.random() - 1)

    # --- the learner ---
    async def _learner_try(self) -> None:
        if self.training:
            return
        s = self.learner.staleness_bound
        batch = self.core.fetch_rollouts(self.cursor, 4096, max(0, self.version - s))
        self.cursor = batch.last_seq
        self.pending.extend(batch.rollouts)
        fresh = [r for r in self.pending if self.version - r.policy_version <= s]
        self.dropped_stale += len(self.pending) - len(fresh)
        self.pending = fresh
        if len(self.pending) < self.learner.batch:
            if self.waiting_since is None:
                self.waiting_since = self.clock()
            return
        if self.waiting_since is not None:
            self.idle_s += self.clock() - max(self.waiting_since, self.window_start)
            self.waiting_since = None
        self.pending = self.pending[self.learner.batch :]
        self.training = True
        j = self.learner.t_train_jitter
        step = self.learner.t_train * (1.0 + j * (2 * self.steps_rng.random() - 1))
        self.at(self.clock() + step, self._learner_done)

    async def _learner_done(self) -> None:
        self.training = False
        self.version += 1
        self.steps += 1
        self.trained += self.learner.batch
        if self.version - self.published >= self.learner.kappa:
            self.published = version = self.version

            async def publish() -> None:
                self._publish(version)

            self.at(self.clock() + self.learner.t_bcast, publish)
        await self._learner_try()


def simulate(
    nodes: list[SimNode], learner: SimLearner, *, seconds: float, warmup: float, **kw: Any
) -> SimResult:
    """Run :class:`PipelineSim` to the end (a fresh event loop)."""
    return asyncio.run(PipelineSim(nodes, learner, **kw).run(seconds, warmup=warmup))
