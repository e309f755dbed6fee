"""Benchmark: a control RPC's and a DHT store's latency while chunk-sized answers stream over the
same libp2p connection, with chunk answers paced by the bulk window or unpaced (issue 37).

Two peers, each in its own network namespace (``swarm.netns``); both uplinks shaped by ``tc tbf``
at ``--cap-mib`` MiB/s (50 ms queue) and ``--delay-ms`` added each way by the NFQUEUE delay line.
The client (``tests/integration/control_latency_peer.py``) measures ``/t/ping`` and a DHT store
idle, then while ``--streams`` loops fetch 1 MiB answers from the server. Needs root.

    sudo python bench/control_latency.py                       # 1 and 10 MiB/s, 0 and 20 ms
    sudo python bench/control_latency.py --caps 1 --delays 20 --repeats 1 --no-report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # first: bench/protocol.py must not shadow the protocol package

from _report import write_section  # noqa: E402

PEER = str(ROOT / "tests" / "integration" / "control_latency_peer.py")
MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def one(cap: float, delay_ms: float, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from swarm.netns import Topology

    with Topology() as topo:
        a, b = topo.add_public("srv"), topo.add_public("cli")
        topo.shape(a, cap * MIB)
        topo.shape(b, cap * MIB)
        if delay_ms:
            topo.add_delay(delay_ms / 1000)
        argv = a.argv([sys.executable, PEER, "server", "--host", a.ip])
        pipe = subprocess.PIPE
        server = subprocess.Popen(argv, stdin=pipe, stdout=pipe, text=True)
        try:
            assert server.stdout is not None
            ready = server.stdout.readline().split()
            if not ready or ready[0] != "READY":
                raise SystemExit(f"server did not start: {ready}")
            out = subprocess.run(
                b.argv([sys.executable, PEER, "client", "--host", b.ip, "--server", ready[1],
                        "--mode", mode, "--samples", str(args.samples),
                        "--streams", str(args.streams), "--reverse", str(args.reverse)]),
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if out.returncode != 0:
                raise SystemExit(f"client failed: {out.stderr[-2000:]}")
            result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
            return result
        finally:
            if server.stdin is not None:
                server.stdin.close()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--caps", type=float, nargs="+", default=[1.0, 10.0], help="MiB/s")
    p.add_argument("--delays", type=float, nargs="+", default=[0.0, 20.0], help="ms each way")
    p.add_argument("--modes", nargs="+", default=["paced", "unpaced"], choices=["paced", "unpaced"])
    p.add_argument("--samples", type=int, default=25, help="idle samples (2x as many busy)")
    p.add_argument("--streams", type=int, default=4, help="bulk loops of 1 MiB answers")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--reverse", type=int, default=0, help="bulk loops back over the client's uplink"
    )
    p.add_argument("--no-report", action="store_true", help="print only, leave docs/ alone")
    args = p.parse_args()
    from swarm.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"network namespaces are unavailable: {reason}")
    rows = []
    for cap in args.caps:
        for delay in args.delays:
            for mode in args.modes:
                runs = [one(cap, delay, "windowed" if mode == "paced" else "plain", args)
                        for _ in range(args.repeats)]  # fmt: skip
                keys = ("idle_ping", "busy_ping", "idle_store", "busy_store")
                pool = {k: [x for r in runs for x in r[k]] for k in keys}
                row = (
                    f"| {cap:g} MiB/s, {delay:g} ms | {mode} | "
                    f"{statistics.median(pool['idle_ping']) * 1e3:.0f} | "
                    f"{statistics.median(pool['busy_ping']) * 1e3:.0f} | "
                    f"{pct(pool['busy_ping'], 0.99) * 1e3:.0f} | "
                    f"{pct(pool['busy_ping'], 0.99) / statistics.median(pool['idle_ping']):.1f} | "
                    f"{statistics.median(pool['idle_store']) * 1e3:.0f} | "
                    f"{pct(pool['busy_store'], 0.99) * 1e3:.0f} | "
                    f"{sum(x > 3.0 for x in pool['busy_store'])} | "
                    f"{statistics.median(r['bulk_rate'] for r in runs) / (cap * MIB):.2f} |"
                )
                print(row, f"(load average {os.getloadavg()[0]:.1f})", flush=True)
                rows.append(row)
    text = "\n".join([
        "## Control traffic during bulk transfers (`bench/control_latency.py`)",
        "",
        "Two peers in network namespaces, both uplinks `tc tbf` at the rate shown (50 ms queue), "
        "delay each way by the NFQUEUE delay line; the client fetches 1 MiB answers from the "
        f"server in {args.streams} loops and meanwhile calls a control RPC (a few bytes each way) "
        "and stores a DHT value (the server is the DHT's other replica), one after the other, "
        f"{args.samples} idle samples and {2 * args.samples} busy ones per run, "
        f"{args.repeats} run(s) pooled. paced: answers through the bulk window "
        "(`swarm/bulkwindow.py`); unpaced: as before issue 37. Latencies in ms; p99 by nearest "
        f"rank. Machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at "
        "the end.",
        "",
        "| link | chunk answers | RPC idle p50 | RPC busy p50 | RPC busy p99 | busy p99 / idle "
        "p50 | DHT store idle p50 | DHT store busy p99 | DHT stores > 3 s | bulk / link rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Command: `python bench/control_latency.py " + " ".join(sys.argv[1:]) + "`",
    ])  # fmt: skip
    print(text)
    if not args.no_report:
        write_section("control-latency", text)
        print("wrote the control-latency section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
