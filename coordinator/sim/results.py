"""What one run measured, and the invariants every run must keep.

Invariants (checked after every run from the coordinator's own store and the learner's ledger):

* ``acked_durable``: every submission the coordinator acknowledged has its rows in the store,
  and every stored row belongs to an acknowledged submission;
* ``one_group_per_prompt``: no prompt index has more than one accepted group, no group more than
  G samples (nothing accepted twice, however many leases held the prompt);
* ``nothing_lost``: every stored rollout was trained on, dropped as too stale, is waiting in the
  learner's pending groups, or was not fetched yet — and none was fetched twice;
* ``no_bad_trained``: no rollout of a cheating submission was trained on.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from coordinator.sim.scenario import TRUSTED
from protocol.identity import fingerprint_of

if TYPE_CHECKING:
    from coordinator.sim.world import World


@dataclass
class RunResult:
    scenario: str
    policy: str
    label: str  # what varies in this run ("base", "S=2", ...)
    nodes: int  # pool at start (after the policy's selection)
    hours: float
    wall_s: float
    cpu_s: float  # whole process (simulation + coordinator)
    coordinator_cpu: dict[str, tuple[int, float]]  # op -> (calls, CPU seconds)
    window_h: float
    accepted: int  # rollouts accepted within the window
    accepted_total: int
    trained: int  # rollouts trained on within the window
    dropped_stale: int
    swarm_cost: float  # USD within the window
    learner_cost: float
    learner_idle: float  # fraction of the window the learner waited for a batch
    staleness: dict[int, int]
    lost_to_churn: int  # samples generated (or being generated) and never accepted
    refused_too_stale: int
    generated: int  # samples whose submission reached the coordinator or was lost in flight
    bad_trained: int
    bad_submissions: int
    banned: int
    cheaters: int
    verdicts: dict[str, int]
    spot_checked: int
    verify_utilisation: float
    queue_wait_mean_s: float
    billed_nodes_mean: float  # paid-for nodes on average in the window
    steps: int
    versions: int
    t_bcast_estimate: float
    dissemination_s: float  # mean time from publication to a node holding the version
    departures: dict[str, int]
    stalls: int
    plan: str
    invariants: dict[str, tuple[bool, str]] = field(default_factory=dict)
    #: simulated tokens per rollout and CPU seconds per token of the intake's per-token checks
    #: (the wire carries 4 tokens per sample: production adds tokens · this per rollout)
    tokens_per_rollout: float = 0.0
    token_check_s: float = 0.0
    #: the coordinator core as the calibration charges it: busy share of the run, mean and
    #: largest wait of a message for the core (seconds)
    coordinator_utilisation: float = 0.0
    coordinator_wait_mean_s: float = 0.0
    coordinator_backlog_max_s: float = 0.0
    #: the run in equal stretches, warm-up included (:func:`timeline_rows`)
    timeline: list[dict[str, float]] = field(default_factory=list)
    #: USD of the verifiers within the window (none for a trusted co-located cluster)
    verifier_cost: float = 0.0
    #: GPU kind -> its figures within the window (:func:`gpu_figures`)
    by_gpu: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def sim_hours_per_wall_minute(self) -> float:
        return self.hours / (self.wall_s / 60.0) if self.wall_s > 0 else float("inf")

    @property
    def sim_hours_per_cpu_minute(self) -> float:
        return self.hours / (self.cpu_s / 60.0) if self.cpu_s > 0 else float("inf")

    @property
    def cost_per_accepted(self) -> float:
        return self.swarm_cost / self.accepted if self.accepted else float("inf")

    @property
    def total_cost(self) -> float:
        """Everything billed within the window: the rollout workers, the learner, the
        verifiers."""
        return self.swarm_cost + self.learner_cost + self.verifier_cost

    @property
    def cost_per_trained(self) -> float:
        return self.total_cost / self.trained if self.trained else float("inf")

    @property
    def coordinator_cpu_s(self) -> float:
        return sum(s for _, s in self.coordinator_cpu.values())

    @property
    def cpu_per_accepted_ms(self) -> float:
        n = self.accepted_total
        return 1e3 * self.coordinator_cpu_s / n if n else float("inf")

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.invariants.values())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        """Inverse of :meth:`as_dict` (derived figures are recomputed, not read)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["coordinator_cpu"] = {
            k: (int(v[0]), float(v[1])) for k, v in kw["coordinator_cpu"].items()
        }
        kw["staleness"] = {int(k): int(v) for k, v in kw["staleness"].items()}
        kw["invariants"] = {k: (bool(v[0]), str(v[1])) for k, v in kw["invariants"].items()}
        kw["timeline"] = [dict(row) for row in kw.get("timeline", [])]
        return cls(**kw)

    def as_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["invariants"] = {k: list(v) for k, v in self.invariants.items()}
        for name in (
            "cost_per_accepted",
            "cost_per_trained",
            "total_cost",
            "sim_hours_per_wall_minute",
            "sim_hours_per_cpu_minute",
            "cpu_per_accepted_ms",
            "coordinator_cpu_s",
        ):
            out[name] = getattr(self, name)  # fmt: skip
        return out


