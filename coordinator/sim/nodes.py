"""A simulated contributor node: the message sequence of ``node.worker.NodeWorker`` in virtual time.

Each node is one SimPy process (register → ask for a lease → Standby: wait ``retry_after_s`` /
Lease: fetch the version, generate, upload → repeat), one process for the submission in flight
(as ``node.work.WorkLoop`` does, a node waits for its verdict in the background while it works on
the next lease, and waits for it only before submitting again: one submission in flight at most)
and one heartbeat process (at the interval the coordinator handed out last: it grows with the
swarm). Every message goes to the real coordinator core at the moment it would arrive (half an
RTT after it is sent).

Disruptions come from one clock per node: the next one is drawn at rate ``churn.per_hour`` plus the
GPU kind's hardware failure rate. A *leave* releases the lease in progress (as a draining node
does) and the node is gone; a *crash* leaves its lease to expire; a *stall* freezes the node (no
heartbeats, no progress) for a lognormal time, after which it carries on and may submit late.

What a node submits is a real :class:`~protocol.messages.RolloutSubmission` for the coordinator's
task (the embedded reverse task): token ids, seeds and finish reasons a real node would send,
log-probs from the simulation's reference model (:func:`reference_logprob`). The generation *time*
is charged for the scenario's model and completion lengths. Cheaters: ``garbage`` sends token ids
outside the vocabulary; ``forger`` sends honest tokens with forged log-probs (only a spot check sees
that).
"""

from __future__ import annotations

import math

import simpy

from coordinator.errors import Rejection
from coordinator.intake import expected_seed
from coordinator.sim.base import Gen, WorldApi, reference_logprob
from coordinator.sim.catalogue import GpuKind
from coordinator.sim.network import Link, NodeDownloads
from protocol.errors import ReasonCode
from protocol.messages import (
    CapabilityAdvert,
    GpuInfo,
    GroupResult,
    Heartbeat,
    HeartbeatAck,
    Lease,
    LeaseRequest,
    RegisterAck,
    RolloutSubmission,
    Sample,
    Standby,
    Timings,
    pack_logprobs,
    pack_tokens,
    unpack_tokens,
)

#: A lease this close to its deadline (or past it) is submitted before the next request, as
#: ``node.work.LATE_MARGIN_S`` (the same value; a test compares them).
LATE_MARGIN_S = 10.0
#: Token id no vocabulary of the embedded task has (the garbage cheater's payload).
OUT_OF_VOCAB = 4_000_000


