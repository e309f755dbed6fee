"""One simulated run: SimPy environment, the real coordinator core, its intake queue, the learner.

Time: the coordinator's injected clock reads ``EPOCH + env.now``; nothing sleeps. The coordinator is
the production :class:`~coordinator.core.Coordinator` on a production :class:`~coordinator.store.
Store` (SQLite in memory, or a temp file with WAL and ``synchronous=FULL``); the simulation only
calls the methods the network service would call, when the service would call them:

* node messages (``register``, ``heartbeat``, ``request_lease``, ``submit``, ``release``) from
  :mod:`coordinator.sim.nodes`, half an RTT after they are sent;
* ``tick`` every second (``coordinator.service.TICK_S``);
* ``publish_version`` from the learner, then — once the coordinator has downloaded the version
  (``bytes / coordinator link``) — the version becomes servable and ``t_bcast_s`` takes the same
  running mean as :meth:`TBcastEstimate.held`; ``t_train_s`` follows the learner's
  last step as in :meth:`LearnerLink.on_fetch`.

``submit`` runs when the intake has verified the submission: it waits for a free intake worker
(``verification.workers``) and for the verification time the measured figures give
(:mod:`coordinator.sim.costs`, :mod:`coordinator.sim.calibration`). The coordinator's
verification budget sees the same time: the submission's lease is marked in verification from
its arrival (``VerifyingLeases.waiting``), each re-score's simulated tokens and seconds go into
the verifier's counters (the ``workers`` together as one verifier ``workers`` times as fast),
and ``verification.assumed_tokens_per_s`` is their throughput until it is measured.

The coordinator's own time is charged from the checked-in calibration
(:mod:`coordinator.sim.calibration`), never from a clock read during the run, so a seed gives
the same run every time: every message costs its open (signature, decode) and its core call on
one coordinator core (:class:`~coordinator.sim.calibration.CoreQueue`), every tick its upkeep, a
re-plan and the status document; a backlog delays the answers. Every call's CPU time is also
measured (``time.process_time``) and booked by operation for the report; it decides nothing.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import simpy

from coordinator.config import CoordinatorConfig, parse_config
from coordinator.core import Coordinator
from coordinator.errors import Rejection
from coordinator.sim.base import Gen, PoolNode, Stats
from coordinator.sim.calibration import Calibration, CoreQueue, load_calibration
from coordinator.sim.costs import Figures
from coordinator.sim.learner import Learner
from coordinator.sim.network import Dissemination, draw_link
from coordinator.sim.nodes import SimNode
from coordinator.sim.scenario import TRUSTED, Policy, Scenario
from coordinator.sim.verifier import ReferenceVerifier
from coordinator.store import Store
from coordinator.tasks import ReverseTask
from policy.model import CharTokenizer
from protocol.errors import ReasonCode
from protocol.identity import Identity, fingerprint_of
from protocol.manifest import build_manifest, sign_manifest
from protocol.messages import Ack, Lease, Reject, RolloutSubmission

EPOCH = 1_800_000_000.0  # the coordinator's clock at simulated time 0 (Unix seconds)
TICK_S = 1.0  # coordinator.service.TICK_S
#: the run is reported in this many equal stretches of time (the warm-up transient included)
TIMELINE_BUCKETS = 12
#: Tokens of the reverse task's honest answer (3 characters + EOS): one wire token stands for
#: ``completion_tokens_mean / 4`` simulated tokens (see :attr:`World.token_unit`).
WIRE_TOKENS = 4


class World:
    """Everything one run needs; :meth:`run` returns the raw outcome for :mod:`.results`."""

    def __init__(
        self,
        scenario: Scenario,
        policy: Policy,
        pool: list[PoolNode],
        figures: Figures,
        *,
        hours: float | None = None,
        calibration: Calibration | None = None,
        store_dir: Path | None = None,
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.figures = figures
        self.cal = calibration if calibration is not None else load_calibration()
        self.token_check_s = self.cal.token_check_s
        self.hours = hours if hours is not None else scenario.hours
        self.end_s = self.hours * 3600.0
        self.window = (min(scenario.warmup_minutes * 60.0, self.end_s / 2), self.end_s)
        self.rng = random.Random(scenario.seed * 1_000_003 + len(pool))
        self.env = simpy.Environment()
        self.stats = Stats(bucket_s=self.end_s / TIMELINE_BUCKETS)
        self.cpu_core = CoreQueue()
        self._reply_at = 0.0
        self.tokenizer = CharTokenizer()
        model = scenario.model
        self.token_unit = model.completion_tokens_mean / WIRE_TOKENS
        self.config = self._config(policy, pool, store_dir)
        self.heartbeat_s = self.config.heartbeat_interval_s
        self.diss = Dissemination(
            full_bytes=model.checkpoint_bytes,
            version_fraction=model.version_fraction,
            coordinator_bps=scenario.network.coordinator_mbit * 1e6 / 8,
            heartbeat_s=self.heartbeat_s,
        )
        ups = sorted(p.link.up_bps for p in pool) or [1.0]
        self.diss.relay_bps = scenario.network.sources * ups[len(ups) // 2]
        self.diss.ratio = figures.broadcast_ratio(len(pool))
        self.servable: set[int] = set()
        self.publisher = Identity.generate()
        self.verifier = ReferenceVerifier(self.config.intake.tolerances, self.tokenizer.vocab_size)
        self.store = Store(self.config.db_path)
        self.store.set_meta("spot_check_secret", random.Random(scenario.seed).randbytes(32).hex())
        self.core = Coordinator(
            self.config,
            store=self.store,
            task=ReverseTask(seed=scenario.seed),
            tokenizer=self.tokenizer,
            clock=self.clock,
            verifier=self.verifier,
            publisher_key=self.publisher.public_key,
            servable=lambda v: v in self.servable,
        )
        self.core.intake.offload = _inline
        lease_rng = random.Random(scenario.seed + 7)
        self.core.leases.nonce = lambda n: lease_rng.randbytes(n).hex()
        self.workers = simpy.Resource(self.env, capacity=scenario.verification.workers)
        self.nodes: list[SimNode] = []
        self.pool = pool
        self._waiters: list[simpy.Event] = []
        self.learner = Learner(self)

    # --- set-up ----------------------------------------------------------------------------------
    def _config(
        self, policy: Policy, pool: list[PoolNode], store_dir: Path | None
    ) -> CoordinatorConfig:
        s = self.scenario
        if s.store == "memory":
            db = ":memory:"
        else:
            base = store_dir or Path(tempfile.mkdtemp(prefix="swarm-sim-"))
            db = str(base / f"{policy}-{s.seed}.sqlite")
        data: dict[str, Any] = {
            "db_path": db,
            "group_size": s.learner.group_size,
            "staleness_bound": s.learner.staleness_bound,
            "max_nodes": max(10_000, 2 * len(pool)),
            "sampling": {
                "max_new_tokens": max(
                    WIRE_TOKENS, math.ceil(s.model.completion_tokens_max / self.token_unit)
                )
            },
            "capacity": {
                "batch_rollouts": s.learner.batch_rollouts,
                "t_train_s": s.learner.step_s,
                "activation": policy == "cost_aware",
            },
        }
        if s.learner.publish_every is not None:
            data["publish_every"] = s.learner.publish_every
        # V before it is measured: the simulated verifiers' own throughput (wire tokens/s)
        data["verification"] = {"assumed_tokens_per_s": self.verify_tokens_per_s()}
        for key, value in s.coordinator.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
        if policy in TRUSTED:  # the operator's own cluster: nothing checked, nobody on probation
            data.setdefault("intake", {}).update(
                {"spot_check_fraction": 0.0, "new_node_check_rate": 0.0}
            )
            data.setdefault("reward_audit", {})["fraction"] = 0.0
            data["verification"] = {**data.get("verification", {}), "admission": False}
        return parse_config(data, source="scenario [coordinator]")

    def clock(self) -> float:
        return EPOCH + self.env.now

    def rescore_s_per_token(self) -> float:
        """Seconds one verifier takes to re-score one simulated token (2 · params FLOPs)."""
        s = self.scenario
        return 2.0 * s.model.params_b * 1e9 / (s.verification.verifier_tflops * 1e12)

    def verify_tokens_per_s(self) -> float:
        """All verifiers' re-scoring throughput in the coordinator's (wire) tokens per second."""
        workers = self.scenario.verification.workers
        return workers / (self.rescore_s_per_token() * self.token_unit)

    # --- helpers the processes use ---------------------------------------------------------------
    def call(self, op: str, fn: Callable[..., Any], *args: Any, tokens: float = 0.0) -> Any:
        """``fn(*args)`` on the coordinator, its CPU time booked under ``op``; a
        :class:`Rejection` is returned, not raised. The message's calibrated cost (open and
        core call; ``tokens`` submitted) is charged to the coordinator core: :meth:`reply_lag`
        is then how long the answer waits for it."""
        t0 = time.process_time()
        try:
            out = fn(*args)
        except Rejection as exc:
            out = exc
        booked = self.stats.cpu[op]
        booked[0] += 1
        booked[1] += time.process_time() - t0
        self._charge(self.cal.message_s(op, tokens))
        return out

    def _charge(self, seconds: float) -> None:
        now = self.env.now
        self._reply_at = self.cpu_core.charge(now, seconds)
        self.stats.book("coordinator_busy_s", now, seconds)

    def reply_lag(self) -> float:
        """Seconds from now until the answer of the last :meth:`call` leaves the coordinator."""
        return max(0.0, self._reply_at - self.env.now)

    def billed(self, price: float | None, since: float, until: float) -> float:
        lo, hi = max(since, self.window[0]), min(until, self.window[1])
        return 0.0 if price is None or hi <= lo else price * (hi - lo) / 3600.0

    def draw_tokens(self, n: int) -> float:
        """Total completion tokens of ``n`` samples (lognormal lengths, capped)."""
        m = self.scenario.model
        sigma = m.completion_tokens_sigma
        mu = math.log(m.completion_tokens_mean) - sigma * sigma / 2
        cap = m.completion_tokens_max
        return float(sum(min(cap, self.rng.lognormvariate(mu, sigma)) for _ in range(n)))

    def draw_stall(self) -> float:
        c = self.scenario.churn
        return c.stall_s_median * math.exp(self.rng.gauss(0.0, c.stall_sigma))

    def add_node(self, spec: PoolNode, at: float) -> SimNode:
        node = SimNode(
            self, len(self.nodes), spec.gpu, spec.price, spec.tps, spec.link, spec.cheat, at
        )
        self.nodes.append(node)
        self.stats.gpu_of[fingerprint_of(node.key)] = spec.gpu.name
        self.env.process(node.run())
        return node

    def replace(self, gone: Any) -> None:
        """A node left or crashed: a new one of the same kind joins after a while."""
        s = self.scenario
        klass = s.network.consumer if gone.gpu.klass == "consumer" else s.network.datacenter
        noise = math.exp(self.rng.gauss(0.0, s.throughput_sigma))
        base = gone.gpu.tokens_per_s(s.model.params_b)
        spec = PoolNode(gone.gpu, gone.price, base * noise, draw_link(self.rng, klass), gone.cheat)
        delay = self.rng.expovariate(1.0 / s.churn.rejoin_s_mean) if s.churn.rejoin_s_mean else 0.0
        self.stats.joins += 1
        self.add_node(spec, self.env.now + delay)

    # --- the intake ------------------------------------------------------------------------------
    def verify_s(self, node: SimNode, lease: Lease, n: int, tokens: float, bad: bool) -> float:
        """Simulated verification time of one submission (checks 3–6, commit, check 7)."""
        s = self.scenario
        cheap = n * self.figures.cheap_check_s + tokens * self.token_check_s
        if node.cheat == "garbage":  # refused by check 5 before any re-scoring
            return cheap
        intake = self.core.intake
        trust = self.core.trust.state(node.key)  # the adaptive check rate, as submit reads it
        suspect = self.config.intake.suspect_full_check and trust.suspect
        if intake.verifier is None or not (
            suspect or intake.spot_checked(lease.lease_id, self.core.trust.rate_of(trust))
        ):
            return cheap
        k = n  # a checked lease is re-scored in full (issue 34)
        self.stats.spot_checked += 1
        rescored = k * (s.model.prompt_tokens + tokens / n)  # simulated tokens
        rescore_s = self.rescore_s_per_token() * rescored
        # what the coordinator's meter reads: wire tokens, the workers as one faster verifier
        self.verifier.charge(rescored / self.token_unit, rescore_s / s.verification.workers)
        return cheap + rescore_s

    def intake(
        self, node: SimNode, lease: Lease, sub: RolloutSubmission, n: int, tokens: float, bad: bool
    ) -> Gen:
        """Queue for an intake worker, spend the verification time, then the real ``submit``
        (the lease marked in verification from the arrival on, as the service marks it)."""
        arrived = self.env.now
        at = self.clock()
        self.stats.max_queue = max(self.stats.max_queue, len(self.workers.queue) + 1)
        with (
            self.core.budget.verifying.waiting(lease.lease_id, node.key, at),
            self.workers.request() as slot,
        ):
            yield slot
            self.stats.queue_wait_s += self.env.now - arrived
            service = self.verify_s(node, lease, n, tokens, bad)
            self.stats.verify_busy_s += service
            yield self.env.timeout(service)
            if bad:
                self.stats.bad_leases.add(lease.lease_id)
            verdict = self.call(
                "submit", _run_inline, self.core.submit(node.key, sub, at), tokens=tokens
            )
            waited = max(0.0, self.env.now - arrived - service)  # no -0.0 from rounding
            self.stats.book("verify_wait_s", arrived, waited)
            self.stats.book("submissions", arrived, 1.0)
        if isinstance(verdict, Ack):
            self.stats.book("accepted", self.env.now, float(n))
            if self.window[0] <= self.env.now <= self.window[1]:
                self.stats.by_gpu[node.gpu.name]["accepted"] += n
            # acknowledged by the coordinator now (its rows are committed): a run that ends while
            # the reply is on its way must not count the rows as never acknowledged
            self.stats.acked.add(lease.lease_id)
            self.stats.acked_by[lease.lease_id] = node.key
            self._wake_learner()
        lag = self.reply_lag()
        if lag > 0:
            yield self.env.timeout(lag)
        return verdict

    def record_verdict(self, node: SimNode, lease: Lease, verdict: Any, n: int, bad: bool) -> None:
        if isinstance(verdict, Ack):
            self.stats.verdicts["ack"] += 1
            self.stats.acked.add(lease.lease_id)
            self.stats.acked_by[lease.lease_id] = node.key
            if not bad:
                self.stats.submitted[lease.lease_id] = n
            return
        code = verdict.code if isinstance(verdict, Reject | Rejection) else None
        self.stats.verdicts[code.value if code else "other"] += 1
        if bad or code is None:
            return
        if code in (ReasonCode.STALE_EPOCH, ReasonCode.LEASE_EXPIRED, ReasonCode.DUPLICATE):
            self.stats.lost_refused += n
            self.stats.book("refused_late", self.env.now, float(n))
        elif code is ReasonCode.TOO_STALE:
            self.stats.refused_too_stale += n

    def wait_for_rollouts(self) -> simpy.Event:
        event = self.env.event()
        self._waiters.append(event)
        return event

    def _wake_learner(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.succeed()

    # --- versions --------------------------------------------------------------------------------
    def publish(self, version: int) -> Gen:
        """The learner's publication of ``version``: record it, then the coordinator holds it."""
        now = self.clock()
        manifest, _ = build_manifest(
            {"model.safetensors": version.to_bytes(8, "big") * 8},
            version=version,
            parent_version=version - 1 if version else None,
            model_config_hash="51",
            tokenizer_hash="51",
            created_at=now,
            expires_at=now + 30 * 86400,
            chunk_size=64,
        )
        signed = sign_manifest(manifest, self.publisher, now)
        self.call("publish", self.core.publish_version, signed)
        self.diss.publish(version, self.env.now)
        nbytes = self.diss.bytes_of(first=version == 0)
        hold = nbytes / self.diss.coordinator_bps
        yield self.env.timeout(hold)
        self.servable.add(version)
        # TBcastEstimate.held: t_bcast ← 0.7·t_bcast + 0.3·elapsed
        self.core.t_bcast_s = 0.7 * self.core.t_bcast_s + 0.3 * hold

    def ticks(self) -> Gen:
        """The service's upkeep every second: the core's tick (a re-plan when one is due) and the
        status document (``StatusBoard.refresh``), charged to the core."""
        while True:
            yield self.env.timeout(TICK_S)
            planned = self.core._planned_at
            t0 = time.process_time()
            self.core.tick()
            # a node learns of a version at its next heartbeat: at the interval handed out now
            self.diss.heartbeat_s = self.core.liveness.interval_s
            booked = self.stats.cpu["tick"]
            booked[0] += 1
            booked[1] += time.process_time() - t0
            live = sum(1 for n in self.nodes if n.alive and n.registered)
            replanned = self.core._planned_at != planned
            short = self.core.plan is not None and not self.core.plan.meets_rule
            self._charge(self.cal.upkeep_s(live, replanned=replanned, short=short, status=True))

    # --- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        ramp = self.scenario.churn.ramp_s
        for i, spec in enumerate(self.pool):
            self.add_node(spec, ramp * i / max(1, len(self.pool)))
        self.env.process(self.ticks())
        self.env.process(self.learner.run())
        self.env.run(until=self.end_s)
        for node in self.nodes:
            node.bill_stop(self.end_s)

    def close(self) -> None:
        self.core.close()


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    """``asyncio.to_thread`` without the thread: the simulation has no event loop."""
    return fn(*args)


def _run_inline(coro: Any) -> Any:
    """Drive a coroutine that never suspends (the core's ``submit`` with inline off-loading)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coordinator suspended in a simulated call (an awaited real I/O?)")
