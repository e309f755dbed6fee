"""Load: N simulated nodes against one real coordinator process, for a fixed wall time.

The scenario of ``tests/integration/test_load.py`` (``tests/integration/load_scenario.py``), run
longer: a ``swarm coordinator launch`` subprocess (spot check on 5% of leases, activation off) and
a trainer-like publisher of v1; N nodes, each with its own Ed25519 identity, spread over a few
libp2p peers in this process, register, lease, sample honest results of their lease with the
``hf`` backend on the published weights (one worker thread for all of them) and submit them
through ``node.client.CoordinatorClient``. Every 5th node re-sends each answered submission once;
every 10th sends each submission twice at the same time. The invariants of the test are checked
too (lost or doubled rollouts, counts, prompts in two groups, re-send verdicts, a live
coordinator, a clean log); any violation is printed and makes the exit status 1.

Figures: acknowledged submissions and samples per second over the window (start -> last
verdict), ack latency (first send -> verdict, re-sends of an unanswered call included) of the
fresh honest submissions, lease latency, and CPU seconds of the coordinator process.

Usage: python bench/load.py [--nodes 50] [--peers 5] [--seconds 60] [--no-write]
Writes its section of docs/benchmarks.md (between the bench:load markers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _report import write_section  # noqa: E402
from load_scenario import LoadSpec, check, render, run_load, summary  # noqa: E402

SECTION = "load"


def report(figures: dict[str, float | int | str], problems: list[str]) -> str:
    f = figures
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "## Load: simulated nodes against a real coordinator (`bench/load.py`)",
        "",
        f"{f['nodes']} nodes (own Ed25519 identities) on {f['peers']} libp2p peers in one "
        "process, a `swarm coordinator launch` subprocess (SQLite WAL `synchronous=FULL`, spot "
        "check on 5% of leases, activation off), all on 127.0.0.1 of one machine with "
        f"{os.cpu_count()} CPUs shared with other work (load average at the end "
        f"{f['loadavg_1m']}), Python {platform.python_version()}. Each node loops "
        "lease -> honest `hf` sampling of that lease (G = 4, <= 4 new tokens, one worker "
        "thread for all nodes) -> submit, for "
        f"{f['seconds']:g} s; every 5th node re-sends each answered submission, every 10th "
        "sends each twice at once. Latency: first send -> verdict. Invariants checked: "
        + ("all held." if not problems else f"**{len(problems)} violated** (see the output)."),
        "",
        "| acks | samples | acks/s | samples/s | ack p50 ms | p95 | p99 | max | "
        "lease p50 ms | re-sends | twin pairs | spot checks | coordinator CPU s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        f"| {f['acks']} | {f['samples']} | {f['acks_per_s']} | {f['samples_per_s']} | "
        f"{f.get('ack_p50_ms', '-')} | {f.get('ack_p95_ms', '-')} | {f.get('ack_p99_ms', '-')} | "
        f"{f.get('ack_max_ms', '-')} | {f.get('lease_p50_ms', '-')} | {f['resends']} | "
        f"{f['pairs']} | {f['spot_checks']} | {f.get('coordinator_cpu_s', '-')} |",
        f"<!-- bench:{SECTION}:end -->",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50, help="simulated nodes")
    parser.add_argument("--peers", type=int, default=5, help="libp2p peers carrying them")
    parser.add_argument("--seconds", type=float, default=60.0, help="wall time of the load")
    parser.add_argument("--spot-check", type=float, default=0.05, help="fraction of leases")
    parser.add_argument("--no-write", action="store_true", help="do not update benchmarks.md")
    args = parser.parse_args()
    spec = LoadSpec(
        nodes=args.nodes,
        peers=args.peers,
        seconds=args.seconds,
        spot_check_fraction=args.spot_check,
    )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run_load(Path(tmp), spec, log=True))
    figures = summary(result)
    problems = check(result)
    print(render(figures))
    for line in problems:
        print("VIOLATED:", line)
    text = report(figures, problems)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"\nwrote {ROOT / 'docs' / 'benchmarks.md'} (bench:{SECTION} section)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