class SimNode:
    """State of one node (plain attributes: there are up to ~10^5 of them)."""

    __slots__ = (
        "alive",
        "billing_since",
        "busy_s",
        "cheat",
        "cost",
        "downloads",
        "fail_at",
        "fail_kind",
        "gen_end",
        "gpu",
        "hb_phase",
        "hb_s",
        "heartbeat",
        "idx",
        "joined_at",
        "key",
        "leases",
        "link",
        "loaded",
        "price",
        "registered",
        "request",
        "retry_s",
        "stalled_until",
        "submitting",
        "tps",
        "w",
        "waited_s",
    )  # fmt: skip

    def __init__(
        self,
        w: WorldApi,
        idx: int,
        gpu: GpuKind,
        price: float | None,
        tps: float,
        link: Link,
        cheat: str | None,
        joined_at: float,
    ) -> None:
        self.w = w
        self.idx = idx
        self.key = w.rng.randbytes(32)
        self.gpu = gpu
        self.price = price
        self.tps = tps  # generated tokens per second (the scenario's model)
        self.link = link
        self.cheat = cheat
        self.joined_at = joined_at
        self.hb_phase = joined_at + w.rng.random() * w.heartbeat_s
        self.hb_s = w.heartbeat_s  # the interval the coordinator asked for last
        preloaded = w.scenario.model.preloaded and joined_at <= w.scenario.churn.ramp_s
        self.downloads = NodeDownloads(
            w.diss, self.hb_phase, link.down_bps, joined_at, holds_base=preloaded
        )
        self.loaded: int | None = None
        self.alive = True
        self.stalled_until = -1.0
        self.fail_at = math.inf
        self.fail_kind = ""
        self.billing_since: float | None = None
        self.cost = 0.0
        self.registered = False
        self.retry_s: float | None = None  # retry_after_s of its last refused registration
        self.request = LeaseRequest(peer_id=f"sim{idx}", policy_version=None, max_prompts=64)
        self.heartbeat = Heartbeat(
            peer_id=f"sim{idx}", seq=1, policy_version=None, active_leases=[], tokens_per_s=None
        )
        self.leases = 0
        self.busy_s = 0.0
        self.gen_end: float | None = None  # wall clock of its last generation's end
        #: deliberate waits (standby, back-off) since then: not round trips (node/work.py)
        self.waited_s = 0.0
        #: the verdict of its last submission, on its way while the next lease is worked on
        self.submitting: simpy.Process | None = None
        self._next_failure(joined_at)

    # --- disruptions and billing -----------------------------------------------------------------
    def _next_failure(self, now: float) -> None:
        churn = self.w.scenario.churn
        rate_h = churn.per_hour + self.gpu.failures_per_hour
        if rate_h <= 0:
            self.fail_at = math.inf
            return
        rng = self.w.rng
        self.fail_at = now + rng.expovariate(rate_h / 3600.0)
        if rng.random() < churn.per_hour / rate_h:
            total = churn.leave + churn.crash + churn.stall
            u = rng.random() * total
            self.fail_kind = (
                "leave"
                if u < churn.leave
                else "crash"
                if u < churn.leave + churn.crash
                else "stall"
            )
        else:  # hardware: half crash, half stall
            self.fail_kind = "crash" if rng.random() < 0.5 else "stall"

    def bill_start(self, now: float) -> None:
        if self.billing_since is None:
            self.billing_since = now

    def bill_stop(self, now: float) -> None:
        if self.billing_since is not None:
            self.cost += self.w.billed(self.price, self.billing_since, now)
            self.billing_since = None

    def wait(self, dt: float, lease: Lease | None = None) -> Gen:
        """Let ``dt`` seconds pass for this node, living through its disruptions.

        Returns True when the time passed, False when the node left or crashed meanwhile (a
        lease in progress is then lost; a leaving node releases it first)."""
        env = self.w.env
        end = env.now + dt
        while self.fail_at < end:
            yield env.timeout(max(0.0, self.fail_at - env.now))
            if self.fail_kind == "stall":
                stall = self.w.draw_stall()
                self.stalled_until = env.now + stall
                self.w.stats.stalls += 1
                end += stall
                self._next_failure(self.stalled_until)
                continue
            yield from self._depart(lease)
            return False
        if end > env.now:
            yield env.timeout(end - env.now)
        return True

    def _depart(self, lease: Lease | None) -> Gen:
        w = self.w
        self.alive = False
        self.bill_stop(w.env.now)
        w.stats.departures[self.fail_kind] = w.stats.departures.get(self.fail_kind, 0) + 1
        if lease is not None:
            w.stats.lost_in_flight += len(lease.prompts) * lease.group_size
            if self.fail_kind == "leave":  # a draining node gives its lease back
                yield w.env.timeout(self.link.rtt_s / 2)
                w.call("release", w.core.release, self.key, lease.lease_id, lease.epoch)
        w.replace(self)

    # --- the processes ---------------------------------------------------------------------------
    def advert(self) -> CapabilityAdvert:
        w = self.w
        return CapabilityAdvert(
            peer_id=f"sim{self.idx}",
            node_key=self.key,
            gpus=[GpuInfo(name=self.gpu.name, memory_bytes=int(self.gpu.memory_gb * 2**30),
                          compute_capability="8.9", count=1)],
            cpu=None,
            backend="vllm",
            dtype="bfloat16",
            tokens_per_s=self.tps / w.token_unit,
            rollouts_per_s=0.0,
            price_per_hour=self.price,
            policy_version=self.loaded,
            reachability="public",
            software_version="sim",
            expires_at=w.clock() + 600.0,
        )  # fmt: skip

    def register(self) -> bool:
        got = self.w.call("register", self.w.core.register, self.key, self.advert())
        self.registered = not isinstance(got, Rejection)
        if isinstance(got, RegisterAck):
            self.hb_s = got.heartbeat_interval_s
        if isinstance(got, Rejection):
            self.w.stats.registrations_refused += 1
            self.retry_s = got.retry_after_s
        return self.registered

    def heartbeats(self) -> Gen:
        w = self.w
        yield w.env.timeout(max(0.0, self.hb_phase - w.env.now))
        while self.alive:
            if w.env.now >= self.stalled_until:
                got = w.call("heartbeat", w.core.heartbeat, self.key, self.heartbeat)
                if isinstance(got, HeartbeatAck) and got.heartbeat_interval_s is not None:
                    self.hb_s = got.heartbeat_interval_s
                if isinstance(got, Rejection) and got.code is ReasonCode.UNKNOWN_NODE:
                    self.register()
            yield w.env.timeout(self.hb_s)

    def run(self) -> Gen:
        w = self.w
        env = w.env
        yield env.timeout(max(0.0, self.joined_at - env.now))
        while not self.register():  # swarm full: try again when told (else later)
            retry = self.retry_s if self.retry_s is not None else w.heartbeat_s * 3
            if not (yield from self.wait(retry)):
                return
        env.process(self.heartbeats())
        half = self.link.rtt_s / 2
        while True:
            if not (yield from self.wait(half)):
                return
            got = w.call("lease", w.core.request_lease, self.key, self.request)
            lag = w.reply_lag()  # the answer waits for the coordinator's core
            if isinstance(got, Lease):
                self.bill_start(env.now)
                if not (yield from self.work(got, lag)):
                    return
                continue
            self.bill_stop(env.now)
            if isinstance(got, Standby):
                delay = got.retry_after_s
            elif isinstance(got, Rejection):
                if got.code is ReasonCode.UNKNOWN_NODE:
                    self.register()
                delay = got.retry_after_s if got.retry_after_s is not None else w.heartbeat_s
            else:
                raise AssertionError(f"unexpected answer {got!r}")
            self.waited_s += delay
            if not (yield from self.wait(half + lag + delay)):
                return

    def work(self, lease: Lease, lag: float = 0.0) -> Gen:
        """Run one lease (its answer left the coordinator ``lag`` s after it was issued):
        checkpoint, generation, upload, verdict. False if the node departed."""
        w = self.w
        env = w.env
        scen = w.scenario
        arrive = env.now + lag + self.link.rtt_s / 2
        ready = self.downloads.ready_at(lease.policy_version, arrive)
        load = 0.0
        if self.loaded != lease.policy_version:
            load = scen.model.load_s
            published = w.diss.published.get(lease.policy_version, ready)
            w.stats.dissemination.append(max(0.0, ready - published))
        n = len(lease.prompts) * lease.group_size
        tokens = w.draw_tokens(n)
        gen = tokens / self.tps * math.exp(w.rng.gauss(0.0, scen.lease_sigma))
        upload = n * 64 + tokens * 8  # token ids + log-probs, packed, plus framing
        total = (arrive - env.now) + max(0.0, ready - arrive) + load + gen
        total += upload / self.link.up_bps + self.link.rtt_s / 2
        self.leases += 1
        started = env.now
        self._spend(started, (
            ("transfer_s", arrive - started), ("download_s", max(0.0, ready - arrive)),
            ("load_s", load), ("generate_s", gen),
            ("transfer_s", upload / self.link.up_bps + self.link.rtt_s / 2),
        ))  # fmt: skip
        if not (yield from self.wait(total, lease)):
            return False
        self.busy_s += env.now - started
        self.loaded = lease.policy_version
        # what a real node reports (node/work.py): its generation, the wait for the version,
        # and the round trips since its previous generation (loads and deliberate waits, the
        # standby answers' retry_after_s, excluded: counted, they made a node the backlog bound
        # stood by look slow to the planner, which then kept every node active)
        finished = w.clock() - upload / self.link.up_bps - self.link.rtt_s / 2
        waited = max(0.0, ready - arrive) + load
        overhead = (
            0.0
            if self.gen_end is None
            else max(0.0, finished - gen - waited - self.waited_s - self.gen_end)
        )
        self.gen_end, self.waited_s = finished, 0.0
        timings = Timings(started_at=finished - gen, finished_at=finished, generate_s=gen,
                          load_s=waited, overhead_s=overhead)  # fmt: skip
        sub, bad = self.submission(lease, timings)
        yield from self._settle()  # one submission in flight: this one waits for the previous
        self.submitting = env.process(self._submit(lease, sub, n, tokens, bad))
        if lease.deadline - w.clock() < LATE_MARGIN_S:  # late: it lands before the next request
            yield from self._settle()
        return True

    def _settle(self) -> Gen:
        """Wait for the submission in flight, if any (booked as waiting for the verdict)."""
        if self.submitting is None or self.submitting.triggered:
            return
        asked = self.w.env.now
        yield self.submitting
        self._spend(asked, (("verdict_s", self.w.env.now - asked),))

    def _spend(self, start: float, phases: tuple[tuple[str, float], ...]) -> None:
        """Book where this node's paid time goes (the bill table): consecutive phases from
        ``start``, each the part of it inside the measured window. A volunteer's time is free:
        nothing booked (booked, it made a kind's phases add up past its paid hours)."""
        if not self.price:
            return
        lo, hi = self.w.window
        spent = self.w.stats.by_gpu[self.gpu.name]
        t = start
        for phase, seconds in phases:
            inside = min(t + seconds, hi) - max(t, lo)
            if inside > 0:
                spent[phase] += inside
            t += seconds

    def _submit(
        self, lease: Lease, sub: RolloutSubmission, n: int, tokens: float, bad: bool
    ) -> Gen:
        """The submission in flight: the coordinator's intake, then its verdict back at the node
        (a ban shows at the node's next lease request, which stops its bill)."""
        w = self.w
        verdict = yield from w.intake(self, lease, sub, n, tokens, bad)
        w.record_verdict(self, lease, verdict, n, bad)
        yield w.env.timeout(self.link.rtt_s / 2)

    def submission(self, lease: Lease, timings: Timings) -> tuple[RolloutSubmission, bool]:
        """What the node sends: honest reverse-task answers with reference log-probs, or a
        cheat. Returns (submission, whether it is bad)."""
        eos = self.w.tokenizer.eos_token_id
        v = lease.policy_version
        groups = []
        for i, prompt in enumerate(lease.prompts):
            text = unpack_tokens(prompt.token_ids)[1:-1]  # strip <bos> and '>'
            answer = [*reversed(text), eos]
            if self.cheat == "garbage":
                answer = [OUT_OF_VOCAB, eos]
            lps = [reference_logprob(v, p, t) for p, t in enumerate(answer)]
            if self.cheat == "forger":
                lps = [min(0.0, x + 1.0) for x in lps]
            tok, lp = pack_tokens(answer), pack_logprobs(lps)
            samples = [
                Sample(token_ids=tok, logprobs=lp, finish_reason="eos",
                       seed=expected_seed(lease.sampling.seed, i, j))
                for j in range(lease.group_size)
            ]  # fmt: skip
            groups.append(GroupResult(prompt_id=prompt.prompt_id, samples=samples))
        sub = RolloutSubmission(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            policy_version=v,
            backend="vllm",
            dtype="bfloat16",
            groups=groups,
            timings=timings,
        )
        return sub, self.cheat is not None
