"""The coordinator's request path: CPU per request by kind, and what one core carries.

Two parts, one after the other on a quiet machine:

1. **The real service.** A ``swarm coordinator launch`` subprocess (SQLite WAL
   ``synchronous=FULL``, activation off, re-scoring off: spot-check and newcomer rates 0, since
   the re-score is the verifiers' budget and not the request path), a trainer that publishes v1,
   and ``--nodes`` node identities over ``--peers`` libp2p peers in this process. With two or
   more CPUs the coordinator's process tree (Python, its ``p2pd``, hivemind's DHT process) is
   pinned to CPU 0 and this process with its daemons to the others. Three phases of
   ``--seconds`` each, ``--concurrency`` calls in flight, each call signed by its node and sent
   through :class:`node.client.CoordinatorClient`: heartbeats; lease requests (each lease kept);
   honest submissions of those leases (sampled with the ``hf`` backend between the phases,
   untimed: G = 4, <= 4 new tokens, 4 prompts). Figures: calls/s and the coordinator's CPU per
   call (its Python process; its ``p2pd`` apart), net of what it spends with no call at all
   (its 1 s ticks: status, upkeep; measured for ``--idle-seconds`` before the phases and
   counted once in the swarm's total). The whole part runs ``--repeats`` times, each
   with a fresh coordinator, and each kind reports its cheapest run (single runs on a shared
   2-core machine moved by up to 25 %).
2. **In process** (no transport): the same kinds through :class:`coordinator.node_rpc.NodeHandlers`
   on a temp SQLite file (bytes in, bytes out: decode, Ed25519, the handler, the commit,
   encode), best of ``--rounds`` rounds; and a submission of a real size: ``--group`` samples of
   ``--tokens`` tokens each (synthetic: random ids in the vocabulary, ``length`` finish,
   log-prob -1; re-scoring is off, so checks 3-6 and the record are what is timed).

A real-size submission on the service is costed as its in-process CPU plus what the transport
added to the small one (service minus in-process). **The swarm** of ``--swarm-nodes`` nodes
heartbeating at the interval the coordinator hands out (10 s, the default
``heartbeat_interval_s``, growing past ``heartbeat_rate_max`` x 10 s nodes; also priced at a
fixed 10 s) and delivering ``--rollouts-per-s`` rollouts in leases of one prompt x ``--group``
samples (the 10,000-node simulation's figures, docs/simulation.md) then costs sum(rate x CPU per
call) of one core; the nodes one core carries follow (every per-node work rate fixed, the node
count scaled).

Usage: python bench/service_rate.py [--nodes 200] [--peers 4] [--seconds 20] [--concurrency 32]
       [--rounds 5] [--repeats 2] [--group 8] [--tokens 2048] [--swarm-nodes 10000]
       [--rollouts-per-s 512] [--local-only] [--no-write]
Writes its section of docs/benchmarks.md (between the bench:service-rate markers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _cpu import tree_cpu  # noqa: E402
from _report import write_section  # noqa: E402
from swarm_harness import (  # noqa: E402
    TestNode,
    Trainer,
    coordinator_toml,
    honest_submission,
    launch_coordinator,
)

from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.liveness import HeartbeatSchedule  # noqa: E402
from coordinator.node_rpc import NodeHandlers  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.envelope import seal  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.messages import (  # noqa: E402
    Ack,
    Heartbeat,
    Lease,
    LeaseRequest,
    Reject,
    RolloutSubmission,
    Timings,
)
from swarm.dht import SwarmPeer  # noqa: E402
from swarm.testing import start_loopback_peer  # noqa: E402
from swarm.transport import P2PTransport  # noqa: E402

SECTION = "service-rate"
#: the production default (coordinator/config.py); the harness's config beats every 2 s
HEARTBEAT_INTERVAL_S = 10.0
MAX_PROMPTS = 4


@dataclass
class Phase:
    kind: str
    calls: int
    wall_s: float
    cpu: dict[str, float]  # the coordinator's process tree, by kind (bench/_cpu.py)
    #: its CPU seconds per second with no call at all (ticks: status, upkeep), by kind
    idle: dict[str, float] = field(default_factory=lambda: {"python": 0.0, "p2pd": 0.0})

    def _net_ms(self, kind: str) -> float:
        """CPU ms per call of ``kind`` (python, p2pd) beyond what the process spends idle."""
        spent = self.cpu[kind] - self.idle.get(kind, 0.0) * self.wall_s
        return 1000.0 * max(0.0, spent) / max(1, self.calls)

    @property
    def per_call_ms(self) -> float:
        return self._net_ms("python")

    @property
    def p2pd_per_call_ms(self) -> float:
        return self._net_ms("p2pd")

    @property
    def rate(self) -> float:
        return self.calls / self.wall_s

    @property
    def core_share(self) -> float:
        return self.cpu["python"] / self.wall_s


def tasks_of(pid: int) -> list[int]:
    """``pid``, its threads and every descendant's (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{p}/task"):
                out.append(int(task))
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
    return out


