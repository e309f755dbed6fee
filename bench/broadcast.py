"""Benchmark: star vs peer-assisted checkpoint broadcast, on real (namespace) links or loopback.

Every peer (the seed and N receivers) is a separate process (``swarm.peerproc``). A checkpoint
of M bytes is broadcast to N receivers, *star* (receivers only download from the seed and do not
relay) and/or *peer* (peer-assisted: receivers relay verified chunks at once). We report the time
from GO until the last receiver holds a verified copy, as a ratio to the physical limit M/B (a seed
with uplink B cannot do better), and how many copies of the checkpoint the seed uploaded.
Process start-up is excluded (receivers start, report READY, and only then get GO).

Two kinds of link (``--net``):

* ``netns`` (the figure of record): every peer in its own network namespace (``swarm.netns``),
  veth pairs on a bridge, each uplink shaped by the kernel (``tc tbf`` at B); ``--delay-ms`` adds a
  one-way delay to every packet a peer receives and ``--loss`` drops packets at random (a
  userspace NFQUEUE delay line, ``swarm.delayline``: this kernel has no ``netem``); ``--nat K``
  puts the last K receivers behind NAT routers (alternately port-preserving and symmetric), and
  the seed then also measures each receiver's reachability by a dial-back
  (``swarm.reachability``). Needs root.
* ``loopback`` (quick runs): every peer on 127.0.0.1, uplinks capped in the application
  (token bucket).

    python bench/broadcast.py --suite record        # the netns tables of docs/benchmarks.md
    python bench/broadcast.py --suite loss          # 50 ms each way, 0.1% loss (N = 4, 8)
    python bench/broadcast.py --suite nat           # N = 8 with 0, 4, 8 receivers behind NAT
    python bench/broadcast.py --suite loopback      # the loopback table and docs/broadcast.png
    python bench/broadcast.py --suite issue37 --cpu-per-peer 0.2   # paced vs unpaced, budgets
    python bench/broadcast.py --net netns --delay-ms 20 --ns 8 --modes peer --no-report

``--cpu-per-peer C`` (netns) gives every peer (seed included) its own CPU budget of C cores
(cgroup v1 ``cpu`` quota, ``swarm.netns.Topology.limit_cpu``), so that the peers do not compete
for the machine's cores as they would not across the internet; the budgets must sum to at most
the machine's cores. A suite run with it measures every link twice, without and with the budgets.

Every run also prints where the time went (the receivers' start-up marks, medians: manifest
verified, first DHT holder lookup answered, first chunk request sent, first bytes read; their
per-chunk timelines: the first chunk, every chunk somewhere in the swarm, the first chunk from a
peer, 95 % of all copies, the last one), the DHT holder publications (and how many failed or
timed out) and lookups, and the CPU the peers used from GO to the last receiver's DONE per GiB
moved one hop (p2pd, the peer's Python process and its DHT process apart, from /proc of every
peer's process tree; background upkeep included, which is what dominates on slow links).

Each suite rewrites only its own section of docs/benchmarks.md (``bench/_report.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _cpu import tree_cpu  # noqa: E402
from _report import write_section  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Link:
    """How the peers are connected in one series of runs."""

    net: str = "netns"  # "netns" or "loopback"
    delay_ms: float = 0.0  # one-way delay added to every packet a peer receives (netns)
    loss: float = 0.0  # probability of dropping a packet (netns)
    nat: int = 0  # receivers behind NAT routers (netns)
    app_cap: bool = False  # also cap uploads in the application (always on for loopback)
    dht_only: bool = False  # receivers learn holders from the DHT only (the old protocol)
    window: bool = True  # chunk answers paced by the bulk window (False: unpaced, before #37)
    cpu: float = 0.0  # CPU budget per peer, cores (netns; 0: none)

    def label(self) -> str:
        if self.cpu:
            return replace(self, cpu=0.0).label() + f" — {self.cpu:g} CPU/peer"
        if not self.window:
            return replace(self, window=True).label() + " — unpaced chunks"
        if self.dht_only:
            return replace(self, dht_only=False).label() + " — DHT-only holder info"
        if self.net == "loopback":
            return "loopback, in-app cap"
        parts = ["tc tbf" + (" + in-app cap" if self.app_cap else "")]
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g} ms each way")
        if self.loss:
            parts.append(f"{self.loss:.1%} loss")
        if self.nat:
            parts.append(f"{self.nat} behind NAT")
        return " + ".join(parts)


@dataclass
class Result:
    link: Link
    mode: str
    n: int
    t_last: float | None  # None: the run failed
    ratio: float | None
    seed_copies: float | None
    error: str = ""
    natted_share: float | None = None  # chunks served by NATed receivers / all chunks received
    reachability: dict[str, int] = field(default_factory=dict)  # receivers per measured class
    dht_timeouts: int = 0  # receivers' holder publications that timed out (sum)
    dht_failures: int = 0  # ... that failed for any reason (sum)
    dht_lookups: int = 0  # receivers' DHT holder lookups (sum)
    dht_published: int = 0  # receivers' holder publications that succeeded (sum)
    direct_calls: int = 0  # chunk answers over direct TCP connections (--peer-args --direct)
    phases: dict[str, float] = field(default_factory=dict)  # where the time went (s after GO)
    cpu_per_gib: dict[str, float] = field(default_factory=dict)  # CPU-s per GiB and hop


def phases(
    timelines: list[list[tuple[float, int, str]]],
    seed: str,
    n_chunks: int,
    marks: list[dict[str, float]] | None = None,
) -> dict[str, float]:
    """Where the time went, from the receivers' per-chunk timelines ((seconds after GO, chunk,
    source peer) each) and their start-up marks (seconds after GO: ``start`` the manifest is
    verified, ``lookup`` the first DHT holder lookup answered, ``request`` the first chunk
    request sent, ``byte`` its first bytes read; the medians come out as ``m_<name>``):
    ``first`` (median first chunk: start-up), ``spread`` (every chunk held
    by some receiver: the seed's slots), ``p2p`` (median first chunk from a peer: holder
    discovery), ``copies95`` (95 % of all copies held) and ``last`` (the tail after it is
    ``last - copies95``)."""
    firsts: list[float] = []
    p2p: list[float] = []
    arrivals: list[float] = []
    first_copy: dict[int, float] = {}
    for timeline in timelines:
        tl = sorted(timeline)
        if not tl:
            continue
        firsts.append(tl[0][0])
        from_peer = [t for t, _i, peer in tl if peer != seed]
        if from_peer:
            p2p.append(from_peer[0])
        for t, i, _peer in tl:
            arrivals.append(t)
            first_copy[i] = min(first_copy.get(i, t), t)
    if not arrivals:
        return {}
    arrivals.sort()
    out = {
        "first": statistics.median(firsts),
        "spread": max(first_copy.values()) if len(first_copy) == n_chunks else float("nan"),
        "p2p": statistics.median(p2p) if p2p else float("nan"),
        "copies95": arrivals[min(len(arrivals) - 1, int(0.95 * len(arrivals)))],
        "last": arrivals[-1],
    }
    for name in ("start", "lookup", "request", "byte"):
        got = [m[name] for m in marks or [] if name in m]
        if got:
            out[f"m_{name}"] = statistics.median(got)
    return out


class Bench:
    """One link configuration: topology (netns), seed process, runs of N receivers."""

    def __init__(self, args: argparse.Namespace, link: Link, tmp: Path, n_max: int) -> None:
        self.args, self.link, self.tmp, self.n_max = args, link, tmp, n_max
        self.size = int(args.size_mib * MIB)
        self.cap = args.cap_mib * MIB
        self.topo: Any = None
        #: receivers measure their reachability (dial-back by the seed) and announce only if public
        self.probe = link.net == "netns" and (link.nat > 0 or args.suite == "nat")
        self.hosts: list[Any] = []
        self.seed: Any = None
        self.boot_peer: Any = None
        self.version = 0

    async def start(self, seed_store: Path, coord_key: str) -> None:
        from swarm.peerproc import PeerProcess

        common = ["--coordinator-key", coord_key, *shlex.split(self.args.peer_args)]
        if self.link.dht_only:
            common.append("--no-exchange")
        if not self.link.window:
            common.append("--no-window")
        if self.link.net == "loopback" or self.link.app_cap:
            common += ["--upload-rate", str(self.cap)]
        self.common = common
        seed_args = ["--store", str(seed_store), *common]
        if self.link.net == "netns":
            from swarm.netns import Topology

            self.topo = Topology()
            seed_host = self.topo.add_public("seed")
            public = self.n_max - self.link.nat
            self.hosts = [self.topo.add_public(f"r{i}") for i in range(public)]
            for i in range(public, self.n_max):
                kind = "cone" if (i - public) % 2 == 0 else "symmetric"
                router = self.topo.add_nat(f"nat{i}", kind)
                self.hosts.append(self.topo.add_private(f"r{i}", router))
            for h in [seed_host, *self.hosts]:
                self.topo.shape(h, self.cap)
                if self.link.cpu:
                    self.topo.limit_cpu(h, self.link.cpu)
            if self.link.delay_ms or self.link.loss:
                self.topo.add_delay(self.link.delay_ms / 1000, loss=self.link.loss)
            seed_args += ["--host", seed_host.ip]
            if self.probe:
                seed_args.append("--dialback-server")
            self.seed = PeerProcess(
                seed_args, log_path=str(self.tmp / "seed.log"), prefix=seed_host.argv([])
            )
            await self.seed.start()
            self.boot = [m for m in self.seed.maddrs if f"/{seed_host.ip}/" in m]
        else:
            from swarm.testing import start_loopback_peer

            self.boot_peer = await start_loopback_peer()
            self.boot = await self.boot_peer.visible_maddrs()
            self.seed = PeerProcess(seed_args, log_path=str(self.tmp / "seed.log"))
            for maddr in self.boot:
                self.seed.args += ["--bootstrap", maddr]
            await self.seed.start()

    async def stop(self) -> None:
        if self.seed is not None:
            await self.seed.close()
        if self.boot_peer is not None:
            await self.boot_peer.stop()
        if self.topo is not None:
            self.topo.close()

    async def run(self, mode: str, n: int, version: int, n_chunks: int) -> Result:
        from swarm.peerproc import PeerProcess

        procs: list[PeerProcess] = []
        natted: list[bool] = []
        for i in range(n):
            d = self.tmp / f"v{version}-r{i}"
            argv = ["--store", str(d), "--seed", self.seed.peer_id, "--version", str(version)]
            argv += self.common + (["--no-relay"] if mode == "star" else [])
            for maddr in self.boot:
                argv += ["--bootstrap", maddr]
            prefix: list[str] = []
            if self.topo is not None:
                # receivers 0..n-1; with NAT, the NATed ones are taken from the end of the list
                host = self.hosts[i] if i < n - self.link.nat else self.hosts[self.n_max - n + i]
                argv += ["--host", host.ip]
                if self.probe:
                    argv += ["--probe-reachability", self.seed.peer_id]
                prefix = host.argv([])
                natted.append(host.natted)
            else:
                natted.append(False)
            log = str(self.tmp / f"v{version}-r{i}.log")
            procs.append(PeerProcess(argv, log_path=log, prefix=prefix))
        result = Result(self.link, mode, n, None, None, None)
        try:
            await asyncio.gather(*(p.start() for p in procs))
            pids = [p.proc.pid for p in [self.seed, *procs] if p.proc is not None]
            await asyncio.sleep(1.0)  # let DHT routing (and reachability probes) settle
            cpu0 = [tree_cpu(pid) for pid in pids]
            t0 = time.time()
            for p in procs:
                p.go()
            limit = self.args.timeout or 2 * n * self.size / self.cap + 60
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait_done() for p in procs)), limit)
            except TimeoutError:
                stuck = [(p.peer_id[-8:], p.progress) for p in procs if p.done_at is None]
                for p in procs:
                    if p.done_at is None:
                        p.dump_tasks()
                await asyncio.sleep(2.0)
                self.args.keep = True  # keep the peer logs for the post-mortem
                result.error = f"timed out; stuck: {stuck}; logs: {self.tmp}"
                return result
            errors = [p.error for p in procs if p.error]
            if errors:
                self.args.keep = True
                result.error = f"{errors[0]} (logs: {self.tmp})"
                return result
            t_last = max(p.done_at or 0.0 for p in procs) - t0
            cpu1 = [tree_cpu(pid) for pid in pids]
            hops = n * self.size / (1 << 30)  # GiB moved one hop (each receiver gets M once)
            for kind in ("p2pd", "python", "dht"):
                used = sum(b[kind] - a[kind] for a, b in zip(cpu0, cpu1, strict=True))
                # everything the peers burned from GO to the last receiver's DONE: a rate "at
                # rest" taken before GO and subtracted was start-up work (DHT joins, routing),
                # and extrapolated over a slow run it hid p2pd's whole figure (0.0)
                result.cpu_per_gib[kind] = used / hops
            result.cpu_per_gib["total"] = sum(result.cpu_per_gib.values())
            result.t_last, result.ratio = t_last, t_last / (self.size / self.cap)
            stats: list[dict[str, Any]] = [dict(p.stats) for p in procs]
            for st in stats:
                result.dht_timeouts += int(st.get("dht_timeouts", 0))
                result.dht_failures += int(st.get("dht_failures", 0))
                result.dht_lookups += int(st.get("dht_lookups", 0))
                result.dht_published += int(st.get("dht_published", 0))
                result.direct_calls += int(st.get("direct_calls", 0))
            timelines, marks = [], []
            for p, st in zip(procs, stats, strict=True):
                off = (p.done_at or t0) - t0 - float(st.get("seconds", 0.0))  # its start - GO
                timelines.append([(t + off, i, peer) for t, i, peer in st.get("timeline", [])])
                marks.append({k: t + off for k, t in st.get("marks", {}).items()})
            result.phases = phases(timelines, self.seed.peer_id, n_chunks, marks)
            sources: list[dict[str, int]] = [st.get("sources", {}) for st in stats]
            from_seed = sum(int(s.get(self.seed.peer_id, 0)) for s in sources)
            result.seed_copies = from_seed / n_chunks
            ids = {p.peer_id: nat for p, nat in zip(procs, natted, strict=True)}
            total = sum(sum(s.values()) for s in sources)
            by_nat = sum(c for s in sources for k, c in s.items() if ids.get(k))
            result.natted_share = by_nat / total if total else 0.0
            if self.args.timeline:
                with open(self.args.timeline, "a") as fh:
                    fh.write(json.dumps({
                        "link": self.link.label(), "mode": mode, "n": n, "t_last": t_last,
                        "seed": self.seed.peer_id, "go": t0,
                        "receivers": {p.peer_id: {"natted": nat, "done": (p.done_at or 0) - t0,
                                                  "timeline": p.stats.get("timeline", [])}
                                      for p, nat in zip(procs, natted, strict=True)},
                    }) + "\n")  # fmt: skip
            for p in procs:
                reach = str(p.stats.get("reachability", "-"))
                result.reachability[reach] = result.reachability.get(reach, 0) + 1
            if self.args.verbose:
                for p, nat in zip(procs, natted, strict=True):
                    src = p.stats.get("sources", {})
                    assert isinstance(src, dict)
                    print(
                        f"    {p.peer_id[-6:]}{' (NAT)' if nat else ''} done "
                        f"+{(p.done_at or 0) - t0:5.2f} s, {src.get(self.seed.peer_id, 0)} "
                        f"chunks from the seed, {sum(src.values())} total, "
                        f"reachability {p.stats.get('reachability', '-')}"
                    )
            return result
        finally:
            await asyncio.gather(*(p.close() for p in procs))
            for i in range(n):
                shutil.rmtree(self.tmp / f"v{version}-r{i}", ignore_errors=True)


async def run_series(
    args: argparse.Namespace, links: list[Link], modes: list[str], ns: list[int]
) -> list[Result]:
    """Every (link, mode, N) combination ``args.repeats`` times; one topology per link."""
    from protocol.identity import Identity
    from protocol.manifest import build_manifest, sign_manifest
    from swarm.chunks import ChunkStore

    size = int(args.size_mib * MIB)
    files = {"model.safetensors": os.urandom(size)}
    coord = Identity.generate()
    tmp = Path(tempfile.mkdtemp(prefix="bench-broadcast-"))
    os.chmod(tmp, 0o755)
    plan = [(mode, n) for mode in modes for n in ns for _ in range(args.repeats)]
    results: list[Result] = []
    try:
        for li, link in enumerate(links):
            seed_dir = tmp / f"seed{li}"
            store = ChunkStore(seed_dir, keep_versions=len(plan))
            now = time.time()
            n_chunks = 0
            for version in range(1, len(plan) + 1):  # a fresh version per run
                manifest, chunks = build_manifest(
                    files, version=version, parent_version=None, model_config_hash="00",
                    tokenizer_hash="00", created_at=now, expires_at=now + 86400,
                    chunk_size=int(args.chunk_kib * 1024),
                )  # fmt: skip
                store.seed(sign_manifest(manifest, coord, now), manifest, chunks)
                n_chunks = len(chunks)
            bench = Bench(args, link, tmp, max(ns))
            await bench.start(seed_dir, coord.public_key.hex())
            try:
                for version, (mode, n) in enumerate(plan, start=1):
                    r = await bench.run(mode, n, version, n_chunks)
                    results.append(r)
                    print(_line(r), flush=True)
            finally:
                await bench.stop()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    return results


def _line(r: Result) -> str:
    head = f"{r.link.label():42s} {r.mode:4s} N={r.n}:"
    if r.t_last is None:
        return f"{head} FAILED: {r.error}"
    extra = ""
    if r.link.nat:
        extra = f", {r.natted_share:.0%} of chunks served by NATed peers, reach {r.reachability}"
    if r.direct_calls:
        extra += f", {r.direct_calls} chunk answers over direct connections"
    ph = r.phases
    timeline = (
        f"\n    where the time went (s after GO): manifest {ph.get('m_start', 0):.2f}, "
        f"first lookup {ph.get('m_lookup', 0):.2f}, first request {ph.get('m_request', 0):.2f}, "
        f"first byte {ph.get('m_byte', 0):.2f}, first chunk {ph.get('first', 0):.2f}, "
        f"every chunk in the swarm {ph.get('spread', 0):.2f}, "
        f"first chunk from a peer {ph.get('p2p', 0):.2f}, "
        f"95% of copies {ph.get('copies95', 0):.2f}, last {ph.get('last', 0):.2f}"
        if ph else ""
    )  # fmt: skip
    cpu = r.cpu_per_gib
    return (
        f"{head} last receiver after {r.t_last:6.2f} s = {r.ratio:5.2f} x M/B "
        f"(seed uploaded {r.seed_copies:.2f} copies{extra}); DHT publications failed "
        f"{r.dht_failures} (timed out {r.dht_timeouts}) of {r.dht_published + r.dht_failures}, "
        f"holder lookups {r.dht_lookups}; "
        f"CPU-s per GiB and hop "
        f"{cpu.get('total', 0):.1f} (p2pd {cpu.get('p2pd', 0):.1f}, Python "
        f"{cpu.get('python', 0):.1f}, DHT process {cpu.get('dht', 0):.1f}); load average "
        f"{os.getloadavg()[0]:.1f}{timeline}"
    )


def _cell(rs: list[Result], key: str = "ratio") -> str:
    ok = [getattr(r, key) for r in rs if getattr(r, key) is not None]
    failed = len(rs) - len(ok)
    if not ok:
        return "failed" if rs else "-"
    med = statistics.median(ok)
    fmt = "{:.0%}" if key == "natted_share" else "{:.2f}"
    text = fmt.format(med)
    if len(ok) > 1:
        text += f" ({fmt.format(min(ok))}–{fmt.format(max(ok))})"
    return text + (f", {failed} failed" if failed else "")


def _conditions(args: argparse.Namespace) -> str:
    return (
        f"M = {args.size_mib:g} MiB, {args.chunk_kib:g} KiB chunks, every uplink B = "
        f"{args.cap_mib:g} MiB/s, M/B = {args.size_mib / args.cap_mib:.2f} s; {args.repeats} "
        f"run(s) per cell (median, range); machine: {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )


def report_record(args: argparse.Namespace, results: list[Result]) -> None:
    links = list(dict.fromkeys(r.link for r in results))
    ns = sorted({r.n for r in results})
    default = (args.size_mib, args.cap_mib, args.chunk_kib) == (64.0, 10.0, 1024.0)
    if args.suite == "loss":
        section, title = "broadcast-netns-loss", ", 50 ms each way and 0.1% loss"
    else:
        section = "broadcast-netns" if default else "broadcast-netns-small"
        title = "" if default else ", other sizes"
    lines = [
        f"## Checkpoint broadcast on namespace links{title} "
        f"(`bench/broadcast.py --suite {args.suite}`)",
        "",
        "Figure of record. Every peer in its own network namespace, veth pairs on a bridge, each "
        "uplink shaped by the kernel (`tc tbf`, 50 ms queue); delay added by a userspace NFQUEUE "
        "delay line on every packet a peer receives (`swarm/delayline.py`; this kernel has no "
        "netem). The seed is also the DHT bootstrap peer. Ratio = time from GO to the last "
        f"verified receiver / (M/B). {_conditions(args)}.",
        "",
        "| link | mode | "
        + " | ".join(f"N = {n}" for n in ns)
        + f" | seed copies (N = {ns[-1]}) |",
        "|---|---|" + "---|" * len(ns) + "---|",
    ]
    for link in links:
        for mode in ("peer", "star"):
            rows = [r for r in results if r.link == link and r.mode == mode]
            if not rows:
                continue
            cells = [_cell([r for r in rows if r.n == n]) for n in ns]
            copies = _cell([r for r in rows if r.n == ns[-1]], "seed_copies")
            lines.append(f"| {link.label()} | {mode} | " + " | ".join(cells) + f" | {copies} |")
    lines += ["", f"Command: `{args.command}`"]
    if args.note:
        lines += ["", args.note]
    write_section(section, "\n".join(lines))


def report_nat(args: argparse.Namespace, results: list[Result]) -> None:
    lines = [
        "## Broadcast with receivers behind NAT (`bench/broadcast.py --suite nat`)",
        "",
        "Namespace links as above (`tc tbf` uplinks); the NATed receivers sit each behind its own "
        "NAT router (iptables MASQUERADE, alternately port-preserving and `--random-fully`, "
        "unsolicited inbound dropped). Each receiver measures its reachability by a dial-back "
        "from the seed (`swarm/reachability.py`) and announces itself as a chunk holder only if "
        f"dialable. {_conditions(args)}.",
        "",
        "| receivers behind NAT | t_last / (M/B) | seed copies | chunks served by NATed "
        "receivers | measured reachability |",
        "|---|---|---|---|---|",
    ]
    for link in dict.fromkeys(r.link for r in results):
        rows = [r for r in results if r.link == link]
        n = rows[0].n
        reach: dict[str, int] = {}
        for r in rows[:1]:
            reach = r.reachability
        share = _cell(rows, "natted_share")
        lines.append(
            f"| {link.nat} of {n} | {_cell(rows)} | {_cell(rows, 'seed_copies')} | {share} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(reach.items()))
            + " |"
        )
    lines += ["", f"Command: `{args.command}`"]
    if args.note:
        lines += ["", args.note]
    write_section("broadcast-nat", "\n".join(lines))


def report_issue37(args: argparse.Namespace, results: list[Result]) -> None:
    ns = sorted({r.n for r in results})
    section = f"broadcast-issue37-{args.cap_mib:g}mibs"
    lines = [
        f"## Broadcast near the link limit, {args.cap_mib:g} MiB/s links (`bench/broadcast.py "
        f"--suite issue37`)",
        "",
        "Every peer in its own network namespace, each uplink shaped by `tc tbf` (50 ms queue); "
        "delay by the NFQUEUE delay line. \"unpaced chunks\": the chunk answers written as fast "
        "as the connection takes them (before issue 37); otherwise through the server's bulk "
        "window (`swarm/bulkwindow.py`). \"C CPU/peer\": every peer (seed included) in its own "
        "cgroup with a CPU quota of C cores. DHT timeouts: the receivers' holder publications "
        "that timed out (3 s), summed over a run. CPU: all peers' CPU seconds from GO to the last "
        "receiver's DONE (p2pd + Python + "
        f"DHT process) per GiB moved one hop. {_conditions(args)}.",
        "",
        "| link | " + " | ".join(f"N = {n}" for n in ns)
        + f" | seed copies (N = {ns[-1]}) | DHT timeouts (N = {ns[-1]}) | CPU-s/GiB/hop |",
        "|---|" + "---|" * len(ns) + "---|---|---|",
    ]  # fmt: skip
    for link in dict.fromkeys(r.link for r in results):
        rows = [r for r in results if r.link == link]
        last = [r for r in rows if r.n == ns[-1]]
        timeouts = ", ".join(str(r.dht_timeouts) for r in last if r.t_last is not None) or "-"
        cpu = [r.cpu_per_gib["total"] for r in last if r.cpu_per_gib]
        cells = [_cell([r for r in rows if r.n == n]) for n in ns]
        lines.append(
            f"| {link.label()} | " + " | ".join(cells)
            + f" | {_cell(last, 'seed_copies')} | {timeouts} | "
            + (f"{statistics.median(cpu):.1f}" if cpu else "-") + " |"
        )  # fmt: skip
    lines += [
        "",
        f"Where the time went at N = {ns[-1]} (seconds after GO, first run of each link):",
        "",
    ]
    lines += ["| link | first chunk | every chunk in the swarm | first chunk from a peer | "
              "95 % of copies | last |", "|---|---|---|---|---|---|"]  # fmt: skip
    for link in dict.fromkeys(r.link for r in results):
        first = next((r for r in results if r.link == link and r.n == ns[-1] and r.phases), None)
        if first is not None:
            ph = first.phases
            lines.append(
                f"| {link.label()} | {ph['first']:.2f} | {ph['spread']:.2f} | "
                f"{ph['p2p']:.2f} | {ph['copies95']:.2f} | {ph['last']:.2f} |"
            )
    lines += ["", f"Command: `{args.command}`"]
    if args.note:
        lines += ["", args.note]
    write_section(section, "\n".join(lines))


def report_loopback(args: argparse.Namespace, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ideal = args.size_mib / args.cap_mib
    ns = sorted({r.n for r in results})
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("star", "o-"), ("peer", "s-")):
        pts = [(r.n, r.t_last) for r in results if r.mode == mode and r.t_last is not None]
        label = "star (seed only)" if mode == "star" else "peer-assisted"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.plot(ns, [n * ideal for n in ns], ":", color="gray", label="N·M/B (star model)")
    ax.axhline(ideal, ls="--", color="black", label="M/B (seed limit)")
    ax.set_xlabel("receivers N")
    ax.set_ylabel("time to last receiver (s)")
    ax.set_title(f"broadcast of {args.size_mib:g} MiB, every uplink {args.cap_mib:g} MiB/s")
    ax.set_xticks(ns)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "broadcast.png", dpi=120)
    lines = [
        "## Checkpoint broadcast on loopback: star vs peer-assisted (`bench/broadcast.py "
        "--suite loopback`)",
        "",
        "Quick runs: seed and receivers are separate processes on 127.0.0.1 (libp2p streams via "
        "p2pd), uploads capped in the application (token bucket). "
        f"{_conditions(args)}.",
        "",
        "| N | star / (M/B) | peer / (M/B) | seed copies (peer) |",
        "|---|---|---|---|",
    ]
    for n in ns:
        s = [r for r in results if r.mode == "star" and r.n == n]
        p = [r for r in results if r.mode == "peer" and r.n == n]
        lines.append(f"| {n} | {_cell(s)} | {_cell(p)} | {_cell(p, 'seed_copies')} |")
    lines += ["", "![broadcast](broadcast.png)", "", f"Command: `{args.command}`"]
    if args.note:
        lines += ["", args.note]
    write_section("broadcast", "\n".join(lines))


SUITES = {
    # name: (links, modes, ns)
    "record": (
        [Link(), Link(dht_only=True), Link(delay_ms=20.0), Link(delay_ms=20.0, dht_only=True)],
        ["peer"],
        [4, 8],
    ),
    # the issue's last row: a long, lossy path (each way), with and without the exchange's tables
    "loss": (
        [Link(delay_ms=50.0, loss=0.001), Link(delay_ms=50.0, loss=0.001, dht_only=True)],
        ["peer"],
        [4, 8],
    ),
    "nat": ([Link(nat=0), Link(nat=4), Link(nat=8)], ["peer"], [8]),
    # issue 37: chunk answers paced by the bulk window or not, with and without 20 ms each way
    # (--cpu-per-peer adds the same links with a CPU budget per peer)
    "issue37": (
        [Link(), Link(window=False), Link(delay_ms=20.0), Link(delay_ms=20.0, window=False)],
        ["peer"],
        [8],
    ),
    "loopback": ([Link(net="loopback")], ["star", "peer"], [1, 2, 4, 8]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), help="a predefined series (writes a report)")
    p.add_argument("--net", choices=["netns", "loopback"], default="netns")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netns)")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss probability (netns)")
    p.add_argument("--nat", type=int, default=0, help="receivers behind NAT (netns)")
    p.add_argument("--app-cap", action="store_true", help="netns: also cap in the application")
    p.add_argument("--size-mib", type=float, default=64.0, help="checkpoint size M (MiB)")
    p.add_argument("--cap-mib", type=float, default=10.0, help="upload cap B per peer (MiB/s)")
    p.add_argument("--chunk-kib", type=float, default=1024.0, help="chunk size (KiB)")
    p.add_argument("--ns", type=int, nargs="+", default=None, help="receiver counts")
    p.add_argument("--modes", nargs="+", default=None, choices=["star", "peer"])
    p.add_argument("--repeats", type=int, default=1, help="runs per (link, mode, N)")
    p.add_argument("--timeout", type=float, default=0.0, help="per-run timeout, s (0: 2·N·M/B+60)")
    p.add_argument("--note", default="", help="free text appended to the report section")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (stores, peer logs)")
    p.add_argument("--verbose", action="store_true", help="per-receiver figures")
    p.add_argument("--timeline", default="", help="append per-chunk arrival times (JSON lines)")
    p.add_argument("--peer-args", default="", help="extra swarm.peerproc flags, one string")
    p.add_argument("--no-report", action="store_true", help="print only, leave docs/ alone")
    p.add_argument(
        "--cpu-per-peer",
        type=float,
        default=0.0,
        help="netns: CPU budget per peer, cores (a suite runs every link both ways)",
    )
    p.add_argument("--no-window", action="store_true", help="unpaced chunk answers (A/B)")
    args = p.parse_args()
    args.command = "python bench/broadcast.py " + " ".join(sys.argv[1:])
    if args.suite:
        links, modes, ns = SUITES[args.suite]
        modes, ns = args.modes or modes, args.ns or ns
    else:
        links = [Link(args.net, args.delay_ms, args.loss, args.nat, args.app_cap,
                      window=not args.no_window)]  # fmt: skip
        modes, ns = args.modes or ["star", "peer"], args.ns or [1, 2, 4, 8]
    if args.cpu_per_peer:
        from swarm.netns import cpu_limit_unavailable

        why = cpu_limit_unavailable()
        if why:
            raise SystemExit(f"--cpu-per-peer is unavailable: {why}")
        peers = max(ns) + 1  # receivers and the seed
        cores = os.cpu_count() or 1
        if peers * args.cpu_per_peer > cores + 1e-9:
            raise SystemExit(
                f"--cpu-per-peer {args.cpu_per_peer:g} x {peers} peers = "
                f"{peers * args.cpu_per_peer:g} cores > the machine's {cores}; use at most "
                f"{cores / peers:.3f}"
            )
        budgeted = [replace(link, cpu=args.cpu_per_peer) for link in links]
        links = budgeted if not args.suite else [*links, *budgeted]
    if any(link.net == "netns" for link in links):
        from swarm.netns import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise SystemExit(f"--net netns is unavailable: {reason}; use --net loopback")
    if any(link.nat > min(ns) for link in links):
        raise SystemExit("--nat must not exceed the smallest N")
    # SIGTERM ends the run like Ctrl-C: processes stopped, namespaces removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = asyncio.run(run_series(args, links, modes, ns))
    failed = [r for r in results if r.t_last is None]
    print(json.dumps({"runs": len(results), "failed": len(failed)}))
    if args.no_report or not args.suite:
        return
    reports = {"record": report_record, "loss": report_record, "nat": report_nat,
               "issue37": report_issue37}  # fmt: skip
    reports.get(args.suite, report_loopback)(args, results)
    print(f"wrote the {args.suite} section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
