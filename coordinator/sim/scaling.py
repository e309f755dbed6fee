"""How one coordinator scales: CPU per operation against node count, the saturation point of one
core, the disk's commit ceiling, and a profile that names the limiting operation.

Inputs are the ``cost_aware`` base runs of the scenarios (one per node count): for each coordinator
operation, its calls per simulated second and its measured CPU per call. A production coordinator
also verifies a signed envelope per node message (the simulation calls the core directly), charged
at bench/protocol.py's verify + decode rate. Node-driven operations (heartbeats, lease requests of
standby nodes, the upkeep tick) grow with the node count N; work-driven ones (a working node's
leases, submissions, the learner's fetches) grow with the accepted rollouts. One core saturates at

    U(N) = U_work + N · u_node = 1

with ``u_node`` and ``U_work`` taken from the largest run; also for a swarm where every node works
(its leases at its nominal rate), ``U(N) = N · (u_node + u_work)``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.sim.costs import Figures
from coordinator.sim.results import RunResult

#: Node messages that arrive as signed envelopes (one Ed25519 verify + decode each).
SIGNED = {"heartbeat", "lease", "submit", "release", "register"}
NODE_DRIVEN = {"heartbeat", "tick", "register", "release"}


@dataclass(frozen=True)
class OpLoad:
    op: str
    per_s: float  # calls per simulated second
    cpu_us: float  # measured CPU per call
    #: production's extra per call: signature + decode of a node message, and for a submission
    #: the per-token checks of real-length completions
    sig_us: float

    @property
    def load(self) -> float:
        """Fraction of one core."""
        return self.per_s * (self.cpu_us + self.sig_us) / 1e6


def loads(r: RunResult, figures: Figures) -> list[OpLoad]:
    sim_s = r.hours * 3600.0
    sig = 1e6 / figures.protocol_msgs_per_s
    n_sub = r.coordinator_cpu.get("submit", (0, 0.0))[0]
    # production's per-token checks on real completion lengths (the wire carried 4 tokens)
    tok_us = 1e6 * r.token_check_s * r.tokens_per_rollout * r.accepted_total / max(1, n_sub)
    return [
        OpLoad(
            op,
            n / sim_s,
            1e6 * s / max(1, n),
            (sig if op in SIGNED else 0.0) + (tok_us if op == "submit" else 0.0),
        )
        for op, (n, s) in sorted(r.coordinator_cpu.items())
    ]


def split(r: RunResult, figures: Figures) -> tuple[float, float, float]:
    """(U_work, u_node, lease answers that were Standby per second): node-driven load per node
    and work-driven load, as fractions of a core. Lease requests are split into standby polls
    (node-driven) and issued leases (work-driven) by the submission count."""
    per_op = {o.op: o for o in loads(r, figures)}
    submits = per_op["submit"].per_s if "submit" in per_op else 0.0
    lease = per_op.get("lease")
    polls = max(0.0, lease.per_s - submits) if lease else 0.0
    u_node = sum(o.load for o in per_op.values() if o.op in NODE_DRIVEN)
    u_work = sum(o.load for o in per_op.values() if o.op not in NODE_DRIVEN and o.op != "lease")
    if lease:
        per_call = (lease.cpu_us + lease.sig_us) / 1e6
        u_node += polls * per_call
        u_work += submits * per_call
    return u_work, u_node / max(1, r.nodes), polls


def fsync_ms(samples: int = 40) -> float:
    """Wall milliseconds of one durable single-row commit (WAL, ``synchronous=FULL``) on a temp
    file in the system temp directory: the disk's price of every coordinator transaction."""
    from coordinator.store import NodeRecord, Store

    with tempfile.TemporaryDirectory(prefix="swarm-fsync-") as tmp:
        store = Store(Path(tmp) / "probe.sqlite")
        try:
            store.upsert_node(NodeRecord(b"k" * 32, "f", None, 0.0, 0.0))
            t0 = time.perf_counter()
            for i in range(samples):
                store.update_node(b"k" * 32, last_seen=float(i))
            return 1e3 * (time.perf_counter() - t0) / samples
        finally:
            store.close()