def collect(w: World, label: str, wall_s: float, cpu_s: float) -> RunResult:
    """Read the outcome of a finished :class:`World` and check the invariants."""
    st, ln = w.stats, w.learner
    g = w.scenario.learner.group_size
    rows = w.store.rollouts_after(0, 1 << 62)
    lo, hi = w.window
    t0 = w.clock() - w.env.now  # EPOCH
    per_lease: Counter[str] = Counter(r.lease_id for r in rows)
    per_prompt: Counter[int] = Counter(r.prompt_index for r in rows)
    accepted = sum(1 for r in rows if lo <= r.accepted_at - t0 <= hi)
    inv: dict[str, tuple[bool, str]] = {}

    phantom = [lid for lid in per_lease if lid not in st.acked]
    # a node banned for a gross failure has its unconsumed rollouts withdrawn (issue 34: a
    # ``withdrawn`` receipt names it): those acknowledged submissions lose their rows by design
    withdrawn_fps = {
        json.loads(bytes(body))["node"]
        for (body,) in w.store.query("SELECT body FROM receipts WHERE kind = 'withdrawn'")
    }
    unstored = [lid for lid in st.acked if lid not in per_lease]
    withdrawn = [lid for lid in unstored if fingerprint_of(st.acked_by[lid]) in withdrawn_fps]
    missing = [lid for lid in unstored if lid not in set(withdrawn)]
    inv["acked_durable"] = (
        not phantom and not missing,
        f"{len(st.acked)} acknowledged submissions, {len(per_lease)} with stored rows; "
        f"{len(missing)} acknowledged without rows, {len(phantom)} rows never acknowledged, "
        f"{len(withdrawn)} withdrawn from banned nodes",
    )
    over = [p for p, n in per_prompt.items() if n > g]
    triples = len({(r.lease_id, r.prompt_index, r.sample_index) for r in rows})
    inv["one_group_per_prompt"] = (
        not over and triples == len(rows),
        f"{len(per_prompt)} prompts accepted, {len(over)} with more than G={g} samples, "
        f"{len(rows) - triples} duplicate (lease, prompt, sample) rows",
    )
    pending = sum(len(v) for v in ln.pending.values())
    unfetched = sum(1 for r in rows if r.seq > ln.cursor)
    accounted = ln.trained_total + ln.dropped_stale + pending + unfetched
    inv["nothing_lost"] = (
        accounted == len(rows) and ln.doubled == 0,
        f"{len(rows)} stored = {ln.trained_total} trained + {ln.dropped_stale} dropped stale + "
        f"{pending} pending + {unfetched} not fetched yet ({accounted}); "
        f"{ln.doubled} fetched twice",
    )
    inv["no_bad_trained"] = (
        ln.bad_trained == 0,
        f"{ln.bad_trained} rollouts of {len(st.bad_leases)} cheating submissions trained on",
    )

    partial = sum(n - per_lease.get(lid, 0) for lid, n in st.submitted.items())
    lost = st.lost_in_flight + st.lost_refused + partial
    banned_keys = w.store.banned_keys(w.clock())
    window_s = max(1e-9, hi - lo)
    billed = _billed_node_seconds(w) / window_s
    calls = {op: (int(n), float(s)) for op, (n, s) in st.cpu.items()}
    return RunResult(
        scenario=w.scenario.name,
        policy=w.policy,
        label=label,
        nodes=len(w.pool),
        hours=w.hours,
        wall_s=wall_s,
        cpu_s=cpu_s,
        coordinator_cpu=calls,
        window_h=window_s / 3600.0,
        accepted=accepted,
        accepted_total=len(rows),
        trained=ln.trained,
        dropped_stale=ln.dropped_stale,
        swarm_cost=sum(n.cost for n in w.nodes),
        learner_cost=w.scenario.learner.price_per_hour * window_s / 3600.0,
        learner_idle=ln.idle_until(w.end_s) / window_s,
        staleness=dict(sorted(ln.staleness.items())),
        lost_to_churn=lost,
        refused_too_stale=st.refused_too_stale,
        generated=sum(st.submitted.values())
        + st.lost_in_flight
        + st.lost_refused
        + st.refused_too_stale,
        bad_trained=ln.bad_trained,
        bad_submissions=len(st.bad_leases),
        banned=sum(1 for n in w.nodes if n.cheat and n.key in banned_keys),
        cheaters=sum(1 for n in w.nodes if n.cheat),
        verdicts=dict(st.verdicts),
        spot_checked=st.spot_checked,
        verify_utilisation=st.verify_busy_s / (w.end_s * w.scenario.verification.workers),
        queue_wait_mean_s=st.queue_wait_s / max(1, sum(st.verdicts.values())),
        billed_nodes_mean=billed,
        steps=ln.steps,
        versions=len(w.diss.order),
        t_bcast_estimate=w.core.t_bcast_s,
        dissemination_s=sum(st.dissemination) / len(st.dissemination) if st.dissemination else 0.0,
        departures=dict(st.departures),
        stalls=st.stalls,
        plan=w.core.plan.explanation if w.core.plan else "",
        invariants=inv,
        tokens_per_rollout=w.scenario.model.completion_tokens_mean,
        token_check_s=w.token_check_s,
        coordinator_utilisation=w.cpu_core.busy_s / max(1e-9, w.end_s),
        coordinator_wait_mean_s=w.cpu_core.wait_s / max(1, w.cpu_core.calls),
        coordinator_backlog_max_s=w.cpu_core.max_backlog_s,
        timeline=timeline_rows(w),
        by_gpu=gpu_figures(w),
        verifier_cost=0.0
        if w.policy in TRUSTED
        else w.scenario.verification.workers
        * w.scenario.verification.price_per_hour
        * window_s
        / 3600.0,
    )


