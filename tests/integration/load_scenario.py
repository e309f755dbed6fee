"""Load: many simulated nodes against one real coordinator process (``swarm coordinator launch``).

Shared by ``tests/integration/test_load.py`` (10 s, asserts the invariants) and
``bench/load.py`` (longer, reports the figures). Everything runs on 127.0.0.1:

* a coordinator subprocess (spot check on a small keyed-random fraction of leases, activation off)
  and the harness :class:`~swarm_harness.Trainer`, which publishes v1 and reads the feed;
* ``peers`` libp2p peers in this process (one ``p2pd`` each), carrying ``nodes`` simulated nodes
  between them, round robin; each node has its own Ed25519 identity and speaks the real protocol
  through :class:`node.client.CoordinatorClient` (register, lease, submit);
* every node loops until the wall time is up: lease -> honest results of *that* lease
  (:func:`swarm_harness.honest_submission`: the ``hf`` backend on exactly the published weights,
  seeded by the lease, run on one worker thread so the event loop stays responsive) -> submit.
  Nodes with ``i % resend_every == 1`` re-send every verdict-bearing submission once more
  after its answer (a duplicate); nodes with ``i % pair_every == 7`` send each submission twice
  at the same time. A call the coordinator does not answer (busy, timeout) is re-sent with
  back-off; the latency of a submission is from its first send to its verdict.

:func:`check` lists every broken invariant (lost or duplicated rollouts, counts that disagree, a
prompt accepted in two groups, a re-send answered differently, a dead coordinator, errors in its
log); :func:`summary` computes the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from swarm_harness import (
    CoordinatorProc,
    TestNode,
    Trainer,
    coordinator_toml,
    honest_submission,
    launch_coordinator,
    until,
)

from node.client import CoordinatorUnavailable
from protocol.identity import Identity
from protocol.messages import (
    AcceptedRollout,
    Ack,
    LeaseRequest,
    Reject,
    RolloutSubmission,
    Standby,
)
from swarm.dht import SwarmPeer
from swarm.testing import start_loopback_peer
from swarm.transport import P2PTransport

Kind = Literal["first", "pair", "resend"]
Key = tuple[str, str, int]  # (lease_id, prompt_id, sample_index)

#: Calls in a row the coordinator leaves unanswered (busy, timeout, lost stream) before a node
#: gives up on a submission (or counts an error, for leases).
MAX_TRIES = 6
#: Lines in the coordinator's log that mean something went wrong under load.
LOG_ALARMS = ("database is locked", "Traceback", "handler failed", "upkeep failed")


@dataclass(frozen=True)
class LoadSpec:
    nodes: int = 50
    peers: int = 5
    seconds: float = 20.0
    spot_check_fraction: float = 0.05
    max_prompts: int = 4
    #: node i re-sends each answered submission once when i % resend_every == 1 (0: never)
    resend_every: int = 5
    #: node i sends each submission twice concurrently when i % pair_every == 7 (0: never)
    pair_every: int = 10
    #: lease deadline floor: long enough that an honest result is never late under load
    min_deadline_s: float = 300.0


@dataclass
class Submitted:
    """One submission call and its outcome."""

    node: int
    lease_id: str
    keys: tuple[Key, ...]  # every sample the submission carries
    kind: Kind
    verdict: Ack | Reject
    latency_s: float  # first send -> verdict, re-sends of an unanswered call included
    tries: int  # sends (1 = answered at once)
    answered_at: float  # monotonic


@dataclass
class LoadResult:
    spec: LoadSpec
    records: list[Submitted] = field(default_factory=list)
    lease_latencies: list[float] = field(default_factory=list)
    standby: int = 0
    errors: list[str] = field(default_factory=list)  # calls that never got an answer
    retries: list[str] = field(default_factory=list)  # calls re-sent for want of an answer
    started: float = 0.0  # monotonic, start of the load window
    wall_s: float = 0.0  # start of the window -> last verdict
    feed: list[AcceptedRollout] = field(default_factory=list)
    status: dict[str, object] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # swarm_intake_* from /metrics
    alive: bool = False
    log_alarms: list[str] = field(default_factory=list)
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    coordinator_cpu_s: float = 0.0  # CPU time of the coordinator process over the window
    client_cpu_s: float = 0.0  # CPU time of this process (nodes, peers' clients) over the window


# --- the simulated nodes -------------------------------------------------------------------------
async def _submit(node: TestNode, sub: RolloutSubmission, result: LoadResult) -> Submitted | None:
    t0 = time.monotonic()
    for tries in range(1, MAX_TRIES + 1):
        try:
            verdict = await node.submit(sub)
        except CoordinatorUnavailable as exc:
            result.retries.append(f"{time.monotonic() - result.started:.2f}s submit: {exc}")
            if tries == MAX_TRIES:
                result.errors.append(
                    f"submit {sub.lease_id}: no verdict after {tries} tries: {exc}"
                )
                return None
            await asyncio.sleep(min(0.1 * 2**tries, 2.0))
            continue
        now = time.monotonic()
        keys = tuple(
            (sub.lease_id, g.prompt_id, j) for g in sub.groups for j in range(len(g.samples))
        )
        return Submitted(-1, sub.lease_id, keys, "first", verdict, now - t0, tries, now)
    raise AssertionError("unreachable")


async def _node_loop(
    i: int, node: TestNode, spec: LoadSpec, end: float, pool: ThreadPoolExecutor, out: LoadResult
) -> None:
    loop = asyncio.get_running_loop()
    pair = spec.pair_every > 0 and i % spec.pair_every == 7 % spec.pair_every
    resend = spec.resend_every > 0 and i % spec.resend_every == 1 % spec.resend_every
    request = LeaseRequest(
        peer_id=node.transport.peer_id, policy_version=None, max_prompts=spec.max_prompts
    )
    failures = 0  # lease calls in a row without an answer
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            got = await node.client.lease(request)
        except CoordinatorUnavailable as exc:
            failures += 1
            line = f"{time.monotonic() - out.started:.2f}s node {i} lease: {exc}"
            (out.errors if failures >= MAX_TRIES else out.retries).append(line)
            await asyncio.sleep(min(0.1 * 2**failures, 2.0))
            continue
        failures = 0
        out.lease_latencies.append(time.monotonic() - t0)
        if isinstance(got, Standby):
            out.standby += 1
            await asyncio.sleep(min(got.retry_after_s, 1.0))
            continue
        sub = await loop.run_in_executor(pool, honest_submission, got)
        sends = 2 if pair else 1
        answers = await asyncio.gather(*(_submit(node, sub, out) for _ in range(sends)))
        for answer in answers:
            if answer is not None:
                answer.node, answer.kind = i, "pair" if pair else "first"
                out.records.append(answer)
        if resend and answers[0] is not None:
            again = await _submit(node, sub, out)
            if again is not None:
                again.node, again.kind = i, "resend"
                out.records.append(again)


# --- the run -------------------------------------------------------------------------------------
async def run_load(tmp: Path, spec: LoadSpec, log: bool = False) -> LoadResult:
    """Start a coordinator, a trainer and the nodes; run the load; collect the outcome."""
    say = print if log else (lambda *_a, **_k: None)
    trainer_id = Identity.generate()
    config = coordinator_toml(
        tmp,
        trainer_id,
        intake={"spot_check_fraction": spec.spot_check_fraction},
        leases={"min_deadline_s": spec.min_deadline_s},
        capacity={"activation": False},
    )
    coord = await launch_coordinator(tmp, config)
    trainer = Trainer(coord, trainer_id, tmp)
    peers: list[SwarmPeer] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load-generate")
    out = LoadResult(spec)
    try:
        await trainer.start()
        await trainer.publish(1)
        if spec.spot_check_fraction > 0:  # ready to re-score before the first drawn lease

            async def loaded() -> bool:
                held = (await trainer.status()).get("versions_loaded", [])
                return isinstance(held, list) and 1 in held

            await until(loaded, "the coordinator to load v1 for spot checks", 60, coord.proc)
        say(f"coordinator up, v1 held; starting {spec.peers} peers")
        started = await asyncio.gather(
            *(start_loopback_peer([coord.maddr]) for _ in range(spec.peers)),
            return_exceptions=True,
        )
        peers = [p for p in started if isinstance(p, SwarmPeer)]
        failed = [p for p in started if not isinstance(p, SwarmPeer)]
        if failed:
            raise RuntimeError(f"could not start a loopback peer: {failed[0]!r}")
        transports = [P2PTransport(p.p2p) for p in peers]
        nodes = [TestNode(transports[i % len(peers)], coord.peer_id) for i in range(spec.nodes)]
        await asyncio.gather(*(n.register() for n in nodes))
        # Warm up outside the window (model build, first generation): one honest lease.
        warm = await nodes[0].lease(spec.max_prompts)
        sub = await asyncio.get_running_loop().run_in_executor(pool, honest_submission, warm)
        first = await _submit(nodes[0], sub, out)
        assert first is not None and isinstance(first.verdict, Ack), first
        first.node = 0
        out.records.append(first)
        say(f"{spec.nodes} nodes registered; load for {spec.seconds:g} s")

        cpu0, own0 = _cpu_s(coord.proc.popen.pid), time.process_time()
        out.started = time.monotonic()
        end = out.started + spec.seconds
        await asyncio.gather(*(_node_loop(i, n, spec, end, pool, out) for i, n in enumerate(nodes)))
        out.wall_s = max(r.answered_at for r in out.records) - out.started
        out.coordinator_cpu_s = _cpu_s(coord.proc.popen.pid) - cpu0
        out.client_cpu_s = time.process_time() - own0
        out.loadavg = os.getloadavg()
        out.alive = coord.proc.popen.poll() is None
        out.status = await trainer.status()
        out.feed = await fetch_settled(trainer, coord)
        out.metrics = read_metrics(coord)
        out.alive = out.alive and coord.proc.popen.poll() is None
        text = coord.proc.text()
        out.log_alarms = [ln for ln in text.splitlines() if any(a in ln for a in LOG_ALARMS)]
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for peer in peers:
            with contextlib.suppress(Exception):
                await peer.stop()
        try:
            await trainer.stop()
        finally:
            coord.proc.stop()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


async def fetch_all(trainer: Trainer) -> list[AcceptedRollout]:
    """The whole accepted-rollout feed, page by page."""
    rows: list[AcceptedRollout] = []
    while True:
        page = await trainer.fetch(rows[-1].seq if rows else 0)
        if not page:
            return rows
        rows += page


async def fetch_settled(
    trainer: Trainer, coord: CoordinatorProc, wait_s: float = 120.0
) -> list[AcceptedRollout]:
    """The whole feed once no acknowledged lease waits for its re-score (``held_rollouts``
    empty): those re-scores run after their acks, their rows held until then (issue 34)."""
    import sqlite3

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        db = sqlite3.connect(f"file:{coord.state / 'state.sqlite'}?mode=ro", uri=True)
        try:
            held = db.execute("SELECT COUNT(*) FROM held_rollouts").fetchone()[0]
        except sqlite3.OperationalError:  # no such table: nothing was ever held
            held = 0
        finally:
            db.close()
        if held == 0:
            break
        await asyncio.sleep(0.1)
    return await fetch_all(trainer)  # (past the wait: the invariants report what is missing)


def read_metrics(coord: CoordinatorProc) -> dict[str, float]:
    """The coordinator's ``swarm_intake_*`` samples from its /metrics endpoint."""
    info = json.loads((coord.state / "coordinator.json").read_text())
    with urllib.request.urlopen(info["http_url"].rstrip("/") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("swarm_intake_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# --- invariants and figures ----------------------------------------------------------------------
def prompt_index(prompt_id: str) -> int:
    return int(prompt_id.rsplit(":", 1)[1])


def check(result: LoadResult) -> list[str]:
    """Every broken invariant, one line each (empty: all hold)."""
    problems: list[str] = []
    feed = result.feed
    feed_keys = [(r.lease_id, r.prompt_id, r.sample_index) for r in feed]
    # One verdict per lease from its first sends (both of a concurrent pair must agree).
    firsts: dict[str, Submitted] = {}
    for r in result.records:
        if r.kind == "resend":
            continue
        seen = firsts.setdefault(r.lease_id, r)
        if seen.verdict != r.verdict:
            problems.append(f"{r.lease_id}: concurrent twins got {seen.verdict} and {r.verdict}")
    for r in result.records:
        if r.kind == "resend" and r.verdict != firsts[r.lease_id].verdict:
            problems.append(
                f"{r.lease_id}: re-send got {r.verdict}, first {firsts[r.lease_id].verdict}"
            )
    rejected = [r for r in firsts.values() if isinstance(r.verdict, Reject)]
    for r in rejected[:5]:
        problems.append(f"honest submission {r.lease_id} rejected: {r.verdict}")
    if len(rejected) > 5:
        problems.append(f"... {len(rejected)} honest submissions rejected in all")
    acked = [k for r in firsts.values() if isinstance(r.verdict, Ack) for k in r.keys]
    lost = set(acked) - set(feed_keys)
    if lost:
        problems.append(f"{len(lost)} acknowledged samples missing from the feed, e.g. {min(lost)}")
    if len(set(feed_keys)) != len(feed_keys):
        dup = [k for k, n in Counter(feed_keys).items() if n > 1]
        problems.append(f"{len(dup)} samples twice in the feed, e.g. {dup[0]}")
    seqs = [r.seq for r in feed]
    if seqs != sorted(set(seqs)):
        problems.append("feed sequence numbers are not strictly increasing")
    accepted = result.status.get("rollouts_accepted")
    if not accepted == len(feed) == len(acked):
        problems.append(
            f"rollouts_accepted {accepted}, feed {len(feed)}, acknowledged samples {len(acked)}"
        )
    groups: defaultdict[int, set[str]] = defaultdict(set)
    for row in feed:
        groups[prompt_index(row.prompt_id)].add(row.lease_id)
    twice = {p: leases for p, leases in groups.items() if len(leases) > 1}
    if twice:
        p = min(twice)
        problems.append(f"{len(twice)} prompts accepted in two groups, e.g. {p}: {twice[p]}")
    for e in result.errors[:5]:
        problems.append(f"no answer: {e}")
    if not result.alive:
        problems.append("the coordinator process died")
    for line in result.log_alarms[:5]:
        problems.append(f"coordinator log: {line[:200]}")
    return problems


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(result: LoadResult) -> dict[str, float | int | str]:
    """The figures of a run (window = load start -> last verdict)."""
    window = [r for r in result.records if r.answered_at >= result.started]
    fresh = [r for r in window if r.kind != "resend"]
    resends = [r for r in window if r.kind == "resend"]
    leases = {r.lease_id: r for r in fresh}
    acks = [r for r in leases.values() if isinstance(r.verdict, Ack)]
    samples = sum(len(r.keys) for r in acks)
    lat = [r.latency_s for r in fresh]
    wall = max(result.wall_s, 1e-9)
    m = result.metrics
    figures: dict[str, float | int | str] = {
        "nodes": result.spec.nodes,
        "peers": result.spec.peers,
        "seconds": result.spec.seconds,
        "wall_s": round(wall, 2),
        "acks": len(acks),
        "samples": samples,
        "acks_per_s": round(len(acks) / wall, 2),
        "samples_per_s": round(samples / wall, 1),
        "submit_calls": len(window),
        "resends": len(resends),
        "pairs": sum(1 for r in fresh if r.kind == "pair") // 2,
        "unanswered_calls": len(result.retries),  # then re-sent (lease or submission)
        "standby": result.standby,
        "errors": len(result.errors),
        "spot_checks": " ".join(
            f"{label}={int(v)}"
            for k, v in sorted(m.items())
            if k.startswith("swarm_intake_spot_checks_total")
            for label in re.findall(r'result="([^"]*)"', k)
        )
        or "none",
        "feed": len(result.feed),
        "loadavg_1m": round(result.loadavg[0], 2),
        "coordinator_cpu_s": round(result.coordinator_cpu_s, 1),
        "client_cpu_s": round(result.client_cpu_s, 1),
    }
    if lat:
        for q in (50, 95, 99):
            figures[f"ack_p{q}_ms"] = round(percentile(lat, q) * 1e3, 1)
        figures["ack_max_ms"] = round(max(lat) * 1e3, 1)
    if resends:
        figures["resend_p50_ms"] = round(percentile([r.latency_s for r in resends], 50) * 1e3, 1)
    if result.lease_latencies:
        figures["lease_p50_ms"] = round(percentile(result.lease_latencies, 50) * 1e3, 1)
        figures["lease_p99_ms"] = round(percentile(result.lease_latencies, 99) * 1e3, 1)
    return figures


def render(figures: dict[str, float | int | str]) -> str:
    return "  ".join(f"{k}={v}" for k, v in figures.items())