def simpy_event_us(processes: int = 2000, events: int = 100_000) -> float:
    """CPU microseconds SimPy spends per timeout event of a process (the floor of any simulated
    message, whatever the coordinator costs)."""
    import simpy

    env = simpy.Environment()
    per = max(1, events // processes)

    def beat(env: simpy.Environment, phase: float) -> Generator[Any, Any, None]:
        yield env.timeout(phase)
        for _ in range(per):
            yield env.timeout(10.0)

    for i in range(processes):
        env.process(beat(env, i / processes))
    t0 = time.process_time()
    env.run()
    return 1e6 * (time.process_time() - t0) / (per * processes)


def profile_top(profile: cProfile.Profile, limit: int = 12) -> list[tuple[str, float, float]]:
    """(function, own seconds, share of the profiled time) of the heaviest functions."""
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    total = max(1e-9, sum(v[2] for v in stats.stats.values()))  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = path.split("/work/")[-1] if "/" in path else path
        for marker in ("site-packages/", "lib/python3"):
            if marker in short:
                short = short.split(marker)[-1]
        rows.append((f"{short}:{line}({name})", tt, tt / total))
    rows.sort(key=lambda r: -r[1])
    return rows[:limit]


def scaling_section(
    results: Sequence[RunResult],
    figures: Figures,
    *,
    fsync: float,
    event_us: float,
    profile: Sequence[tuple[str, float, float]] = (),
    profile_note: str = "",
    out_dir: Path | None,
    command: str,
) -> str:
    """The scaling section; its plot is written into ``out_dir`` (None: not drawn, as with
    ``--no-write``)."""
    runs = sorted(results, key=lambda r: r.nodes)
    lines = [
        "## How far one coordinator goes",
        "",
        f"`{command}`: the `cost_aware` base run of each scenario. CPU is the coordinator's own, "
        "measured around every call; 'with signatures' adds what production pays on top: one "
        "Ed25519 verify + decode per node message at bench/protocol.py's rate "
        f"({1e6 / figures.protocol_msgs_per_s:.0f} µs), and for each submission the per-token "
        "checks on real completion lengths (the simulation's wire carries 4 tokens per sample).",
        "",
        "| nodes | accepted rollouts/s | coordinator CPU per accepted rollout (ms) | core "
        "utilisation, core only | with signatures | heartbeats/s | standby polls/s | leases + "
        "submissions/s | sim-h per wall-min | sim-h per CPU-min |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        sim_s = r.hours * 3600.0
        ls = {o.op: o for o in loads(r, figures)}
        core_u = sum(o.per_s * o.cpu_us for o in ls.values()) / 1e6
        full_u = sum(o.load for o in ls.values())
        _, _, polls = split(r, figures)
        sub = ls["submit"].per_s if "submit" in ls else 0.0
        hb = ls["heartbeat"].per_s if "heartbeat" in ls else 0.0
        lines.append(
            f"| {r.nodes:,} | {r.accepted_total / sim_s:,.1f} | {r.cpu_per_accepted_ms:.3f} | "
            f"{core_u:.1%} | {full_u:.1%} | {hb:,.0f} | {polls:,.0f} | {2 * sub:,.1f} | "
            f"{r.sim_hours_per_wall_minute:.2f} | {r.sim_hours_per_cpu_minute:.2f} |"
        )
    big = runs[-1]
    u_work, u_node, _ = split(big, figures)
    ls = {o.op: o for o in loads(big, figures)}
    rate = big.accepted_total / (big.hours * 3600.0)
    per_rollout = u_work / rate if rate else 0.0  # core-seconds per accepted rollout
    n_sat_fixed = (1 - u_work) / u_node if u_node > 0 and u_work < 1 else float("nan")
    n_sat_all = 1 / (u_node + per_rollout) if u_node + per_rollout > 0 else float("nan")
    lines += [
        "",
        f"From the {big.nodes:,}-node run, with signatures: each node costs "
        f"{1e6 * u_node:,.1f} µs of coordinator CPU per second just by being there (heartbeats, "
        f"standby polls, its share of the tick), and the learner's demand costs {u_work:.1%} "
        f"of a core (leases, submissions, fetches: {1e3 * per_rollout:.2f} ms per rollout). "
        f"One core saturates at **N ≈ {n_sat_fixed:,.0f} nodes** at this demand; a node "
        f"delivering 1 rollout/s costs {1e6 * (u_node + per_rollout):,.0f} µs/s, so a swarm "
        f"where every node works at that rate saturates one core at **N ≈ {n_sat_all:,.0f} "
        "nodes**.",
        "",
        f"Disk: a durable commit (WAL, `synchronous=FULL`) costs {fsync:.1f} ms of wall time "
        f"here, i.e. at most {1e3 / fsync:,.0f} write transactions per second on this disk. "
        "Before this change every heartbeat and every lease request was one; at 10,000 nodes "
        "that is ~2,000 per second, far past the disk's ceiling. Liveness is now written once "
        "per tick, so the remaining commits are the work: a lease issued, a submission stored "
        f"({2 * (ls['submit'].per_s if 'submit' in ls else 0):,.0f}/s in this run).",
        "",
    ]
    sim_s = big.hours * 3600.0
    core_u = sum(o.per_s * o.cpu_us for o in ls.values()) / 1e6
    hb = ls["heartbeat"].per_s if "heartbeat" in ls else 0.0
    msgs = sum(o.per_s for o in ls.values())
    floor = msgs * event_us / 1e6  # SimPy alone, per simulated second
    lines += [
        "**Faster than real time?** The target was 60 simulated hours per wall-clock minute at "
        f"10,000 nodes (3,600× real time). Measured at {big.nodes:,} nodes: "
        f"{big.sim_hours_per_wall_minute:.3f} simulated hours per wall-clock minute on this "
        f"shared machine, {big.sim_hours_per_cpu_minute:.3f} per CPU-minute "
        f"({big.hours * 60 / max(1e-9, big.cpu_s / 60):.0f}× real time per CPU). It cannot reach "
        "3,600×, and the reason is arithmetic, not tuning: when the real code handles every "
        "message, simulating one second costs at least the coordinator's CPU for that second, "
        f"so the speed-up is at most 1 / U. Here U = {core_u:.1%} of a core at "
        f"{big.nodes:,} nodes (core only), a ceiling of {1 / max(1e-9, core_u):.0f}× "
        f"({1 / max(1e-9, core_u) / 60:.2f} simulated hours per CPU-minute). 3,600× would need "
        f"the coordinator to spend under {1e6 / 3600:.0f} µs of CPU per second on "
        f"{big.nodes:,} nodes — {1e9 / 3600 / big.nodes:.0f} ns per node-second — while one "
        f"heartbeat costs {ls['heartbeat'].cpu_us if 'heartbeat' in ls else 0:.0f} µs and "
        f"arrives {hb:,.0f} times per second. Even with the coordinator free, SimPy's own "
        f"{event_us:.1f} µs per event for the {msgs:,.0f} messages per simulated second caps the "
        f"speed at {1 / max(1e-12, floor):,.0f}× ({1 / max(1e-12, floor) / 60:.1f} simulated "
        "hours per minute). Meeting the target would mean not simulating per-node messages "
        "(aggregate liveness and standby polls), i.e. no longer letting the real code decide "
        "them. What the real code's cost does decide is production: the scaling table above.",
        "",
    ]
    if profile:
        lines += [
            f"Profile ({profile_note}); the heaviest functions by own time:",
            "",
            "| function | own s | share |",
            "|---|---:|---:|",
        ]
        lines += [f"| `{name}` | {tt:.2f} | {share:.1%} |" for name, tt, share in profile]
        lines.append("")
    fname = "simulation-scaling.png"
    if out_dir is not None:
        _plot(runs, figures, out_dir / fname)
        lines += [f"![{fname}]({fname})", ""]
    return "\n".join(lines)


def _plot(runs: Sequence[RunResult], figures: Figures, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({op for r in runs for op in r.coordinator_cpu})
    xs = [r.nodes for r in runs]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bottom = [0.0] * len(runs)
    for op in ops:
        ys = []
        for r in runs:
            o = next((x for x in loads(r, figures) if x.op == op), None)
            ys.append(100 * o.load if o else 0.0)
        ax.bar([str(x) for x in xs], ys, bottom=bottom, label=op)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_xlabel("nodes")
    ax.set_ylabel("% of one core (with signatures)")
    ax.set_title("coordinator load by operation")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