def pin(pid: int, cpus: set[int]) -> None:
    for tid in tasks_of(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


async def run_phase(
    kind: str,
    coord_pid: int,
    seconds: float,
    concurrency: int,
    call: Callable[[int, int], Awaitable[bool]],
) -> Phase:
    """``concurrency`` loops; loop ``j`` calls ``call(j, i)`` (``i`` counts its calls) until
    ``seconds`` are up or a call returns False (nothing left to send)."""
    answered = 0
    end = time.monotonic() + seconds

    async def loop(j: int) -> None:
        nonlocal answered
        for i in itertools.count():
            if time.monotonic() >= end or not await call(j, i):
                return
            answered += 1

    cpu0, t0 = tree_cpu(coord_pid), time.monotonic()
    await asyncio.gather(*(loop(j) for j in range(concurrency)))
    wall = time.monotonic() - t0
    cpu1 = tree_cpu(coord_pid)
    return Phase(kind, answered, wall, {k: cpu1[k] - cpu0[k] for k in cpu1})


async def measure(args: argparse.Namespace) -> tuple[list[Phase], dict[str, object]]:
    tmp = Path(tempfile.mkdtemp(prefix="service-rate-"))
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp,
        trainer_id,
        top={"heartbeat_interval_s": HEARTBEAT_INTERVAL_S},
        intake={"spot_check_fraction": 0.0, "new_node_check_rate": 0.0},
        leases={
            "min_deadline_s": 3600.0,
            "max_prompts_per_lease": MAX_PROMPTS,
            "max_active_per_node": 100_000,
        },
        capacity={"activation": False},
    )
    coord = await launch_coordinator(tmp, config)
    trainer = Trainer(coord, trainer_id, tmp)
    peers: list[SwarmPeer] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="service-rate-generate")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    try:
        await trainer.start()
        await trainer.publish(1)
        peers = list(
            await asyncio.gather(*(start_loopback_peer([coord.maddr]) for _ in range(args.peers)))
        )
        transports = [P2PTransport(p.p2p) for p in peers]
        nodes = [TestNode(transports[i % len(peers)], coord.peer_id) for i in range(args.nodes)]
        # loop j of a phase calls for the nodes of peer j % peers only (a peer may have at most
        # 16 calls open at the coordinator: swarm/transport.py)
        by_peer = [nodes[p :: len(peers)] for p in range(len(peers))]
        per_peer = int(-(-args.concurrency // len(peers)))
        if per_peer > 12:
            raise SystemExit(f"--concurrency {args.concurrency}: over 12 calls per peer; add peers")
        for group in zip(*by_peer, strict=False):
            await asyncio.gather(*(n.register() for n in group))

        def node_for(j: int, i: int) -> int:
            """The index in ``nodes`` of loop ``j``'s ``i``-th call's node."""
            p, lane = j % len(peers), j // len(peers)
            mine = len(by_peer[p])
            return p + len(peers) * ((lane + i * per_peer) % mine)

        pid = coord.proc.popen.pid
        if pinned:
            pin(pid, {cpus[0]})
            pin(os.getpid(), set(cpus[1:]))
        seqs = [0] * len(nodes)

        async def heartbeat(j: int, i: int) -> bool:
            k = node_for(j, i)
            seqs[k] += 1
            node = nodes[k]
            hb = Heartbeat(
                peer_id=node.transport.peer_id, seq=seqs[k], policy_version=1,
                active_leases=[], tokens_per_s=None,
            )  # fmt: skip
            await node.client.heartbeat(hb)
            return True

        leases: list[tuple[int, Lease]] = []

        async def lease(j: int, i: int) -> bool:
            k = node_for(j, i)
            node = nodes[k]
            req = LeaseRequest(
                peer_id=node.transport.peer_id, policy_version=1, max_prompts=MAX_PROMPTS
            )
            got = await node.client.lease(req)
            if not isinstance(got, Lease):
                raise SystemExit(f"lease phase: a lease request was answered {got}")
            leases.append((k, got))
            return True

        # warm up every kind outside the timed phases (first SQLite pages, first answers)
        for k in range(len(nodes)):
            await heartbeat(k % len(peers), k // len(peers))
        await lease(0, 0)
        leases.clear()
        cpu0, t0 = tree_cpu(pid), time.monotonic()
        await asyncio.sleep(args.idle_seconds)  # no calls: what the ticks cost by themselves
        cpu1, idle_s = tree_cpu(pid), time.monotonic() - t0
        idle = {k: (cpu1[k] - cpu0[k]) / idle_s for k in cpu1}
        phases = [await run_phase("heartbeat", pid, args.seconds, args.concurrency, heartbeat)]
        if pinned:  # the daemons' helper threads started since
            pin(pid, {cpus[0]})
        phases.append(await run_phase("lease", pid, args.seconds, args.concurrency, lease))
        todo = leases[: args.max_submits]
        loop = asyncio.get_running_loop()
        subs: list[tuple[int, RolloutSubmission]] = []
        for k, got in todo:
            subs.append((k, await loop.run_in_executor(pool, honest_submission, got)))
        queues = [iter([ks for ks in subs if ks[0] % len(peers) == p]) for p in range(len(peers))]

        async def submit(j: int, _: int) -> bool:
            nxt = next(queues[j % len(peers)], None)
            if nxt is None:
                return False
            k, sub = nxt
            verdict = await nodes[k].client.submit(sub)
            if not isinstance(verdict, Ack):
                raise SystemExit(f"submit phase: an honest submission was answered {verdict}")
            return True

        phases.append(await run_phase("submit", pid, args.seconds, args.concurrency, submit))
        for phase in phases:
            phase.idle = idle
        alive = coord.proc.popen.poll() is None
        info = {
            "idle": idle,
            "pinned": pinned,
            "alive": alive,
            "loadavg": os.getloadavg(),
            "samples_per_submit": (
                sum(len(g.samples) for _, s in subs for g in s.groups) / len(subs) if subs else 0
            ),
        }
        return phases, info
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for peer in peers:
            with contextlib.suppress(Exception):
                await peer.stop()
        try:
            await trainer.stop()
        finally:
            coord.proc.stop()
            if pinned:  # every CPU again: the next run pins afresh (its coordinator inherits this)
                pin(os.getpid(), set(cpus))


class _HeldVersions:
    """The version waits of the in-process handlers: v1 is held from the start."""

    async def until_leasable(self, wait_s: float) -> None:
        return None

    async def wait_held(self, version: int, timeout: float) -> None:
        return None


async def in_process(args: argparse.Namespace) -> dict[str, float]:
    """CPU seconds per call through :class:`NodeHandlers` (no transport), best of rounds."""
    import random

    import torch
    from intake import make_bench  # bench/intake.py: a core on a temp SQLite file

    from node.backends.base import SampleOut
    from node.rollouts import build_submission, lease_requests
    from policy.model import ModelSpec, build_model

    torch.set_num_threads(1)
    model = build_model(ModelSpec(), seed=1)
    tmp = Path(tempfile.mkdtemp(prefix="service-rate-local-"))
    small = make_bench("small", tmp, 0.0, model, prompts=MAX_PROMPTS, g=4, max_new=4)
    big = make_bench("big", tmp, 0.0, model, prompts=1, g=args.group, max_new=args.tokens)
    rng = random.Random(0)

    desk = big.core.desk
    stops = set(desk.stop_token_ids) | {desk.eos_token_id}
    ok = [t for t in range(desk.vocab_size) if t not in stops]  # any id a sample may carry

    def synthetic(lease: Lease) -> RolloutSubmission:
        n = lease.sampling.max_new_tokens
        requests = lease_requests(lease)
        outs = [
            [SampleOut([rng.choice(ok) for _ in range(n)], [-1.0] * n, "length")
             for _ in range(r.n)]
            for r in requests
        ]  # fmt: skip
        return build_submission(
            lease, requests, outs, stops, backend="hf", dtype="float32",
            timings=Timings(started_at=0.0, finished_at=1.0, generate_s=1.0),
        )  # fmt: skip

    def sealed(node: Identity, msg: Any) -> bytes:
        return encode(seal(node, msg, now=time.time()))

    best: dict[str, float] = {}
    seq = itertools.count(1)
    for bench, kinds in ((small, ("heartbeat", "lease", "submit")), (big, ("submit_long",))):
        handlers = NodeHandlers(bench.core, versions=_HeldVersions(), on_rollouts=lambda: None)
        if bench is small:
            await bench.run(bench.prepare(2))  # warm up: SQLite pages, first answers
        for _ in range(args.rounds):
            nodes = bench.nodes
            n = 20 if bench is big else 200
            batches: dict[str, tuple[Callable[[str, bytes], Awaitable[bytes]], list[bytes]]] = {}
            if "heartbeat" in kinds:
                beats = [
                    sealed(nodes[i % len(nodes)], Heartbeat(
                        peer_id="bench", seq=next(seq), policy_version=1, active_leases=[],
                        tokens_per_s=None,
                    ))
                    for i in range(n)
                ]  # fmt: skip
                asks = [
                    sealed(nodes[i % len(nodes)], LeaseRequest(
                        peer_id="bench", policy_version=1, max_prompts=MAX_PROMPTS
                    ))
                    for i in range(n)
                ]  # fmt: skip
                batches["heartbeat"] = (handlers.on_heartbeat, beats)
                batches["lease"] = (handlers.on_lease, asks)
                batches["submit"] = (handlers.on_submit, bench.prepare(n))
            else:
                leased = bench.lease(n)
                subs = [sealed(node, synthetic(lease)) for node, lease in leased]
                batches["submit_long"] = (handlers.on_submit, subs)
            for kind, (handler, batch) in batches.items():
                cpu0 = time.process_time()
                for raw in batch:
                    answer = decode(await handler("bench", raw))
                    if isinstance(answer, Reject):
                        raise SystemExit(f"in process: a {kind} was refused: {answer}")
                per_call = (time.process_time() - cpu0) / len(batch)
                best[kind] = min(best.get(kind, math.inf), per_call)
        bench.core.close()
    return best


def swarm_load(
    phases: list[Phase], local: dict[str, float], args: argparse.Namespace
) -> dict[str, float]:
    """The swarm's requests/s and the coordinator's CPU seconds per second for them, with the
    heartbeat interval the coordinator hands out (it grows past ``heartbeat_rate_max`` x 10 s
    nodes: coordinator/liveness.py) and, for comparison, at a fixed 10 s."""
    service = {p.kind: p.per_call_ms / 1000 for p in phases}
    p2pd = {p.kind: p.p2pd_per_call_ms / 1000 for p in phases}
    transport = max(0.0, service["submit"] - local["submit"])
    long_submit = local["submit_long"] + transport
    idle = phases[0].idle
    rate_max = CoordinatorConfig().heartbeat_rate_max
    schedule = HeartbeatSchedule(HEARTBEAT_INTERVAL_S, 3, rate_max)

    def at(nodes: float, interval: Callable[[int], float]) -> tuple[float, float, float, float]:
        """(heartbeats/s, leases/s, Python CPU, p2pd CPU) of ``nodes`` nodes, every per-node
        work rate as in the swarm of ``--swarm-nodes``."""
        beats = nodes / interval(int(nodes))
        leases = args.rollouts_per_s * nodes / args.swarm_nodes / args.group
        cpu = idle["python"] + beats * service["heartbeat"]
        cpu += leases * (service["lease"] + long_submit)
        daemon = idle["p2pd"] + beats * p2pd["heartbeat"]
        daemon += leases * (p2pd["lease"] + p2pd["submit"])
        return beats, leases, cpu, daemon

    def per_core(interval: Callable[[int], float]) -> float:
        """The most nodes whose Python CPU fits one core (bisection; the CPU grows with N)."""
        lo, hi = 1.0, 1e7
        while hi - lo > 1.0:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if at(mid, interval)[2] <= 1.0 else (lo, mid)
        return lo

    def fixed(_n: int) -> float:
        return HEARTBEAT_INTERVAL_S

    beats, leases, cpu, daemon = at(args.swarm_nodes, schedule.target_s)
    beats_fixed, _, cpu_fixed, daemon_fixed = at(args.swarm_nodes, fixed)
    return {
        "rate_max": rate_max or math.inf,
        "interval": schedule.target_s(args.swarm_nodes),
        "heartbeats": beats,
        "leases": leases,
        "requests": beats + 2 * leases,
        "long_submit": long_submit,
        "cpu": cpu,
        "p2pd": daemon,
        "nodes_per_core": per_core(schedule.target_s),
        "heartbeats_fixed": beats_fixed,
        "requests_fixed": beats_fixed + 2 * leases,
        "cpu_fixed": cpu_fixed,
        "p2pd_fixed": daemon_fixed,
        "nodes_per_core_fixed": per_core(fixed),
    }


def git_rev() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True
        ).strip()
    return "?"


def report(
    phases: list[Phase], local: dict[str, float], info: dict[str, object],
    args: argparse.Namespace,
) -> str:  # fmt: skip
    m = swarm_load(phases, local, args)
    idle = phases[0].idle
    load = info["loadavg"]
    assert isinstance(load, tuple)
    where = (
        "the coordinator's process tree pinned to one CPU, this process and its daemons to the "
        "other"
        if info["pinned"]
        else "one CPU shared by everything (not pinned)"
    )
    kinds = {"heartbeat": "heartbeat", "lease": "lease", "submit": "submit (small)"}
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "## The coordinator's request path: CPU per request, what one core carries "
        "(`bench/service_rate.py`)",
        "",
        f"Service: a `swarm coordinator launch` subprocess (SQLite WAL `synchronous=FULL`, "
        f"activation off, re-scoring off), {args.nodes} nodes (own Ed25519 identities) on "
        f"{args.peers} libp2p peers in the bench process, {args.concurrency} calls in flight, "
        f"{where}; each call signed by its node and sent through `node.client.CoordinatorClient`; "
        f"per kind the cheapest of {args.repeats} service runs; "
        f"small submissions: honest, {info['samples_per_submit']:.0f} samples of <= 4 tokens; "
        f"CPU per call is beyond the coordinator's CPU with no call at all "
        f"({1000 * idle['python']:.0f} ms/s, its `p2pd` {1000 * idle['p2pd']:.0f} ms/s: the "
        "ticks, counted once in the swarm's total). "
        f"In process: `NodeHandlers` on a temp SQLite file, bytes in and out, best of "
        f"{args.rounds} rounds; the real-size submission is {args.group} samples x {args.tokens} "
        f"tokens (synthetic, checks 3-6 and the record). CPU: the coordinator's Python process. "
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} / {load[1]:.2f} at the end, Python "
        f"{platform.python_version()}, commit {git_rev()}.",
        "",
        "| request | service calls/s | service CPU ms / call | its core busy | p2pd CPU ms / call "
        "| in process CPU ms / call |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        lines.append(
            f"| {kinds[p.kind]} | {p.rate:.0f} | {p.per_call_ms:.2f} | {100 * p.core_share:.0f}% | "
            f"{p.p2pd_per_call_ms:.2f} | {1000 * local[p.kind]:.2f} |"
        )
    lines += [
        f"| submit ({args.group} x {args.tokens} tokens) | - | {1000 * m['long_submit']:.2f} "
        f"(estimated) | - | - | {1000 * local['submit_long']:.2f} |",
        "",
        f"The swarm: {args.swarm_nodes:,} nodes delivering {args.rollouts_per_s:g} rollouts/s "
        f"in leases of {args.group} samples x {args.tokens} tokens, heartbeating at the "
        f"interval the coordinator hands out ({m['interval']:g} s: at most "
        f"{m['rate_max']:g} heartbeats/s, `heartbeat_rate_max`): {m['requests']:,.0f} "
        f"requests/s ({m['heartbeats']:,.0f} heartbeats, {m['leases']:,.0f} leases and as many "
        f"submissions), **{m['cpu']:.2f} of one core** for the coordinator's Python process "
        f"and **{m['p2pd']:.2f}** for its `p2pd`, {m['cpu'] + m['p2pd']:.2f} together; "
        f"**one core carries {m['nodes_per_core']:,.0f} such nodes** (Python process; every "
        f"per-node work rate fixed, the node count scaled). With every node beating every "
        f"{HEARTBEAT_INTERVAL_S:g} s (before the cap): {m['requests_fixed']:,.0f} requests/s "
        f"({m['heartbeats_fixed']:,.0f} heartbeats), {m['cpu_fixed']:.2f} of a core plus "
        f"{m['p2pd_fixed']:.2f} for `p2pd`, {m['nodes_per_core_fixed']:,.0f} nodes per core.",
        "",
        f"Command: `python bench/service_rate.py --nodes {args.nodes} --peers {args.peers} "
        f"--seconds {args.seconds:g} --concurrency {args.concurrency} --rounds {args.rounds} "
        f"--repeats {args.repeats} "
        f"--group {args.group} --tokens {args.tokens} --swarm-nodes {args.swarm_nodes} "
        f"--rollouts-per-s {args.rollouts_per_s:g}`",
        f"<!-- bench:{SECTION}:end -->",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200, help="node identities (service)")
    parser.add_argument("--peers", type=int, default=4, help="libp2p peers carrying them")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    parser.add_argument(
        "--max-submits", type=int, default=3000, help="leases sampled for the submit phase"
    )
    parser.add_argument("--rounds", type=int, default=5, help="in-process rounds (best kept)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="service runs (the cheapest per kind kept)"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=10.0, help="service: the no-call measurement"
    )
    parser.add_argument("--group", type=int, default=8, help="samples of a real-size lease")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each such sample")
    parser.add_argument("--swarm-nodes", type=int, default=10_000, help="nodes of the swarm")
    parser.add_argument(
        "--rollouts-per-s", type=float, default=512.0, help="rollouts/s the swarm delivers"
    )
    parser.add_argument(
        "--local-only", action="store_true", help="the in-process part only (prints, no write)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks.md")
    args = parser.parse_args()
    if min(args.nodes, args.peers, args.concurrency, args.rounds, args.repeats, args.group,
           args.tokens) < 1:  # fmt: skip
        parser.error(
            "--nodes, --peers, --concurrency, --rounds, --repeats, --group, --tokens must be >= 1"
        )
    if args.seconds <= 0 or args.rollouts_per_s <= 0 or args.swarm_nodes < 1:
        parser.error("--seconds, --rollouts-per-s and --swarm-nodes must be positive")
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    local = asyncio.run(in_process(args))
    print("in process, CPU ms per call:", {k: round(1000 * v, 3) for k, v in local.items()})
    if args.local_only:
        return
    runs = [asyncio.run(measure(args)) for _ in range(args.repeats)]
    # per kind, the run whose coordinator spent least per call (the machine is shared: a run
    # taken while it was slow only adds noise; every run's figures are printed)
    for i, (ph, _) in enumerate(runs):
        print(f"service run {i + 1}:", {p.kind: round(p.per_call_ms, 3) for p in ph})
    phases = [
        min((ph[k] for ph, _ in runs), key=lambda p: p.per_call_ms) for k in range(len(runs[0][0]))
    ]
    info = runs[-1][1]
    info["alive"] = all(bool(i["alive"]) for _, i in runs)
    text = report(phases, local, info, args)
    print(text)
    if not info["alive"]:
        raise SystemExit("the coordinator died during the run")
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
