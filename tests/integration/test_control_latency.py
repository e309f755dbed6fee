"""Control ahead of bulk (issue 37): on a rate-limited link, a control RPC and a DHT store made
while chunk-sized answers stream over the same libp2p connection wait about as long as when the
link is idle, because bulk answers go through the server's bulk window (``swarm.bulkwindow``).

Topology: two peers, each in its own network namespace; the server's uplink is shaped to 1 MiB/s
by ``tc tbf`` (50 ms queue) and every packet is delayed 20 ms each way (the NFQUEUE delay line),
so an idle control round trip is ~40 ms of wire plus p2pd, and queueing shows as extra delay.
Four loops fetch 1 MiB answers from the server meanwhile (the uplink saturated), as a seed
serving receivers does. Without the window (``--mode plain``) the control answer queues behind
the yamux send queue and the TCP send buffer of that connection: on this machine its p50 was
~1.0 s, p99 ~2.0 s, and a DHT store took up to 3.2 s (over the holder directory's 3 s timeout).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm.netns import Topology, iptables_command

PEER = str(Path(__file__).with_name("control_latency_peer.py"))
RATE = 1 << 20  # bytes/s on the server's uplink
DELAY = 0.02  # seconds each way


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile by nearest rank (q=0.99 with under 100 samples is the largest one)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def p99(xs: list[float]) -> float:
    return quantile(xs, 0.99)


def run_pair(topology: Topology, mode: str, samples: int = 15) -> dict[str, Any]:
    a, b = topology.add_public("srv"), topology.add_public("cli")
    topology.shape(a, RATE)
    topology.shape(b, RATE)
    topology.add_delay(DELAY)
    server = subprocess.Popen(
        a.argv([sys.executable, PEER, "server", "--host", a.ip]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        ready = server.stdout.readline().split()
        assert ready and ready[0] == "READY", f"server did not start: {ready}"
        out = subprocess.run(
            b.argv([sys.executable, PEER, "client", "--host", b.ip, "--server", ready[1],
                    "--mode", mode, "--samples", str(samples)]),
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
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


@pytest.mark.slow
def test_control_rpc_and_dht_store_do_not_queue_behind_bulk(topology: Topology) -> None:
    if iptables_command() is None:
        pytest.skip("the delay line needs iptables (apt-get install iptables)")
    r = run_pair(topology, "windowed", samples=15)
    idle = statistics.median(r["idle_ping"])
    # The bound is 2x the idle value for the p99. With 30 samples the p99 is the single
    # largest one, and on a 2-core CI machine one ping in 30 can wait out a scheduling slice of
    # the four processes (two p2pd, two Python) that the link has nothing to do with: the clean-
    # clone CI run saw [56 .. 98, 275] ms, idle median 44 ms. So the test bounds the 90th
    # percentile by 2x idle (+100 ms: idle pings alone spread 30-60 ms above their median at load
    # average 8-15 here) and the largest sample by a loose 1 s. Without the window the control
    # answer queues behind the bulk: p50 ~1.0 s, p99 ~2.0 s on this machine, so either bound
    # catches the regression.
    all_ms = sorted(round(x * 1e3) for x in r["busy_ping"])
    busy = quantile(r["busy_ping"], 0.9)
    bound = 2 * idle + 0.1
    assert busy <= bound, (
        f"control RPC p90 {busy * 1e3:.0f} ms during bulk > {bound * 1e3:.0f} ms "
        f"(idle median {idle * 1e3:.0f} ms); all: {all_ms}"
    )
    assert max(r["busy_ping"]) < 1.0, f"a control RPC waited over 1 s during bulk; all: {all_ms}"
    # DHT stores (hivemind's own streams on the same connection, not paced by us) must stay far
    # from the holder directory's 3 s timeout: a third of it.
    store = p99(r["busy_store"])
    assert store < 1.0, f"DHT store p99 {store:.2f} s during bulk (idle {r['idle_store']})"
    # ... and the bulk still fills the link (the window must not starve it): half the rate at
    # least on a loaded machine (1.1 MiB/s measured on this one, the link's own limit ~1.0).
    assert r["bulk_rate"] >= 0.5 * RATE, f"bulk only {r['bulk_rate'] / RATE:.2f} of the link"