#: the phases of a lease whose seconds :class:`coordinator.sim.base.Stats` keeps by GPU kind
PHASES = ("generate_s", "download_s", "load_s", "transfer_s", "verdict_s")


def gpu_figures(w: World) -> dict[str, dict[str, float]]:
    """Per GPU kind, within the window: ``nodes`` (instances, churn replacements included),
    ``billed_h`` (paid node-hours), ``cost`` (USD), the paid seconds of its leases inside the
    window by phase (:data:`PHASES`: generating, waiting for a version's download, loading it,
    the round trips and the upload, waiting for the verdict; volunteers' are not booked) and
    its rollouts ``accepted``, ``trained`` and ``dropped`` (too stale)."""
    out: dict[str, dict[str, float]] = {}
    for n in w.nodes:
        row = out.setdefault(n.gpu.name, {"nodes": 0.0, "billed_h": 0.0, "cost": 0.0})
        row["nodes"] += 1
        row["cost"] += n.cost
        if n.price:
            row["billed_h"] += n.cost / n.price
    for kind, figures in w.stats.by_gpu.items():
        row = out.setdefault(kind, {"nodes": 0.0, "billed_h": 0.0, "cost": 0.0})
        row.update({k: float(v) for k, v in figures.items()})
    return dict(sorted(out.items()))


def timeline_rows(w: World) -> list[dict[str, float]]:
    """Per stretch of the run (``Stats.bucket_s``; the warm-up included, so its transient
    shows): accepted rollouts/s, learner steps and idle share, submissions and their mean wait
    for a verifier, samples refused as late (expired or fenced), the coordinator core's busy
    share as calibrated."""
    st, ln = w.stats, w.learner
    width = st.bucket_s
    n = max(1, math.ceil(w.end_s / width - 1e-9)) if width > 0 else 1
    rows = []
    for i in range(n):
        lo, hi = i * width, min(w.end_s, (i + 1) * width)
        span = max(1e-9, hi - lo)

        def get(name: str, i: int = i) -> float:
            row = st.timeline.get(name, [])
            return row[i] if i < len(row) else 0.0

        idle = get("learner_idle_s")
        if ln.waiting_since is not None:  # the wait in progress at the end is idle time too
            idle += max(0.0, hi - max(lo, ln.waiting_since))

        subs = get("submissions")
        rows.append(
            {
                "start_min": lo / 60.0,
                "end_min": hi / 60.0,
                "accepted_per_s": get("accepted") / span,
                "steps": get("steps"),
                "learner_idle": min(1.0, idle / span),
                "submissions": subs,
                "verify_wait_s": get("verify_wait_s") / subs if subs else 0.0,
                "refused_late": get("refused_late"),
                "coordinator_busy": get("coordinator_busy_s") / span,
            }
        )
    return rows


def _billed_node_seconds(w: World) -> float:
    """Node-seconds of paid-for time within the window (each priced node's bill / its price)."""
    total = 0.0
    for n in w.nodes:
        if n.price:
            total += n.cost / n.price * 3600.0
    return total
